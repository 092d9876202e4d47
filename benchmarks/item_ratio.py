"""Per-item speed ratio of one bench configuration to another, from a run's results.

    python benchmarks/item_ratio.py bench-out/engine \
        "cactus(delta=1.0,exact=false)/K10/model@int8" llamacpp

For every item both configurations decoded, their tokens/s ratio; prints the median and
[min, max] over items (the way summaries quote speedups against AR), for comparisons the
summary does not make, such as our engine against a peer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cactus_spec.bench.stats import median_spread
from cactus_spec.bench.store import RESULTS_FILE, read_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the bench's output directory")
    parser.add_argument("config", help="configuration id (as in results.jsonl)")
    parser.add_argument("reference", help="configuration id it is divided by")
    args = parser.parse_args()
    speed: dict[str, dict[str, float]] = {args.config: {}, args.reference: {}}
    for row in read_records(args.out / RESULTS_FILE):
        if row["config"] in speed:
            speed[row["config"]][row["item"]] = row["tokens_per_s"]
    for config, items in speed.items():
        if not items:
            raise SystemExit(f"no results for configuration {config!r} in {args.out}")
    items = sorted(speed[args.config].keys() & speed[args.reference].keys())
    ratios = [speed[args.config][i] / speed[args.reference][i] for i in items]
    median, low, high = median_spread(ratios).as_list()
    spread = f"{median:.2f}x [{low:.2f}, {high:.2f}]"
    print(f"{args.config} / {args.reference}: {spread} over {len(items)} items")


if __name__ == "__main__":
    main()
