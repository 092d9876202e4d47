"""llama.cpp alone on the verifier's GGUF: prefill and decode speed, outside the bench.

    python benchmarks/llamacpp_speed.py --repeats 3

Needs the ``peers`` extra (``make peers``). Evaluates a fixed code prompt, then samples
128 tokens at the paper's settings (temperature 0.6, top-k 20, top-p 0.95) with 2 threads,
and prints prefill tokens/s, decode tokens/s and tokens/s including the prompt (what
``cactus-spec bench`` reports for its ``llamacpp`` rows).
"""

from __future__ import annotations

import argparse
import itertools
import time

from llama_cpp import Llama

from cactus_spec.loading.fetch import fetch

PROMPT = b'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", help="a catalog name")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = Llama(str(fetch(args.model)), n_ctx=1024, n_threads=2, verbose=False)
    prompt = llm.tokenize(PROMPT)
    for _ in range(args.repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        sampled = llm.generate([], temp=0.6, top_k=20, top_p=0.95, reset=False)
        n = sum(1 for _ in itertools.islice(sampled, args.new_tokens))
        end = time.perf_counter()
        print(
            f"prompt {len(prompt)} tokens: prefill {len(prompt) / (prefilled - start):.1f} "
            f"tok/s | decode {n / (end - prefilled):.1f} tok/s | "
            f"with prompt {n / (end - start):.1f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
