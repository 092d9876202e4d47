"""What the speculation policy expects of each iteration against what the iteration cost.

    CACTUS_SPEC_ISA=avx2 python benchmarks/policy_trace.py --rows 16 --verifier-quant int8
    python benchmarks/policy_trace.py --rows 16 --fixed-k 10      # the same prompts at K = 10

Loads the default pair for ``--rows`` rows, times the serving policy once
(``calibrated_policy``), then decodes the first ``--n`` HumanEval chat prompts one after the
other in one row, as a server with one client would: the policy picks K each iteration
(``--fixed-k``: that K instead, the policy still forecasting), learns each finished
generation's acceptance, and times every iteration. Each iteration prints K and, for that K
and for K = 0 and K_max, the policy's forecast E(K) tokens / T(K) seconds; then the
iteration's measured wall time (draft, verify, the rest) and the tokens it emitted. The
summary compares, by K, the forecast seconds with the measured ones and the forecast tokens
with the emitted ones: which term of the policy's model errs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.policy import CostTable

#: (forecast seconds, measured seconds, forecast tokens, emitted tokens) of an iteration.
Trace = tuple[float, float, float, int]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="the engine's rows (max batch)")
    parser.add_argument("--n", type=int, default=4, help="prompts, one after the other")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--verifier-quant", default="none")
    parser.add_argument("--draft-quant", default="int8")
    parser.add_argument("--draft-vocab", type=int, default=None)
    parser.add_argument("--method", default="cactus", help="sps or cactus (delta 1)")
    parser.add_argument("--fixed-k", type=int, default=None, help="draft this K, not the policy's")
    args = parser.parse_args()
    spec = DecodeSpec.of(args.method).with_num_draft_tokens(None)  # K: the policy's
    engine = SpeculativeDecoder(
        *DEFAULT_PAIR,
        spec,
        max_draft_tokens=10,
        max_batch=args.rows,
        verifier_quant=args.verifier_quant,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
    )
    policy = engine.calibrated_policy()
    assert policy is not None  # the default pair drafts with a model
    print(f"calibrated: verify ms by tokens {_table(policy.verify)}; draft ms by rows "
          f"{_table(policy.draft)}", flush=True)  # fmt: skip
    measured: dict[int, list[Trace]] = defaultdict(list)
    for i, item in enumerate(humaneval_items(args.n)):
        ids = engine.encode_chat([{"role": "user", "content": item.prompt}])
        request = Request(
            prompt_ids=ids, max_new_tokens=args.new_tokens, sampling=SamplingConfig(), spec=spec
        )
        g = engine.new_generation(request, 0)
        engine.prefill([g])
        while not g.done:
            k, trace = _iteration(engine, policy, g, args.fixed_k, f"prompt {i}")
            measured[k].append(trace)
        policy.learn_acceptance(g)
        g.finish()
    _summary(measured)


def _iteration(engine, policy, g, fixed_k: int | None, label: str) -> tuple[int, Trace]:
    """One iteration of ``g`` at the policy's K (or ``fixed_k``), printed beside the
    policy's forecast for it."""
    behind = engine.behind([g])
    forecast = policy.forecast([g], behind)
    (k,) = policy.choose([g], behind) if fixed_k is None else (fixed_k,)
    start = time.perf_counter()
    timing = engine.step([g], [k])
    wall = time.perf_counter() - start
    policy.observe(timing)
    tokens, seconds = forecast[k]
    other = wall - timing.draft_s - timing.verify_s
    print(
        f"{label} K={k:2d} forecast {tokens:5.2f} tok / {1000 * seconds:6.1f} ms "
        f"(K=0 {1000 * forecast[0][1]:5.1f} ms, K={len(forecast) - 1} "
        f"{forecast[-1][0]:5.2f} / {1000 * forecast[-1][1]:6.1f} ms); measured "
        f"{1000 * wall:6.1f} ms (draft {1000 * timing.draft_s:5.1f}, verify "
        f"{1000 * timing.verify_s:5.1f}, other {1000 * other:4.1f}), {timing.emitted} tokens",
        flush=True,
    )
    return k, (seconds, wall, tokens, timing.emitted)


def _summary(measured: dict[int, list[Trace]]) -> None:
    print("\nby K: iterations, forecast / measured ms (median), forecast / emitted tokens (mean)")
    for k in sorted(measured):
        forecast_s, wall, tokens, emitted = zip(*measured[k], strict=True)
        print(
            f"K={k:2d}: {len(wall):4d}, {1000 * statistics.median(forecast_s):6.1f} / "
            f"{1000 * statistics.median(wall):6.1f} ms, "
            f"{statistics.mean(tokens):5.2f} / {statistics.mean(emitted):5.2f}"
        )


def _table(table: CostTable) -> str:
    return ", ".join(f"{n}: {1000 * table.estimate(n):.1f}" for n in table.sizes)


if __name__ == "__main__":
    main()
