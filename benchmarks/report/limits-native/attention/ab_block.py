"""The decoder block's attention, the native sources before and after shared-keys.diff, timed
alternating in one process on whole forwards (every NativeBlock's call switched between
the two builds; /tmp/k/v_oldblock held the native sources with the committed block.cpp, the
running build the patched one). Usage: ab_block.py CONTEXT"""

import glob
import statistics
import sys
import time

import torch
from torch.utils import cpp_extension

sys.path.insert(0, "benchmarks")
from forward_cost import load

from cactus_spec.backends import native
from cactus_spec.backends.native_block import NativeBlock


def build(name):
    where = f"/tmp/k/v_{name}"
    return cpp_extension.load(
        name=f"cactus_exp_{name}",
        sources=sorted(glob.glob(where + "/*.cpp")),
        extra_cflags=list(native.compiler_flags()),
        build_directory=where + "/build",
    )


torch.set_num_threads(2)
modules = {"old": build("oldblock"), "new": native.loaded()}
models = {
    "1.5b int8": load("qwen-coder-1.5b", "int8:native"),
    "0.5b int4@32768": load("qwen-coder-0.5b", "int4@32768"),
}
blocks = {
    k: [m for m in lean.modules() if isinstance(m, NativeBlock)] for k, lean in models.items()
}
names = {k: [b._call.__name__ for b in bl] for k, bl in blocks.items()}
CONTEXT = int(sys.argv[1]) if len(sys.argv) > 1 else 300
cases = [("1.5b int8", 1), ("1.5b int8", 11), ("0.5b int4@32768", 1)]
times = {(c, t, v): [] for c, t in cases for v in modules}
outs = {}
for rep in range(16):
    for c, t in cases:
        for v, module in modules.items():
            for b, n in zip(blocks[c], names[c], strict=True):
                b._call = getattr(module, n)
            lean = models[c]
            cache = lean.new_cache(1, CONTEXT + t)
            g = torch.Generator().manual_seed(rep)
            lean(torch.randint(0, 1000, (1, CONTEXT), generator=g), cache, keep=1)
            x = torch.randint(0, 1000, (1, t), generator=g)
            start = time.perf_counter()
            y = lean(x, cache)
            ms = (time.perf_counter() - start) * 1e3
            if rep:
                times[c, t, v].append(ms)
            if rep == 1:
                outs.setdefault((c, t), []).append(y)
for (c, t), ys in outs.items():
    print(
        c,
        t,
        "bit-equal" if torch.equal(ys[0], ys[1]) else f"DIFFER max {(ys[0] - ys[1]).abs().max()}",
    )
for (c, t, v), values in times.items():
    print(
        f"{c:16s} T={t:2d} {v}: {statistics.median(values):7.2f} "
        f"[{min(values):.2f}, {max(values):.2f}] ms"
    )
