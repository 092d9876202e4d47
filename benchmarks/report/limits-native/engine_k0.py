"""The engine's step at K = 0, AR and Cactus, two prompts each, twice in one process (REPORT:
"What limits the AVX512-BF16 duel"): the machine's two speeds within a minute."""

import statistics
import time

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request


def main() -> None:
    spec = DecodeSpec.of("cactus").with_num_draft_tokens(None)
    engine = SpeculativeDecoder(
        *DEFAULT_PAIR, spec, max_draft_tokens=10, max_batch=16, verifier_quant="int8"
    )
    items = humaneval_items(2)
    for _ in range(2):
        for method in ("ar", "cactus"):
            spec = DecodeSpec.of(method)
            for item in items:
                ids = engine.encode_chat([{"role": "user", "content": item.prompt}])
                request = Request(
                    prompt_ids=ids, max_new_tokens=64, sampling=SamplingConfig(), spec=spec
                )
                g = engine.new_generation(request, 0)
                engine.prefill([g])
                times = []
                while not g.done:
                    start = time.perf_counter()
                    engine.step([g], [0])
                    times.append(time.perf_counter() - start)
                g.finish()
                print(method, f"K=0 step ms median {1e3 * statistics.median(times):.1f}")


if __name__ == "__main__":
    main()
