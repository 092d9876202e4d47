"""The int8 and int4 products at each instruction-set level this CPU can run, against torch's
own kernels held to the same level: which to use on each, measured.

    python benchmarks/isa_kernels.py --out bench-out/isa-kernels [--repeats 30]

For each level (``isa.available()``, plus the CPU's own), a child process with
``CACTUS_SPEC_ISA`` set times, on the default pair's layer shapes (the 1.5B verifier's
1536 -> 8960 MLP and 1536 -> 151936 head, the 0.5B draft's 896 -> 4864), one row (a draft
step) and 11 rows (a verification block): the native int8 and int4 products, torch's
float32 ``F.linear`` and, where torch has it, its weight-only int8 product
(``aten._weight_int8pack_mm``), each the median of ``--repeats`` calls after warm-up, with
the weight bytes it streams per call as GB/s. Results go to ``OUT/results.json`` and
``OUT/summary.md``; run on a quiet machine (2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SHAPES = {"verifier mlp": (8960, 1536), "verifier head": (151936, 1536), "draft mlp": (4864, 896)}
ROWS = (1, 11)

CHILD = r"""
import json, statistics, sys, time, torch
from cactus_spec import isa
from cactus_spec.backends import native
torch.set_num_threads(2)
m = native.load()
shapes, rows, repeats = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)

def timed(call):
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); call(); times.append(time.perf_counter() - start)
    return statistics.median(times)

out = {"level": isa.chosen(), "simd": m.int_simd(), "results": []}
for name, (n, k) in shapes.items():
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, sums = torch.rand(n, generator=g) / 100, w.sum(1, dtype=torch.int32)
    packed8 = m.pack_int8(w)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    groups = (k + 63) // 64
    s4 = (torch.rand(n, groups, generator=g) / 100).half()
    low = (-torch.rand(n, groups, generator=g) / 20).half()
    packed4, scales4 = m.pack_int4(codes, s4, low)
    dense = w.float() * scale[:, None]
    for r in rows:
        x = torch.randn(r, k, generator=g)
        calls = {
            "native int8": (lambda: m.int8_linear(x, packed8, scale, sums, None), n * k),
            "native int4": (lambda: m.int4_linear(x, packed4, scales4, torch.zeros(n)), n * k / 2),
            "torch float32": (lambda: torch.nn.functional.linear(x, dense), n * k * 4),
        }
        if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            calls["torch int8 weight-only"] = (
                lambda: torch.ops.aten._weight_int8pack_mm(x, w, scale), n * k)
        for kernel, (call, nbytes) in calls.items():
            try:
                seconds = timed(call)
            except RuntimeError as err:
                error = {"shape": name, "rows": r, "kernel": kernel, "error": str(err)[:200]}
                out["results"].append(error)
                continue
            out["results"].append({"shape": name, "rows": r, "kernel": kernel,
                                   "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9})
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    from cactus_spec import isa
    from cactus_spec.isa import cpu_name

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = ["native", *(level for level in isa.available() if level != "amx")]
    runs = []
    for level in levels:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CACTUS_SPEC_ISA", "ATEN_", "ONEDNN_"))
        }
        env["CACTUS_SPEC_ISA"] = level
        command = [
            sys.executable,
            "-c",
            CHILD,
            json.dumps(SHAPES),
            json.dumps(ROWS),
            str(args.repeats),
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{level}: done", flush=True)
    cpu = cpu_name()
    (out / "results.json").write_text(json.dumps({"cpu": cpu, "runs": runs}, indent=1))
    (out / "summary.md").write_text(_summary(cpu, runs))
    print(_summary(cpu, runs))


def _summary(cpu: str, runs: list[dict]) -> str:
    lines = [
        f"Kernels by instruction-set level on {cpu}, 2 threads: ms per call (GB/s of weight)",
        "",
    ]
    lines += ["| level (int8/int4 path) | shape | rows | " + " | ".join(_kernels(runs)) + " |"]
    lines += ["| --- | --- | ---: |" + " ---: |" * len(_kernels(runs))]
    for run in runs:
        keyed = {(r["shape"], r["rows"], r["kernel"]): r for r in run["results"]}
        for shape in SHAPES:
            for rows in ROWS:
                cells = []
                for kernel in _kernels(runs):
                    r = keyed.get((shape, rows, kernel))
                    cells.append(
                        "-" if r is None or "ms" not in r else f"{r['ms']:.2f} ({r['gb_s']:.1f})"
                    )
                lines.append(
                    f"| {run['level']} ({run['simd']}) | {shape} | {rows} | "
                    + " | ".join(cells)
                    + " |"
                )
    return "\n".join(lines) + "\n"


def _kernels(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["kernel"] for run in runs for r in run["results"]))


if __name__ == "__main__":
    main()
