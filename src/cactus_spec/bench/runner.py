"""The benchmark loop: every configuration on every item, side by side.

Items form the outer loop and configurations the inner one, in reverse order on odd
items, so slow drift of the machine (thermal, background load) hits every configuration
alike and cancels in the per-item speed ratios. Each (configuration, item) result is
appended to results.jsonl, scored (``grading``), as soon as it exists; a rerun skips those
already there. Models are loaded once by the caller; each configuration gets its own
decoder over them.

With ``max_batch`` B > 1 (for throughput: quality runs over hundreds of items) the engine's
configurations decode B items at once (the engine's ``decode_many``): items go in chunks of
``CHUNK_BATCHES`` x B, each chunk through every configuration in turn (reversed on odd
chunks), so an interrupted run still holds every configuration on nearly the same items.
Each row then records the speed of its own stream; each chunk's wall time and tokens go to
batches.jsonl, from which the summary reports every configuration's throughput.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from cactus_spec.bench import memory
from cactus_spec.bench.grading import grade
from cactus_spec.bench.grid import LLAMACPP_METHODS, Config
from cactus_spec.bench.llamacpp import LlamaCppPeers, gguf_of
from cactus_spec.bench.peers import hf_generate
from cactus_spec.bench.plots import write_plots
from cactus_spec.bench.provenance import environment, model_identity
from cactus_spec.bench.report import write_markdown
from cactus_spec.bench.store import SUMMARY_FILE, RunDirectory
from cactus_spec.bench.summary import summarise
from cactus_spec.bench.tasks import Item, TaskSpec
from cactus_spec.core.checks import check_int
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.files import write_json_atomic
from cactus_spec.loading.divergence import quant_divergence
from cactus_spec.loading.models import LoadedModel
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import GenerationResult, Request

Job = tuple[int, Item, Config]
#: The verifier in each weight format the grid asks for ("none", "int8"), or one model.
Verifiers = LoadedModel | Mapping[str, LoadedModel]


#: The run's draft model (None: none), or ``{None: it, key: another draft the grid names}``
#: (keys: ``Config.draft_key``).
Drafts = LoadedModel | None | Mapping[str | None, LoadedModel]


def as_drafts(drafts: Drafts) -> dict[str | None, LoadedModel]:
    """``{Config.draft_key: model}``; a single model (or None) is the run's draft."""
    if drafts is None:
        return {}
    return {None: drafts} if isinstance(drafts, LoadedModel) else dict(drafts)


def as_verifiers(verifiers: Verifiers) -> dict[str, LoadedModel]:
    """``{weight format: verifier}``; a single model stands for its own format."""
    if isinstance(verifiers, LoadedModel):
        return {verifiers.quant: verifiers}
    return dict(verifiers)


#: Items per chunk, in batches of B. Each chunk ends in a tail where fewer and fewer rows
#: are left while a step costs about as much, so longer chunks keep the batch fuller
#: (measured in the quality runs: ``docs/RESULTS.md``, "Quality: executed HumanEval and GSM").
CHUNK_BATCHES = 6


