"""What one int8 product costs at the kernel: ``int8_linear`` of R rows against an N x K
weight, over enough copies of the weight (--layers) that they stream from memory as a
model's layers do rather than sit in the L3 cache, median ms a layer and the bytes of
weight read a second.

    python benchmarks/kernel_cost.py --shapes 8960x1536,1536x8960 --rows 1,4,8,11,16

To compare two versions of the kernels, run it from each checkout in turn (the kernels are
built and cached per source); held to a lower level with CACTUS_SPEC_ISA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cactus_spec.backends import native


def layers(n: int, k: int, count: int, g: torch.Generator) -> list[tuple]:
    """`count` random int8 weights [N, K], packed, with their scales and code sums."""
    kernels = native.load()
    out = []
    for _ in range(count):
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / 100
        out.append((kernels.pack_int8(w), scale, w.sum(1, dtype=torch.int32)))
    return out


def cost(x: torch.Tensor, weights: list[tuple], reps: int) -> float:
    """Median seconds a layer for x [R, K] against each weight in turn (first reps dropped)."""
    kernels = native.load()
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        for packed, scale, sums in weights:
            kernels.int8_linear(x, packed, scale, sums, None)
        times.append((time.perf_counter() - start) / len(weights))
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8960x1536,1536x8960", help="N x K of each weight")
    parser.add_argument("--rows", default="1,4,8,11,16", help="input rows per product")
    parser.add_argument("--layers", type=int, default=12, help="weights cycled (past the L3)")
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not native.available():
        parser.error("the native kernels are not available (CACTUS_SPEC_NATIVE=0 or no compiler)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    simd = native.load().int_simd()
    print(f"int8_linear ({simd}), {args.threads} threads, median of {args.reps}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weights = layers(n, k, args.layers, g)
        for rows in (int(r) for r in args.rows.split(",")):
            seconds = cost(torch.randn(rows, k, generator=g), weights, args.reps)
            rate = n * k / seconds / 1e9
            print(f"  {n}x{k}  R={rows:3d}: {seconds * 1e3:7.3f} ms  {rate:5.1f} GB/s")


if __name__ == "__main__":
    main()
