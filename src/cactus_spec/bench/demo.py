"""``cactus-spec demo``: AR, SpS and Cactus(delta=1) on one prompt, side by side.

Both models are warmed up first, then the three methods run in turn for a few rounds and
each row shows its fastest round: a machine whose speed changes under it (turbo, thermal
limits, neighbours) then weighs no method's slow state against another's fast one (noise only
ever adds time).
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from cactus_spec import isa
from cactus_spec.backends.ggml import GgufModel
from cactus_spec.backends.packed import bf16_kernel
from cactus_spec.backends.quant import int4_kernel, quant_kernel
from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.models import LoadedModel, as_loaded
from cactus_spec.loading.options import LoadOptions
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import GenerationResult

DEMO_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals, with a docstring and a short example."
)
_SAMPLING = SamplingConfig()

stderr = Console(stderr=True)


def demo_runs(num_draft_tokens: int | str) -> list[tuple[str, DecodeSpec]]:
    """The demo's rows: AR, then SpS and Cactus(delta=1) drafting ``num_draft_tokens``, an
    integer or auto (a policy picks K: None in a spec, but a K not given to the parser)."""
    return [
        ("AR (verifier alone)", DecodeSpec.of("ar")),
        ("SpS", DecodeSpec.of("sps", num_draft_tokens=num_draft_tokens)),
        ("Cactus (delta=1)", DecodeSpec.of("cactus", delta=1.0, num_draft_tokens=num_draft_tokens)),
    ]


def run_demo(
    options: LoadOptions,
    num_draft_tokens: int | str,
    max_new_tokens: int,
    rounds: int,
    started: float | None = None,
) -> None:
    """Load the pair ``options`` name (a draft model included), time ``demo_runs`` for
    ``max_new_tokens`` new tokens each over ``rounds`` rounds, and print the table and
    Cactus's text. Once warmed up it says how long start-up took, from ``started`` (a
    ``time.monotonic`` reading; default: this call)."""
    started = time.monotonic() if started is None else started
    runs = demo_runs(num_draft_tokens)
    pair = "the default pair" if (options.verifier, options.draft) == DEFAULT_PAIR else "the models"
    stderr.print(f"loading {pair}: {options.verifier} (verifier), {options.draft} (draft) …")
    assert options.draft is not None  # the demo drafts with a model
    verifier = as_loaded(
        "verifier", options.verifier, **options.model_kwargs(), quant=options.verifier_quant
    )
    draft = as_loaded(
        "draft",
        options.draft,
        **options.model_kwargs(),
        quant=options.draft_quant,
        head_vocab=options.draft_vocab,
    )
    stderr.print(_kernels_line(verifier, draft))
    if options.backend_why:
        stderr.print(f"backend: {options.backend_why}")
    decoder = SpeculativeDecoder(verifier, draft, runs[2][1], backend=options.backend)
    stderr.print("warming up (pages both models' weights in, so AR is not charged for it) …")
    decoder.generate(DEMO_PROMPT, 2, spec=runs[2][1])  # K auto: the policy times the models
    stderr.print(f"ready {time.monotonic() - started:.1f} s after start (models loaded, warmed up)")
    fastest = _fastest_of_rounds(decoder, runs, max_new_tokens, rounds)
    Console().print(_table(runs, fastest, max_new_tokens))
    print(f"\nCactus (delta=1) wrote:\n{fastest[-1].text}")


def _table(
    runs: list[tuple[str, DecodeSpec]], fastest: list[GenerationResult], max_new_tokens: int
) -> Table:
    """One row per run: its speed, against the first (AR), its drafts and divergence."""
    k = runs[1][1].num_draft_tokens  # None: auto
    shown_k = f"K={k}" if k else f"K auto (up to {DEFAULT_NUM_DRAFT_TOKENS})"
    table = Table(
        title=f"demo: {max_new_tokens} new tokens, {shown_k}, "
        f"temperature {_SAMPLING.temperature}, top-p {_SAMPLING.top_p}, top-k {_SAMPLING.top_k}"
    )
    table.add_column("method", no_wrap=True)
    for column in ("tokens/s", "vs AR", "drafted/it", "kept/it", "KL nats/tok"):
        table.add_column(column, justify="right")
    baseline = fastest[0].stats.tokens_per_s
    for (name, spec), result in zip(runs, fastest, strict=True):
        s = result.stats
        table.add_row(
            name,
            f"{s.tokens_per_s:.2f}",
            f"{s.tokens_per_s / baseline:.2f}x",
            f"{s.drafted / s.iterations:.2f}" if spec.drafts else "-",
            f"{s.mean_accepted:.2f}" if spec.drafts else "-",
            f"{s.kl_nats_per_token:.4f}",
        )
    return table


def _fastest_of_rounds(
    decoder: SpeculativeDecoder,
    runs: list[tuple[str, DecodeSpec]],
    max_new_tokens: int,
    rounds: int,
) -> list[GenerationResult]:
    """Each run's fastest generation over ``rounds`` rounds of the runs in turn."""
    results: list[list[GenerationResult]] = [[] for _ in runs]
    for r in range(rounds):
        for (name, spec), kept in zip(runs, results, strict=True):
            stderr.print(f"running {name} (round {r + 1} of {rounds}) …")
            kept.append(decoder.generate(DEMO_PROMPT, max_new_tokens, seed=0, spec=spec))
    return [max(kept, key=lambda result: result.stats.tokens_per_s) for kept in results]


def _kernels_line(verifier: LoadedModel, draft: LoadedModel) -> str:
    """Which instruction set and kernels the two models run on."""
    kernels = {"int8": quant_kernel(), "int4": int4_kernel(), "bfloat16": bf16_kernel()}
    used = {}
    for role, model in (("verifier", verifier), ("draft", draft)):
        if isinstance(model.model, GgufModel):
            used[role] = "llama.cpp (ggml), the GGUF's own weights"
            continue
        kind = model.quant if model.quant in ("int8", "int4") else "bfloat16"
        dtype = str(next(model.model.parameters()).dtype).removeprefix("torch.")
        used[role] = kernels[kind] if kind != "bfloat16" or dtype == kind else f"{dtype}, torch"
    held = "the CPU's own" if isa.chosen() == "native" else "CACTUS_SPEC_ISA"
    cpu = f"{isa.level()} ({held})"
    return f"instruction set: {cpu}; verifier: {used['verifier']}; draft: {used['draft']}"
