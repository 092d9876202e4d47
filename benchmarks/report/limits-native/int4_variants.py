"""int4_linear of one row against weights streamed from memory, for variants of the native
sources built side by side and timed alternating in one process (REPORT: "What limits the
AVX512-BF16 duel"): each /tmp/k/v_<name> held the native sources with int4_linear.cpp
patched as int4_variants.txt describes. Usage: int4_variants.py base pair st256 ..."""

import glob
import os
import statistics
import sys
import time

import torch
from torch.utils import cpp_extension

from cactus_spec.backends import native

SHAPES = [(4864, 896), (896, 4864), (896, 896)]
COPIES = 48


def build(name: str):
    where = f"/tmp/k/v_{name}"
    os.makedirs(where + "/build", exist_ok=True)
    return cpp_extension.load(
        name=f"cactus_exp_{name}", sources=sorted(glob.glob(where + "/*.cpp")),
        extra_cflags=list(native.compiler_flags()), build_directory=where + "/build",
    )  # fmt: skip


def main() -> None:
    torch.set_num_threads(2)
    modules = {name: build(name) for name in sys.argv[1:]}
    g = torch.Generator().manual_seed(0)
    weights = {}
    for n, k in SHAPES:
        groups = (k + 63) // 64
        codes = [
            torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8) for _ in range(COPIES)
        ]
        scales = [(torch.rand(n, groups, generator=g) / 100).half() for _ in range(COPIES)]
        for name, module in modules.items():
            weights[name, n, k] = [
                (*module.pack_int4(c, s, (-8 * s.float()).half()), torch.zeros(n))
                for c, s in zip(codes, scales, strict=True)
            ]
    x = {k: torch.randn(1, k) for _, k in SHAPES}
    times = {key: [] for key in weights}
    for _ in range(30):
        for key, layer_weights in weights.items():
            product = modules[key[0]].int4_linear
            begin = time.perf_counter()
            for w in layer_weights:
                product(x[key[2]], *w)
            times[key].append((time.perf_counter() - begin) / COPIES)
    first = {}
    for key, layer_weights in weights.items():
        name, n, k = key
        y = modules[name].int4_linear(x[k], *layer_weights[0])
        assert torch.equal(first.setdefault((n, k), y), y), key  # every variant, the same bits
        seconds = statistics.median(times[key][3:])
        size = sum(t.numel() * t.element_size() for t in layer_weights[0])
        print(f"{name:8s} {n}x{k}: {1e3 * seconds:.4f} ms  {size / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
