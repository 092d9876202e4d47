"""What one int8 or int4 product costs at the kernel: ``int8_linear`` (or ``int4_linear``,
--kind int4) of R rows against an N x K weight, over enough copies of the weight (--layers)
that they stream from memory as a model's layers do rather than sit in the L3 cache, median
ms a layer and the bytes of weight (codes, scales, sums, bias) read a second, beside the rate at
which this machine reads memory at all (torch's sum over 512 MB, same threads): the
kernel's GB/s against the machine's.

    python benchmarks/kernel_cost.py --shapes 8960x1536,1536x8960 --rows 1,4,8,11,16
    python benchmarks/kernel_cost.py --kind int4 --shapes 4864x896,896x4864 --rows 1 --layers 48

To compare two versions of the kernels, run it from each checkout in turn (the kernels are
built and cached per source); held to a lower level with CACTUS_SPEC_ISA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cactus_spec.backends import native


def int8_layers(n: int, k: int, count: int, g: torch.Generator) -> list[tuple]:
    """`count` random int8 weights [N, K], packed, with their scales and code sums."""
    kernels = native.load()
    out = []
    for _ in range(count):
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / 100
        out.append((kernels.pack_int8(w), scale, w.sum(1, dtype=torch.int32), None))
    return out


def int4_layers(n: int, k: int, count: int, g: torch.Generator) -> list[tuple]:
    """`count` random int4 weights [N, K] in groups of 64 inputs, packed, with a zero bias."""
    kernels = native.load()
    groups = (k + 63) // 64
    out = []
    for _ in range(count):
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, groups, generator=g) / 100).half()
        low = (-8 * scale.float()).half()
        out.append((*kernels.pack_int4(codes, scale, low), torch.zeros(n)))
    return out


def weight_bytes(weights: tuple) -> int:
    """The bytes a product reads of one packed weight (every tensor it is given: codes,
    scales, code sums or bias)."""
    return sum(t.numel() * t.element_size() for t in weights if t is not None)


def memory_rate() -> float:
    """GB/s at which torch sums 512 MB of float32 (the median of 7): the machine's read rate
    at torch's threads."""
    x = torch.ones(128 * 1024 * 1024)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def cost(product, x: torch.Tensor, weights: list[tuple], reps: int) -> float:
    """Median seconds a layer of ``product`` (a kernel's linear) for x [R, K] against each
    weight in turn (first reps dropped)."""
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        for weight in weights:
            product(x, *weight)
        times.append((time.perf_counter() - start) / len(weights))
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="int8", choices=["int8", "int4"])
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
    print(f"{args.kind}_linear ({simd}), {args.threads} threads, median of {args.reps}; "
          f"memory read at {memory_rate():.1f} GB/s")  # fmt: skip
    make = int8_layers if args.kind == "int8" else int4_layers
    product = getattr(native.load(), f"{args.kind}_linear")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weights = make(n, k, args.layers, g)
        for rows in (int(r) for r in args.rows.split(",")):
            seconds = cost(product, torch.randn(rows, k, generator=g), weights, args.reps)
            rate = weight_bytes(weights[0]) / seconds / 1e9
            print(f"  {n}x{k}  R={rows:3d}: {seconds * 1e3:7.3f} ms  {rate:5.1f} GB/s")


if __name__ == "__main__":
    main()
