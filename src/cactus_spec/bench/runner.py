"""The benchmark loop: every configuration on every item, side by side.

Items form the outer loop and configurations the inner one, in reverse order on odd
items, so slow drift of the machine (thermal, background load) hits every configuration
alike and cancels in the per-item speed ratios. Each (configuration, item) result is
appended to results.jsonl as soon as it exists; a rerun skips those already there.
Models are loaded once by the caller; each configuration gets its own decoder over them.
"""

from __future__ import annotations

import hashlib
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
from cactus_spec.bench.grid import LLAMACPP_METHODS, Config
from cactus_spec.bench.llamacpp import LlamaCppPeers, gguf_of
from cactus_spec.bench.peers import hf_generate
from cactus_spec.bench.plots import write_plots
from cactus_spec.bench.provenance import environment, model_identity
from cactus_spec.bench.report import write_markdown
from cactus_spec.bench.store import RunDirectory
from cactus_spec.bench.summary import summarise
from cactus_spec.bench.tasks import Item, TaskSpec, extract_answer, is_correct
from cactus_spec.divergence import quant_divergence
from cactus_spec.engine import SpeculativeDecoder
from cactus_spec.files import write_json_atomic
from cactus_spec.models import LoadedModel
from cactus_spec.sampling import SamplingConfig

Job = tuple[int, Item, Config]
#: The verifier in each weight format the grid asks for ("none", "int8"), or one model.
Targets = LoadedModel | Mapping[str, LoadedModel]


def as_targets(targets: Targets) -> dict[str, LoadedModel]:
    """``{weight format: verifier}``; a single model stands for its own format."""
    if isinstance(targets, LoadedModel):
        return {targets.quant: targets}
    return dict(targets)