@dataclass(frozen=True)
class BenchSettings:
    """Everything but the models that defines a run."""

    task: TaskSpec
    grid: tuple[Config, ...]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int = 256
    seed: int = 0
    backend: str = "auto"  # the model code of our engine (backends.load)
    max_batch: int = 1  # items the engine decodes at once

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens)
        check_int("max_batch", self.max_batch)
        if not self.grid:
            raise ValueError("the grid holds no configuration")

    @property
    def needs_draft(self) -> bool:
        """Whether some configuration drafts with the run's draft model."""
        return any(c.decoding.needs_draft_model and c.draft_key is None for c in self.grid)

    @property
    def other_drafts(self) -> dict[str, tuple[str | None, int | None, str | None]]:
        """The drafts the grid names besides the run's, in grid order: ``{Config.draft_key:
        (model name, or None for the run's draft model; head size, or None for --draft-vocab;
        weights, or None for --draft-quant)}``."""
        return {
            c.draft_key: (c.draft, c.draft_vocab, c.draft_quant)
            for c in self.grid
            if c.draft_key is not None
        }

    @property
    def verifiers(self) -> list[str]:
        """The verifier weight formats the grid uses, in grid order."""
        return list(dict.fromkeys(c.verifier for c in self.grid))

    def item_seed(self, index: int) -> int:
        """The sampling seed of item ``index``, the same for every configuration."""
        return self.seed + index

    def identity(self, verifiers: Verifiers, drafts: Drafts) -> dict:
        """What results must share to be comparable (see ``store``)."""
        verifiers = as_verifiers(verifiers)
        drafts = as_drafts(drafts)
        verifier = next(iter(verifiers.values()))
        model = verifier.transformers("the bench")
        task = {"name": self.task.name, "n": self.task.n, "seed": self.task.seed}
        if self.task.path is not None:
            data = Path(self.task.path).read_bytes()
            task |= {"path": self.task.path, "sha256": hashlib.sha256(data).hexdigest()}
        env = environment(model.device, model.dtype)
        others = {name: model_identity(m) for name, m in drafts.items() if name is not None}
        return {
            "task": task,
            "grid": [c.id for c in self.grid],
            "configs": [c.as_dict() for c in self.grid],
            "sampling": asdict(self.sampling),
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "models": {
                "target": model_identity(verifier),
                "draft": model_identity(drafts.get(None)),
                "verifiers": {quant: model_identity(m) for quant, m in verifiers.items()},
                **({"other_drafts": others} if others else {}),  # absent: as recorded before
            },
            "setup": {
                **{key: env[key] for key in ("device", "dtype", "threads")},
                "backend": self.backend,
                "max_batch": self.max_batch,
            },
        }


def schedule(
    items: Sequence[Item], grid: Sequence[Config], done: set[tuple[str, str]]
) -> list[Job]:
    """(index, item, configuration) in run order: items outside, configurations inside,
    reversed on odd items; pairs already done are left out."""
    jobs = []
    for index, item in enumerate(items):
        order = grid if index % 2 == 0 else list(reversed(grid))
        jobs += [(index, item, c) for c in order if (c.id, item.id) not in done]
    return jobs


