"""A one-token forward of the 1.5B int8 verifier timed every ~4 s in one process, with the
process's transparent huge pages (REPORT: "What limits the AVX512-BF16 duel")."""

import re
import statistics
import time
from pathlib import Path

import torch

from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.loading.models import load_model


def huge_and_resident_mb() -> tuple[int, int]:
    text = Path("/proc/self/smaps_rollup").read_text()
    huge = int(re.search(r"AnonHugePages:\s+(\d+)", text).group(1)) // 1024
    return huge, int(re.search(r"Rss:\s+(\d+)", text).group(1)) // 1024


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    start = time.time()
    backend = LeanBackend(LeanModel(load_model("qwen-coder-1.5b", quant="int8").model), 1, 2048)
    backend.append(torch.randint(0, 1000, (300,)).tolist(), keep=1)
    for _ in range(14):
        times = []
        for _ in range(10):
            begin = time.perf_counter()
            backend.append([5], keep=1)
            backend.rollback(300)
            times.append(time.perf_counter() - begin)
        step = 1e3 * statistics.median(times)
        print(f"t={time.time() - start:5.0f}s step {step:.1f} ms, "
              f"AnonHuge/Rss MB {huge_and_resident_mb()}", flush=True)  # fmt: skip
        time.sleep(4)


if __name__ == "__main__":
    main()
