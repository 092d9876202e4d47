"""What the speculation policy forecasts of an iteration against what the iteration cost, at
B rows and K drafts.

    python benchmarks/policy_trace.py --verifier-quant int8 --draft-quant int4 \
        --draft-vocab 32768 --batch 1,4,8 --k 0,2,4,10          # every K at every B
    python benchmarks/policy_trace.py --batch 1 --k 6,10,policy # beside the K the policy picks

Loads the default pair for the largest B, times the serving policy once
(``calibrated_policy``), then for each B decodes the first B HumanEval chat prompts together
(one row each, as a server with B clients), first a few iterations to bring every drafter
level, then ``--iterations`` rounds of one iteration at each K in turn (interleaved, so that
the machine's drift falls on every K alike), the policy observing every one as the scheduler
lets it. Each iteration's wall time (drafting, the verifier's forward, and the
rest: sampling, verification, the meter, Python) is set beside the policy's forecast T(K)
made just before it, and its emitted tokens beside E(K). The table gives, by B and K, the
medians and the forecast's error, and what the forecast would choose at each B against what
measures fastest (tokens per second of the measured iterations).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Generation, Request
from cactus_spec.runtime.policy import SpeculationPolicy


@dataclass(frozen=True)
class Trace:
    """One iteration: the policy's forecast, and what it measured."""

    label: str  # the K asked for, or "policy"
    k: int
    forecast_s: float
    forecast_tokens: float
    wall_s: float
    draft_s: float
    verify_s: float
    emitted: int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,4,8", help="rows decoding together")
    parser.add_argument("--k", default="0,2,4,10", help="K values; policy: its choice")
    parser.add_argument("--iterations", type=int, default=12, help="rounds of one iteration a K")
    parser.add_argument("--verifier-quant", default="int8")
    parser.add_argument("--draft-quant", default="int4")
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--method", default="cactus", help="sps or cactus (delta 1)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    ks = [None if k == "policy" else int(k) for k in args.k.split(",")]
    spec = DecodeSpec.of(args.method).with_num_draft_tokens(None)  # K: the policy's
    engine = SpeculativeDecoder(
        *DEFAULT_PAIR,
        spec,
        max_draft_tokens=10,
        max_batch=max(batches),
        verifier_quant=args.verifier_quant,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
    )
    policy = engine.calibrated_policy()
    assert policy is not None  # the default pair drafts with a model
    prompts = [item.prompt for item in humaneval_items(max(batches))]
    print("B, K: iterations; forecast / measured ms (error); draft, verify, rest ms; "
          "forecast / emitted tokens; measured tokens/s", flush=True)  # fmt: skip
    for rows in batches:
        traces = _run(engine, policy, prompts[:rows], spec, ks, args.iterations)
        _summary(rows, traces)


def _run(
    engine: SpeculativeDecoder,
    policy: SpeculationPolicy,
    prompts: list[str],
    spec: DecodeSpec,
    ks: list[int | None],
    iterations: int,
) -> list[Trace]:
    """Decode ``prompts`` together: a warm-up at K_max, then ``iterations`` rounds of one
    iteration at each K."""
    gens = [
        engine.new_generation(
            Request(
                prompt_ids=engine.encode_chat([{"role": "user", "content": p}]),
                max_new_tokens=4096,
                sampling=SamplingConfig(),
                seed=i,
                spec=spec,
                ignore_eos=True,
            ),
            i,
        )
        for i, p in enumerate(prompts)
    ]
    engine.prefill(gens)
    for _ in range(3):  # every drafter reads its prompt; the policy's probe sees drafts
        _iteration(engine, policy, gens, policy.max_draft_tokens)
    traces = []
    for _ in range(iterations):
        traces += [_iteration(engine, policy, gens, k) for k in ks]
    for g in gens:
        policy.learn_acceptance(g)
        g.finish()
    return traces


def _iteration(
    engine: SpeculativeDecoder, policy: SpeculationPolicy, gens: list[Generation], k: int | None
) -> Trace:
    """One iteration of every row at ``k`` (None: the policy's choice), beside the policy's
    forecast for it, observed by the policy as the scheduler would."""
    behind = engine.behind(gens)
    forecast = policy.forecast(gens, behind)
    chosen = policy.choose(gens, behind)[0] if k is None else k
    start = time.perf_counter()
    timing = engine.step(gens, [chosen] * len(gens))
    wall = time.perf_counter() - start
    policy.observe(timing)
    tokens, seconds = forecast[chosen]
    label = "policy" if k is None else f"{k:2d}"
    return Trace(
        label, chosen, seconds, tokens, wall, timing.draft_s, timing.verify_s, timing.emitted
    )


def _summary(rows: int, traces: list[Trace]) -> None:
    rates = {}
    for label in sorted({t.label for t in traces}):
        mine = [t for t in traces if t.label == label]
        forecast = statistics.median(t.forecast_s for t in mine)
        wall = statistics.median(t.wall_s for t in mine)
        draft = statistics.median(t.draft_s for t in mine)
        verify = statistics.median(t.verify_s for t in mine)
        emitted = sum(t.emitted for t in mine)
        rates[label] = emitted / sum(t.wall_s for t in mine)
        print(
            f"B={rows:2d}, K={label} (mean {statistics.mean(t.k for t in mine):4.1f}): "
            f"{len(mine):3d}; {1000 * forecast:6.1f} / {1000 * wall:6.1f}"
            f" ms ({forecast / wall - 1:+.0%}); {1000 * draft:5.1f}, {1000 * verify:6.1f}, "
            f"{1000 * (wall - draft - verify):5.1f} ms; "
            f"{statistics.mean(t.forecast_tokens for t in mine):5.2f} / "
            f"{emitted / len(mine):5.2f}; {rates[label]:6.1f}",
            flush=True,
        )
    if len(rates) > 1:
        best, first = max(rates, key=rates.__getitem__), min(rates)
        print(f"B={rows:2d}: fastest measured K={best} ({rates[best] / rates[first]:.2f}x "
              f"K={first})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
