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
from cactus_spec.core.checks import check_int
from cactus_spec.core.sampling import MAX_SEED, SamplingConfig, check_seed
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.models import LoadedModel, check_load_options, load_model

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
        return load_grid_file(args.grid, args.verifier_quant)
    ks, drafters = _given(args, "num_draft_tokens"), _given(args, "drafter")
    if args.method:
        entries = [parse_entry(spec) for spec in args.method]
    else:
        entries = QUICK_ENTRIES if args.quick else DEFAULT_ENTRIES
    return expand(
        entries,
        parse_list(ks) if ks else None,
        parse_list(drafters) if drafters else ("model",),
        (args.verifier_quant,),
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


def _sources(args: argparse.Namespace, needs_draft: bool) -> tuple[str, str | None]:
    """Target and draft sources: the flags, else --quick's SmolLM2 (its own assistant),
    else the default pair (known names load only once fetched and verified)."""
    if args.quick:
        verifier = args.verifier or QUICK_MODEL
        return verifier, (args.draft or verifier) if needs_draft else None
    verifier = args.verifier or DEFAULT_PAIR[0]
    return verifier, (args.draft or DEFAULT_PAIR[1]) if needs_draft else None


def _check_seeds(seed: int, items: int) -> None:
    """The seeds seed .. seed + items - 1 must all be valid generator seeds."""
    check_seed(seed, "--seed")
    if seed + items - 1 > MAX_SEED:
        raise ValueError(
            f"--seed {seed} + {items} items exceeds the largest seed 2**64 - 1 "
            "(item i samples with seed + i)"
        )


def _load(
    source: str, args: argparse.Namespace, quant: str, head_vocab: int | None = None
) -> LoadedModel:
    weights = "dense" if quant == "none" else quant
    head = "" if head_vocab is None else f", a head of the {head_vocab} most frequent tokens"
    stderr.print(f"loading {source} ({weights} weights{head}) ...")
    options = {"dtype": args.dtype, "device": args.device, "threads": args.threads}
    return load_model(source, **options, quant=quant, head_vocab=head_vocab)


def _loader(args: argparse.Namespace) -> Callable[[str, str, int | None], LoadedModel]:
    """``_load`` that loads each (source, quant, head) once: a draft that is the verifier,
    or a grid's head equal to ``--draft-vocab``, shares the loaded weights."""
    loaded: dict[tuple[str, str, int | None], LoadedModel] = {}

    def load(source: str, quant: str, head_vocab: int | None) -> LoadedModel:
        key = (source, quant, head_vocab)
        if key not in loaded:
            loaded[key] = _load(source, args, quant, head_vocab)
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
    check_load_options(args.dtype, args.device, args.threads)
    if args.draft_vocab is not None:
        check_int("--draft-vocab", args.draft_vocab)
    out = default_out(args, settings)
    check_writable_dir(out)
    others = settings.other_drafts
    cut = any(name is None for name, _ in others.values())  # the run's draft, its head cut
    verifier_source, draft_source = _sources(args, settings.needs_draft or cut)
    load = _loader(args)
    verifiers = {quant: load(verifier_source, quant, None) for quant in settings.verifiers}
    drafts: dict[str | None, LoadedModel] = {}
    if draft_source is not None and settings.needs_draft:
        drafts[None] = load(draft_source, args.draft_quant, args.draft_vocab)
    for key, (name, head) in others.items():
        head = args.draft_vocab if head is None else head
        source = name or draft_source
        assert source is not None  # cut: the run's draft is named
        drafts[key] = load(source, args.draft_quant, head)
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
