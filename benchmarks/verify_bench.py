"""Throughput of `verify` at decoding scale: B = 64 chains, K = 8 drafts, V = 151,936.

Prints rows/s (one row = one chain of K drafts) for every rule, with and without
draft probabilities, with input validation on and off, on CPU and on CUDA when
available, and compares the cost of one row with one forward pass of a 0.5B
model (measured here when the default draft model has been fetched, otherwise
the figure given with --forward-s).

    python benchmarks/verify_bench.py [--reps 5] [--forward-s 0.055]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from cactus_spec.core.rules import TAS, Cactus, Interp, SpS, TopK
from cactus_spec.core.verification import verify

RULES = {
    "sps": SpS(),
    "cactus(1.0)": Cactus(1.0),
    "cactus(1.0, exact)": Cactus(1.0, exact=True),
    "tas": TAS(),
    "interp(0.5)": Interp(0.5),
    "topk(5)": TopK(5),
}


def make_inputs(batch: int, k: int, vocab: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    target = torch.softmax(3 * torch.randn(batch, k + 1, vocab, generator=g, device=device), -1)
    draft = torch.softmax(3 * torch.randn(batch, k, vocab, generator=g, device=device), -1)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    return ids, target, draft


def time_call(fn, reps: int, device: str) -> float:
    """Median wall time of fn() in seconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_seconds(device: str, fallback: float) -> tuple[float, str]:
    """One-token forward of the default 0.5B draft with a KV cache, if it is fetched."""
    try:
        from cactus_spec.backends.hf import TransformersBackend
        from cactus_spec.loading.models import load_model

        loaded = load_model("qwen-coder-0.5b", device=device)
    except Exception as error:  # noqa: BLE001 - any failure means: use the stated figure
        return fallback, f"given ({fallback} s; model not measured: {error})"
    backend = TransformersBackend(loaded.model)
    backend.append(list(range(100, 164)))

    def step() -> None:
        backend.append([42])
        backend.rollback(64)

    return time_call(step, 10, device), "measured (Qwen2.5-Coder-0.5B, bf16, 64-token context)"


def bench_device(device: str, args: argparse.Namespace) -> None:
    fwd, source = forward_seconds(device, args.forward_s)
    threads = torch.get_num_threads()
    print(f"\n## {device}: B={args.batch} K={args.k} V={args.vocab}, threads={threads}")
    print(f"one forward of a 0.5B model: {fwd * 1e3:.1f} ms ({source})\n")
    print("| rule | draft_probs | validate | ms / call | rows/s | ms / row | % of forward |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    ids, target, draft = make_inputs(args.batch, args.k, args.vocab, device)
    for name, rule in RULES.items():
        for probs in (draft, None):
            for validate in (True, False):
                gen = torch.Generator(device=device).manual_seed(1)
                call = partial(verify, ids, target, rule, probs, gen, validate=validate)
                per_row = time_call(call, args.reps, device) / args.batch
                print(
                    f"| {name} | {'yes' if probs is not None else 'no'} | {validate} "
                    f"| {per_row * args.batch * 1e3:.1f} | {1 / per_row:,.0f} "
                    f"| {per_row * 1e3:.2f} | {100 * per_row / fwd:.1f}% |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--forward-s", type=float, default=0.055)
    args = parser.parse_args()
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        bench_device(device, args)


if __name__ == "__main__":
    main()
