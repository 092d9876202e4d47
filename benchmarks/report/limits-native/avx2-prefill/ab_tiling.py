"""The AVX2 int8 product's tiling, A/B (run with CACTUS_SPEC_ISA=avx2): rows per pass R and
groups of 16 outputs at once B, each variant the native sources with int8_linear.cpp's AVX2
constants changed, built under its own name; int8_linear of M rows against 4 copies of each
weight, the variants alternating, outputs checked bit-equal to the committed tiling's
(ab_tiling.txt: its first version, which checked the second repetition's).
Usage: CACTUS_SPEC_ISA=avx2 python ab_tiling.py 158,11,1"""

import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from cactus_spec.backends import native

SOURCES = Path(native.__file__).parent
COMMITTED = (
    "#else\nconstexpr int kRowTile = 4;\ntemplate <int R>\n"
    "constexpr int kGroupsAtOnce = kBlocks;\n#endif"
)
VARIANTS = {"base": (4, "kBlocks"), "r4b2": (4, "2"), "r2b4": (2, "kBlocks"), "r8b1": (8, "1")}


def build(name: str, rows: int, groups: str):
    where = Path(f"/tmp/k/v_{name}")
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    for source in [*SOURCES.glob("*.cpp"), *SOURCES.glob("*.h")]:
        shutil.copy(source, where)
    text = (where / "int8_linear.cpp").read_text()
    assert COMMITTED in text
    tiling = COMMITTED.replace("kRowTile = 4", f"kRowTile = {rows}")
    tiling = tiling.replace("kGroupsAtOnce = kBlocks", f"kGroupsAtOnce = {groups}")
    (where / "int8_linear.cpp").write_text(text.replace(COMMITTED, tiling))
    return cpp_extension.load(
        name=f"cactus_ab_{name}",
        sources=sorted(str(p) for p in where.glob("*.cpp")),
        extra_cflags=list(native.compiler_flags()),
        build_directory=str(where),
    )


torch.set_num_threads(2)
modules = {name: build(name, *v) for name, v in VARIANTS.items()}
print({name: m.int_simd() for name, m in modules.items()}, flush=True)
g = torch.Generator().manual_seed(0)
layers = {}
for n, k in [(8960, 1536), (1536, 8960), (1536, 1536)]:
    copies = []
    for _ in range(4):
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / 100
        copies.append((modules["base"].pack_int8(w), scale, w.sum(1, dtype=torch.int32), None))
    layers[n, k] = copies
row_counts = [int(x) for x in sys.argv[1].split(",")]
times: dict[tuple, list[float]] = {}
for rep in range(7):
    for (n, k), copies in layers.items():
        for m in row_counts:
            x = torch.randn(m, k, generator=g)
            outs = {}
            for name, module in modules.items():
                start = time.perf_counter()
                for weight in copies:
                    outs[name] = module.int8_linear(x, *weight)
                if rep:
                    ms = (time.perf_counter() - start) * 1e3 / len(copies)
                    times.setdefault((n, k, m, name), []).append(ms)
            for name, y in outs.items():
                assert torch.equal(y, outs["base"]), (name, n, k, m)
for key, values in times.items():
    print(key, f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