@dataclass(frozen=True)
class BenchSettings:
    """Everything but the models that defines a run."""

    task: TaskSpec
    grid: tuple[Config, ...]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int = 256
    seed: int = 0
    backend: str = "auto"  # the model code of our engine (backends.load)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if not self.grid:
            raise ValueError("the grid holds no configuration")

    @property
    def needs_draft(self) -> bool:
        """Whether some configuration drafts with the draft model."""
        return any(c.drafts and c.drafter == "model" for c in self.grid)

    @property
    def verifiers(self) -> list[str]:
        """The verifier weight formats the grid uses, in grid order."""
        return list(dict.fromkeys(c.verifier for c in self.grid))

    def item_seed(self, index: int) -> int:
        """The sampling seed of item ``index``, the same for every configuration."""
        return self.seed + index

    def identity(self, targets: Targets, draft: LoadedModel | None) -> dict:
        """What results must share to be comparable (see ``store``)."""
        verifiers = as_targets(targets)
        target = next(iter(verifiers.values()))
        model = target.model
        task = {"name": self.task.name, "n": self.task.n, "seed": self.task.seed}
        if self.task.path is not None:
            data = Path(self.task.path).read_bytes()
            task |= {"path": self.task.path, "sha256": hashlib.sha256(data).hexdigest()}
        env = environment(model.device, model.dtype)
        return {
            "task": task,
            "grid": [c.id for c in self.grid],
            "sampling": asdict(self.sampling),
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "models": {
                "target": model_identity(target),
                "draft": model_identity(draft),
                "verifiers": {quant: model_identity(m) for quant, m in verifiers.items()},
            },
            "setup": {
                **{key: env[key] for key in ("device", "dtype", "threads")},
                "backend": self.backend,
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
        targets: Targets,
        draft: LoadedModel | None,
    ) -> None:
        if settings.needs_draft and draft is None:
            raise ValueError("the grid drafts with a draft model, but none was given")
        self.settings = settings
        self.targets = as_targets(targets)
        missing = [quant for quant in settings.verifiers if quant not in self.targets]
        if missing:
            raise ValueError(f"the grid asks for a verifier in {', '.join(missing)} weights")
        self.target = next(iter(self.targets.values()))  # tokenizer, device, the GGUF
        self.draft = draft
        self.encoder = SpeculativeDecoder(self.target, None)
        self.decoders = {c.id: self._decoder(c) for c in settings.grid if c.engine}
        self.llamacpp = self._llamacpp()
        self._prompt_ids: dict[str, list[int]] = {}

    def _decoder(self, config: Config) -> SpeculativeDecoder:
        backend, target = self.settings.backend, self.targets[config.verifier]
        if not config.drafts:
            return SpeculativeDecoder(target, None, backend=backend)
        draft = self.draft if config.drafter == "model" else None
        k, drafter = config.num_draft_tokens, config.drafter
        return SpeculativeDecoder(target, draft, config.rule(), k, drafter, backend=backend)

    def _llamacpp(self) -> LlamaCppPeers | None:
        """llama.cpp contexts over the verifier's GGUF, if the grid has llama.cpp methods."""
        if not any(c.method in LLAMACPP_METHODS for c in self.settings.grid):
            return None
        context = self.encoder.target_backend.context_length
        return LlamaCppPeers(gguf_of(self.target), context, torch.get_num_threads())

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
        jobs = schedule(items, self.settings.grid, store.finished())
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
            task = bar.add_task("bench", total=len(jobs))
            for index, item, config in jobs:
                bar.update(task, description=f"{config.label} | {item.id}")
                store.append(self.run_one(index, item, config))
                bar.advance(task)
        return len(jobs)

    def run_one(self, index: int, item: Item, config: Config) -> dict:
        """Generate for one item with one configuration and score it."""
        ids = self.prompt_ids(item)
        seed = self.settings.item_seed(index)
        device = self.target.model.device
        memory.reset_peak(device)
        measured = self._generate(config, ids, seed)
        row = {
            "config": config.id,
            "item": item.id,
            "index": index,
            "seed": seed,
            "method": config.method,
            "prompt_tokens": len(ids),
            **measured,
            "peak_memory_bytes": memory.peak_bytes(device),
        }
        text = row.get("text")
        if item.answer is not None and text is not None:
            row |= {"prediction": extract_answer(text), "correct": is_correct(text, item.answer)}
        return row

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
            return {**result.stats.as_dict(), "token_ids": result.token_ids, "text": result.text}
        if config.method in LLAMACPP_METHODS:
            peer = self.llamacpp.generate(config, ids, s.max_new_tokens, s.sampling, seed)
        else:
            target = self.targets[config.verifier]
            peer = hf_generate(config, target, self.draft, ids, s.max_new_tokens, s.sampling, seed)
        count = len(peer.token_ids)
        return {
            "new_tokens": count,
            "time_total_s": peer.seconds,
            "tokens_per_s": count / peer.seconds if peer.seconds else 0.0,
            "token_ids": peer.token_ids,
            "text": self._decode(peer.token_ids),
        }

    def _decode(self, token_ids: list[int]) -> str | None:
        tokenizer = self.target.tokenizer
        return None if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=True)


def verifier_divergences(targets: Targets) -> dict[str, dict | None]:
    """The measured KL of each quantised verifier from its bfloat16 original (``divergence``);
    None where it cannot be measured (a model object with no file behind it)."""
    found: dict[str, dict | None] = {}
    for quant, target in as_targets(targets).items():
        if quant == "none":
            continue
        try:
            found[quant] = quant_divergence(target).as_dict()
        except ValueError:
            found[quant] = None
    return found


def run_bench(
    settings: BenchSettings,
    items: Sequence[Item],
    targets: Targets,
    draft: LoadedModel | None,
    out: str | Path,
    progress: bool = True,
) -> dict:
    """Run (or resume) a benchmark into ``out`` and write its summaries and plots.

    ``targets``: the verifier, or one per weight format the grid names (``{"none": bf16,
    "int8": int8}``). Returns the summary (also in summary.json). Refuses an ``out`` holding
    another run. Every prompt is encoded and checked first, so bad input writes nothing.
    """
    identity = settings.identity(targets, draft)
    runner = Runner(settings, targets, draft)
    for item in items:
        runner.prompt_ids(item)
    store = RunDirectory(out, identity)
    divergences = verifier_divergences(targets)
    runner.run(items, store, progress)
    model = runner.target.model
    meta = {
        "run": identity,
        "environment": environment(model.device, model.dtype),
        "verifier_divergence": divergences,
    }
    summary = summarise(store.rows(), settings.grid, items, meta)
    write_json_atomic(store.path / "summary.json", summary)
    write_markdown(store.path / "summary.md", summary)
    write_plots(store.path, summary)
    return summary