class Runner:
    """Runs jobs on loaded models and records one row per (configuration, item)."""

    def __init__(
        self,
        settings: BenchSettings,
        verifiers: Verifiers,
        drafts: Drafts,
    ) -> None:
        self.drafts = as_drafts(drafts)
        if settings.needs_draft and None not in self.drafts:
            raise ValueError("the grid drafts with a draft model, but none was given")
        missing = [name for name in settings.other_drafts if name not in self.drafts]
        if missing:
            raise ValueError(f"the grid names draft models not given: {', '.join(missing)}")
        self.settings = settings
        self.verifiers = as_verifiers(verifiers)
        missing = [quant for quant in settings.verifiers if quant not in self.verifiers]
        if missing:
            raise ValueError(f"the grid asks for a verifier in {', '.join(missing)} weights")
        self.verifier = next(iter(self.verifiers.values()))  # tokenizer, device, the GGUF
        self.draft = self.drafts.get(None)  # the run's, which hf_assisted drafts with too
        self.decoders = {c.id: self._decoder(c) for c in settings.grid if c.engine}
        self.encoder = next(iter(self.decoders.values()), None) or SpeculativeDecoder(
            self.verifier, spec=DecodeSpec.of("ar")
        )  # prompts are encoded once, by one engine over the verifier's tokenizer
        self.llamacpp = self._llamacpp()
        self._prompt_ids: dict[str, list[int]] = {}

    def _decoder(self, config: Config) -> SpeculativeDecoder:
        verifier = self.verifiers[config.verifier]
        spec = config.spec
        draft = self.drafts[config.draft_key] if spec.needs_draft_model else None
        return SpeculativeDecoder(
            verifier, draft, spec, backend=self.settings.backend, max_batch=self.settings.max_batch
        )

    def _llamacpp(self) -> LlamaCppPeers | None:
        """llama.cpp contexts over the verifier's GGUF, if the grid has llama.cpp methods."""
        if not any(c.method in LLAMACPP_METHODS for c in self.settings.grid):
            return None
        context = self.encoder.context_length
        return LlamaCppPeers(gguf_of(self.verifier), context, torch.get_num_threads())

    def prompt_ids(self, item: Item) -> list[int]:
        """The item's prompt as ids (chat template applied to text), shared by every method.
        A bad prompt raises ValueError naming the item's source (file and line) or id."""
        if item.id not in self._prompt_ids:
            try:
                ids = self.encoder.encode(item.prompt, chat=True)
                for decoder in [self.encoder, *self.decoders.values()]:
                    decoder.check_context(len(ids), self.settings.max_new_tokens)
            except ValueError as err:
                raise ValueError(f"{item.source or item.id}: {err}") from None
            self._prompt_ids[item.id] = ids
        return self._prompt_ids[item.id]

    def run(self, items: Sequence[Item], store: RunDirectory, progress: bool = True) -> int:
        """Run every pending job, appending each result to ``store``; return how many ran."""
        done = store.finished()
        pending = len(schedule(items, self.settings.grid, done))
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
            task = bar.add_task("bench", total=pending)

            def record(row: dict, label: str) -> None:
                store.append(row)
                bar.update(task, advance=1, description=f"{label} | {row['item']}")

            if self.settings.max_batch == 1:
                for index, item, config in schedule(items, self.settings.grid, done):
                    bar.update(task, description=f"{config.label} | {item.id}")
                    record(self.run_one(index, item, config), config.label)
            else:
                self._run_chunks(items, store, done, record)
        return pending

    def _run_chunks(self, items, store: RunDirectory, done, record) -> None:
        """Batched mode (module docstring): chunks of the items some configuration still
        lacks, through every configuration."""
        grid, size = self.settings.grid, CHUNK_BATCHES * self.settings.max_batch
        pending = [
            (i, item)
            for i, item in enumerate(items)
            if any((config.id, item.id) not in done for config in grid)
        ]
        for start in range(0, len(pending), size):
            chunk = pending[start : start + size]
            for config in grid if (start // size) % 2 == 0 else list(reversed(grid)):
                todo = [(i, item) for i, item in chunk if (config.id, item.id) not in done]
                if not todo:
                    continue
                if not config.engine:
                    for index, item in todo:
                        record(self.run_one(index, item, config), config.label)
                    continue
                store.append_batch(self._run_batch(config, todo, record))

    def _run_batch(self, config: Config, todo: list[tuple[int, Item]], record) -> dict:
        """Decode ``todo`` with one engine configuration, B at a time; record each row as it
        finishes; return the batch's record (items, tokens, wall time)."""
        s = self.settings
        requests = [
            Request(
                prompt_ids=self.prompt_ids(item),
                max_new_tokens=s.max_new_tokens,
                seed=s.item_seed(i),
            )
            for i, item in todo
        ]
        device = self.verifier.device
        memory.reset_peak(device)

        def finished(j: int, result) -> None:
            index, item = todo[j]
            measured, peak = _engine_measures(result), memory.peak_bytes(device)
            record(self._row(index, item, config, measured, peak), config.label)

        engine = self.decoders[config.id]
        if config.spec.auto_k:
            engine.own_policy()  # calibrated before the clock starts, as a server's at start-up
        start = time.perf_counter()
        results = engine.decode_many(requests, s.sampling, on_result=finished)
        return {
            "config": config.id,
            "items": [item.id for _, item in todo],
            "new_tokens": sum(r.stats.new_tokens for r in results),
            "wall_s": time.perf_counter() - start,
            "max_batch": s.max_batch,
        }

    def run_one(self, index: int, item: Item, config: Config) -> dict:
        """Generate for one item with one configuration and score it."""
        ids = self.prompt_ids(item)
        device = self.verifier.device
        memory.reset_peak(device)
        measured = self._generate(config, ids, self.settings.item_seed(index))
        return self._row(index, item, config, measured, memory.peak_bytes(device))

    def _row(self, index: int, item: Item, config: Config, measured: dict, peak: int) -> dict:
        """The recorded result of one (configuration, item), with its score."""
        row = {
            "config": config.id,
            "item": item.id,
            "index": index,
            "seed": self.settings.item_seed(index),
            "method": config.method,
            "prompt_tokens": len(self.prompt_ids(item)),
            **measured,
            "peak_memory_bytes": peak,
        }
        return row | grade(self.settings.task.name, [(item, row.get("text"))])[0]

    def _generate(self, config: Config, ids: list[int], seed: int) -> dict:
        """Token ids, text and statistics of one generation."""
        s = self.settings
        if config.engine:
            result = self.decoders[config.id].generate(
                ids,
                s.max_new_tokens,
                temperature=s.sampling.temperature,
                top_k=s.sampling.top_k,
                top_p=s.sampling.top_p,
                seed=seed,
                chat=False,
            )
            if result.interrupted:  # the engine turns Ctrl-C into a partial result
                raise KeyboardInterrupt
            return _engine_measures(result)
        if config.method in LLAMACPP_METHODS:
            assert self.llamacpp is not None  # made for a grid with llama.cpp methods
            peer = self.llamacpp.generate(config, ids, s.max_new_tokens, s.sampling, seed)
        else:
            model = self.verifiers[config.verifier]
            peer = hf_generate(config, model, self.draft, ids, s.max_new_tokens, s.sampling, seed)
        count = len(peer.token_ids)
        return {
            "new_tokens": count,
            "time_total_s": peer.seconds,
            "tokens_per_s": count / peer.seconds if peer.seconds else 0.0,
            "token_ids": peer.token_ids,
            "text": self._decode(peer.token_ids),
        }

    def _decode(self, token_ids: list[int]) -> str | None:
        tokenizer = self.verifier.tokenizer
        if tokenizer is None:
            return None
        # one sequence decodes to one text (transformers types the batch form too)
        return tokenizer.decode(token_ids, skip_special_tokens=True)  # type: ignore[return-value]


def _engine_measures(result: GenerationResult) -> dict:
    """What a row records of one engine generation: statistics, token ids and text."""
    return {**result.stats.as_dict(), "token_ids": result.token_ids, "text": result.text}


def verifier_divergences(verifiers: Verifiers) -> dict[str, dict | None]:
    """The measured KL of each quantised verifier from its bfloat16 original (``divergence``);
    None where it cannot be measured (a model object with no file behind it)."""
    found: dict[str, dict | None] = {}
    for quant, verifier in as_verifiers(verifiers).items():
        if quant == "none":
            continue
        try:
            divergence = quant_divergence(verifier)
            assert divergence is not None  # a quantised verifier has one
            found[quant] = divergence.as_dict()
        except ValueError:
            found[quant] = None
    return found


def run_bench(
    settings: BenchSettings,
    items: Sequence[Item],
    verifiers: Verifiers,
    drafts: Drafts,
    out: str | Path,
    progress: bool = True,
) -> dict:
    """Run (or resume) a benchmark into ``out`` and write its summaries and plots.

    ``verifiers``: the verifier, or one per weight format the grid names (``{"none": bf16,
    "int8": int8}``); ``drafts``: the run's draft model, or ``{None: it, name: model}`` with
    every other draft the grid names. Returns the summary (also in summary.json). Refuses an
    ``out`` holding another run. Every prompt is encoded and checked first, so bad input
    writes nothing.
    """
    identity = settings.identity(verifiers, drafts)
    runner = Runner(settings, verifiers, drafts)
    for item in items:
        runner.prompt_ids(item)
    store = RunDirectory(out, identity)
    divergences = verifier_divergences(verifiers)
    runner.run(items, store, progress)
    model = runner.verifier.transformers("the bench")
    meta = {
        "run": identity,
        "environment": environment(model.device, model.dtype),
        "verifier_divergence": divergences,
    }
    return write_summaries(store, settings.grid, items, meta)


def write_summaries(
    store: RunDirectory, grid: Sequence[Config], items: Sequence[Item], meta: dict
) -> dict:
    """summary.json, summary.md and the plots of a run directory, from its records."""
    summary = summarise(store.rows(), grid, items, meta, store.batch_rows())
    write_json_atomic(store.path / SUMMARY_FILE, summary)
    write_markdown(store.path / "summary.md", summary)
    write_plots(store.path, summary)
    return summary
