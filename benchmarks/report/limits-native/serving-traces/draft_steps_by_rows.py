"""A draft step over B rows: the calibration's estimate, the step the stepper times
(K = 1 and K = 3 iterations) and the draft backend's forward alone at the rows' contexts.

    python benchmarks/report/limits-native/serving-traces/draft_steps_by_rows.py 8
"""

import sys
import time

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request


def ms(seconds: list[float]) -> list[float]:
    return [round(1000 * s, 1) for s in seconds]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    spec = DecodeSpec.of("cactus", delta=1.0).with_num_draft_tokens(None)
    engine = SpeculativeDecoder(
        *DEFAULT_PAIR, spec, max_draft_tokens=10, max_batch=16, verifier_quant="int8"
    )
    policy = engine.calibrated_policy()
    print("draft table", list(zip(policy.draft.sizes, ms(policy.draft.seconds), strict=True)))
    gens = []
    for i, item in enumerate(humaneval_items(rows)):
        ids = engine.encode_chat([{"role": "user", "content": item.prompt}])
        request = Request(prompt_ids=ids, max_new_tokens=400, sampling=SamplingConfig(), spec=spec)
        gens.append(engine.new_generation(request, i))
    engine.prefill(gens)
    for _ in range(3):
        engine.step(gens, [1] * rows)
    backend = engine._stepper.drafter.backend  # white-box: the draft model's rows
    steps: dict[int, list[float]] = {1: [], 3: []}
    verify: dict[int, list[float]] = {0: [], 1: [], 3: []}
    forward = []
    for _ in range(6):
        for k in (1, 3, 0):
            timing = engine.step(gens, [k] * rows)
            verify[k].append(timing.verify_s)
            if k:
                steps[k].append(timing.draft_s / timing.draft_steps)
        lengths = [backend.length_of(g.row) for g in gens]
        start = time.perf_counter()
        backend.append_ragged([[0] for _ in gens], [g.row for g in gens])
        backend.synchronize()
        forward.append(time.perf_counter() - start)
        for g, n in zip(gens, lengths, strict=True):
            backend.rollback(n, g.row)
    for k, seconds in steps.items():
        print(f"K={k}: draft step ms {ms(seconds)}")
    for k, seconds in verify.items():
        print(f"K={k}: verify ms {ms(seconds)}")
    print(f"forward alone ms {ms(forward)}; estimate {1000 * policy.draft.estimate(rows):.1f}")


if __name__ == "__main__":
    main()
