"""Two bench runs of the same grid, compared: the same tokens, and tokens/s side by side.

    python benchmarks/run_diff.py BEFORE AFTER [BEFORE_AGAIN]

For every configuration: whether every item's token ids are identical in the runs, and the
median tokens/s of each run with AFTER / BEFORE (per item, median [min, max]). With a third
run (BEFORE repeated after AFTER, an A/B/A sitting), the same ratio between the two BEFORE
runs is the machine's noise to read the first against. Exits 1 when tokens differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def rows(run: Path) -> dict[tuple[str, str], dict]:
    """(config id, item id) -> the recorded row."""
    lines = (run / "results.jsonl").read_text().splitlines()
    return {(r["config"], r["item"]): r for r in map(json.loads, filter(None, lines))}


def ratio(a: dict, b: dict, config: str) -> str:
    """Per-item tokens/s of b over a for ``config``: median [min, max]."""
    items = sorted(item for c, item in a if c == config and (c, item) in b)
    values = [b[config, i]["tokens_per_s"] / a[config, i]["tokens_per_s"] for i in items]
    return f"{statistics.median(values):.2f}x [{min(values):.2f}, {max(values):.2f}]"


def median_rate(run: dict, config: str) -> float:
    return statistics.median(r["tokens_per_s"] for (c, _), r in run.items() if c == config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN")
    args = parser.parse_args()
    if not 2 <= len(args.runs) <= 3:
        parser.error("give BEFORE AFTER, or BEFORE AFTER BEFORE_AGAIN")
    runs = [rows(path) for path in args.runs]
    before, after = runs[0], runs[1]
    if set(before) != set(after):
        print(f"the runs hold different rows: {sorted(set(before) ^ set(after))[:3]}")
        return 1
    configs = list(dict.fromkeys(c for c, _ in before))
    header = "| config | tokens identical | tokens/s before | after | after / before (per item) |"
    header += " before again / before |" if len(runs) == 3 else ""
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    differ = 0
    for config in configs:
        keys = [k for k in before if k[0] == config]
        same = all(before[k]["token_ids"] == after[k]["token_ids"] for k in keys)
        differ += not same
        cells = [
            config,
            "yes" if same else "NO",
            f"{median_rate(before, config):.2f}",
            f"{median_rate(after, config):.2f}",
            ratio(before, after, config),
        ]
        if len(runs) == 3:
            cells.append(ratio(before, runs[2], config))
        print("| " + " | ".join(cells) + " |")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
