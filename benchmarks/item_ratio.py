"""Per-item speed ratio of one bench configuration to another, from a run's results.

    python benchmarks/item_ratio.py bench-out/engine \
        "cactus(delta=1.0,exact=false)/K10/model@int8" llamacpp

For every item both configurations decoded, their tokens/s ratio; prints the median and
[min, max] over items (``summary.speed_ratio``, as summaries quote speedups against AR),
for comparisons the summary does not make, such as our engine against a peer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cactus_spec.bench.store import RESULTS_FILE, read_records
from cactus_spec.bench.summary import speed_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the bench's output directory")
    parser.add_argument("config", help="configuration id (as in results.jsonl)")
    parser.add_argument("reference", help="configuration id it is divided by")
    args = parser.parse_args()
    rows: dict[str, dict[str, dict]] = {args.config: {}, args.reference: {}}
    for row in read_records(args.out / RESULTS_FILE):
        if row["config"] in rows:
            rows[row["config"]][row["item"]] = row
    ratio = speed_ratio(rows[args.config], rows[args.reference])
    if ratio is None:
        raise SystemExit(
            f"{args.out} holds no item with both {args.config!r} and {args.reference!r}"
        )
    median, low, high = ratio.as_list()
    print(f"{args.config} / {args.reference}: {median:.2f}x [{low:.2f}, {high:.2f}]")


if __name__ == "__main__":
    main()
