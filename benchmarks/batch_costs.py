"""What one iteration costs at B rows: AR against SpS with a fixed K, through the stepper.

    python benchmarks/batch_costs.py --rows 16 --k 0,1,2,4

Loads the default pair for B rows, then for AR and each K decodes the first B HumanEval
prompts together through the engine's rows (40 new tokens each, paper sampling) and prints
the prefill time, the
decode tokens/s, and for iterations over the full batch the median step, draft and verify
times and the tokens each step emitted. This is the measurement behind the speculation
policy: where a verifier block of B (K + 1) tokens plus K draft steps costs more than the
extra tokens it brings, speculation cannot pay at that batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request


def run(engine: SpeculativeDecoder, prompts: list[str], k: int, new_tokens: int) -> str:
    spec = DecodeSpec.of("sps", num_draft_tokens=k) if k else DecodeSpec.of("ar")
    gens = [
        engine.new_generation(
            Request(
                prompt_ids=engine.encode(p),
                max_new_tokens=new_tokens,
                sampling=SamplingConfig(),
                seed=i,
                spec=spec,
            ),
            i,
        )
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    engine.prefill(gens)
    prefill = time.perf_counter() - start
    steps = []
    start = time.perf_counter()
    while active := [g for g in gens if not g.done]:
        began = time.perf_counter()
        timing = engine.step(active, [k] * len(active))
        steps.append((time.perf_counter() - began, timing))
    decode = time.perf_counter() - start
    full = [(s, t) for s, t in steps if t.rows == len(prompts)]
    tokens = sum(t.emitted for _, t in steps)

    def median_ms(values) -> float:
        return 1000 * statistics.median(values)

    return (
        f"prefill {prefill:.2f} s, decode {tokens / decode:.1f} tokens/s; full-batch step "
        f"{median_ms(s for s, _ in full):.0f} ms (draft {median_ms(t.draft_s for _, t in full):.0f}"
        f", verify {median_ms(t.verify_s for _, t in full):.0f}), "
        f"{statistics.mean(t.emitted for _, t in full):.1f} tokens per step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--k", default="0,1,2,4", help="K values; 0 is AR")
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args()
    engine = SpeculativeDecoder(*DEFAULT_PAIR, DecodeSpec.of("sps"), max_batch=args.rows)
    prompts = [item.prompt for item in humaneval_items(args.rows)]
    for k in (int(v) for v in args.k.split(",")):
        label = f"SpS K={k}" if k else "AR"
        print(f"{label:>9}, B={args.rows}: {run(engine, prompts, k, args.new_tokens)}", flush=True)


if __name__ == "__main__":
    main()
