"""``cactus-spec bench``: from command-line arguments to a finished run directory.

Everything that can be checked without a model (task, prompt file, grid, sampling) is
checked first, so a typo fails in a second, before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from cactus_spec.bench import llamacpp
from cactus_spec.bench.grid import (
    DEFAULT_ENTRIES,
    QUICK_ENTRIES,
    Config,
    expand,
    load_grid_file,
    parse_entry,
    parse_list,
)
from cactus_spec.bench.rescore import rescore
from cactus_spec.bench.runner import BenchSettings, run_bench
from cactus_spec.bench.store import check_writable_dir
from cactus_spec.bench.tasks import TaskSpec, load_items
from cactus_spec.core.checks import flag
from cactus_spec.core.drafters import DEFAULT_DRAFTER
from cactus_spec.core.sampling import MAX_SEED, SamplingConfig, check_seed
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.models import (
    LoadedModel,
    ModelSource,
    as_loaded,
    resolve_verifier_quant,
)
from cactus_spec.loading.options import LOAD_KEYS, LoadOptions, parse_load

#: What --quick changes, unless given explicitly: SmolLM2-135M drafting with n-gram lookup,
#: 4 gsm problems of 64 new tokens, a small grid.
QUICK_MODEL = "smollm2-135m"
QUICK = {"n": 4, "max_new_tokens": 64, "num_draft_tokens": "4", "drafter": "ngram"}
NORMAL = {"n": None, "max_new_tokens": 256, "num_draft_tokens": None, "drafter": None}

stderr = Console(stderr=True)


def _given(args: argparse.Namespace, name: str):
    """The value given on the command line, else the --quick or the normal default."""
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else NORMAL)[name]


def _task(args: argparse.Namespace) -> TaskSpec:
    name = args.task or ("prompts" if args.prompts else "gsm")
    return TaskSpec(name, _given(args, "n"), args.task_seed, args.prompts)


def _grid(args: argparse.Namespace) -> tuple[Config, ...]:
    if args.grid:
        if args.method or args.num_draft_tokens or args.drafter:
            raise ValueError("--grid takes methods, num_draft_tokens and drafter from the file")
        return load_grid_file(args.grid, resolve_verifier_quant(args.verifier_quant))
    ks, drafters = _given(args, "num_draft_tokens"), _given(args, "drafter")
    if args.method:
        entries = [parse_entry(spec) for spec in args.method]
    else:
        entries = QUICK_ENTRIES if args.quick else DEFAULT_ENTRIES
    return expand(
        entries,
        parse_list(ks) if ks else None,
        parse_list(drafters) if drafters else (DEFAULT_DRAFTER,),
        (resolve_verifier_quant(args.verifier_quant),),
    )


def _without_missing_peers(grid: tuple[Config, ...]) -> tuple[Config, ...]:
    """The grid less llama.cpp's methods when llama-cpp-python is absent (said on stderr)."""
    reason = llamacpp.missing_reason()
    skipped = [c for c in grid if c.method in llamacpp.METHODS]
    if reason is None or not skipped:
        return grid
    names = ", ".join(dict.fromkeys(c.method for c in skipped))
    stderr.print(f"skipping {names}: {reason}", soft_wrap=True, highlight=False, markup=False)
    kept = tuple(c for c in grid if c.method not in llamacpp.METHODS)
    if not kept:
        raise ValueError(f"nothing to run: {reason}")
    return kept


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validated settings; raises ValueError on any bad input, before models load.

    Missing peers are dropped (and said) only once every argument has been checked, so a
    bad argument is the one line on stderr."""
    if args.backend == "ggml":
        raise ValueError("--backend ggml is not in the bench yet; use auto, lean or hf")
    settings = BenchSettings(
        task=_task(args),
        grid=_grid(args),
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
        max_new_tokens=_given(args, "max_new_tokens"),
        seed=args.seed,
        backend=args.backend,
        max_batch=args.max_batch,
    )
    return dataclasses.replace(settings, grid=_without_missing_peers(settings.grid))


def _load_options(args: argparse.Namespace, needs_draft: bool) -> LoadOptions:
    """The model flags, read by the one loading parser: --verifier and --draft default to
    the default pair, or with --quick to SmolLM2 (its own assistant). Backend auto stays on
    our kernels: the bench has no ggml rows yet."""
    pair = (QUICK_MODEL, args.verifier or QUICK_MODEL) if args.quick else DEFAULT_PAIR
    given = {key: getattr(args, key) for key in LOAD_KEYS}
    return parse_load(
        given,
        needs_draft=needs_draft,
        auto_ggml=False,
        rows=args.max_batch,
        default_pair=pair,
        label=flag,
    )


def _check_seeds(seed: int, items: int) -> None:
    """The seeds seed .. seed + items - 1 must all be valid generator seeds."""
    check_seed(seed, "--seed")
    if seed + items - 1 > MAX_SEED:
        raise ValueError(
            f"--seed {seed} + {items} items exceeds the largest seed 2**64 - 1 "
            "(item i samples with seed + i)"
        )


def _loader(options: LoadOptions) -> Callable[[ModelSource, str, int | None], LoadedModel]:
    """``load_model`` with ``options``, each (source, quant, head) loaded once: a draft that
    is the verifier, or a grid's head equal to ``--draft-vocab``, shares the loaded
    weights."""
    loaded: dict[tuple[ModelSource, str, int | None], LoadedModel] = {}

    def load(source: ModelSource, quant: str, head_vocab: int | None) -> LoadedModel:
        key = (source, quant, head_vocab)
        if key not in loaded:
            weights = "dense" if quant == "none" else quant
            head = "" if head_vocab is None else f", a head of the {head_vocab} most frequent"
            stderr.print(f"loading {source} ({weights} weights{head}) ...")
            loaded[key] = as_loaded(
                "model", source, **options.model_kwargs(), quant=quant, head_vocab=head_vocab
            )
        return loaded[key]

    return load


def default_out(args: argparse.Namespace, settings: BenchSettings) -> Path:
    """--out, else bench-out/quick or bench-out/TASK."""
    name = "quick" if args.quick else settings.task.name
    return Path(args.out or f"bench-out/{name}")


def main_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the arguments describe (or re-grade one: --rescore); print
    summary.md at the end."""
    if args.rescore:
        return _main_rescore(args)
    settings = settings_from_args(args)
    items = load_items(settings.task)
    _check_seeds(settings.seed, len(items))
    others = settings.other_drafts
    cut = any(name is None for name, _, _ in others.values())  # the run's draft, recast
    options = _load_options(args, settings.needs_draft or cut)
    out = default_out(args, settings)
    check_writable_dir(out)
    load = _loader(options)
    verifiers = {quant: load(options.verifier, quant, None) for quant in settings.verifiers}
    drafts: dict[str | None, LoadedModel] = {}
    if options.draft is not None and settings.needs_draft:
        drafts[None] = load(options.draft, options.draft_quant, options.draft_vocab)
    for key, (name, head, quant) in others.items():
        head = options.draft_vocab if head is None else head
        source = name or options.draft
        assert source is not None  # cut: the run's draft is named
        drafts[key] = load(source, quant or options.draft_quant, head)
    run_bench(settings, items, verifiers, drafts, out, progress=not args.no_progress)
    sys.stdout.write((out / "summary.md").read_text())
    stderr.print(f"wrote results.jsonl, summary.json, summary.md and plots to {out}")
    return 0


def _main_rescore(args: argparse.Namespace) -> int:
    """--rescore takes --out (and --no-progress) only: the run directory says the rest."""
    if not args.out:
        raise ValueError("--rescore needs --out, the directory of the run to grade again")
    out = Path(args.out)
    stderr.print(f"grading the recorded texts in {out} again ...")
    rescore(out)
    sys.stdout.write((out / "summary.md").read_text())
    stderr.print(f"rewrote results.jsonl, summary.json, summary.md and plots in {out}")
    return 0
