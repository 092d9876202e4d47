"""``cactus-spec bench ratio``, ``diff`` and ``quality-table``: finished runs read back
(``finished``), compared (``summary.speed_ratio``, ``diff``, ``quality``) and printed as
markdown on stdout. Each positional argument's name (``RUN``, ``CONFIG``, ``BEFORE``) is
the one its errors give.
"""

from __future__ import annotations

import argparse

from cactus_spec.bench.diff import check_same_rows, diff_runs, diff_table
from cactus_spec.bench.finished import FinishedRun, read_run
from cactus_spec.bench.quality import quality_tables, scored_summaries
from cactus_spec.bench.report import format_interval
from cactus_spec.bench.summary import speed_ratio


def ratio_line(run: FinishedRun, config: str, reference: str) -> str:
    """``config``'s per-item tokens/s over ``reference``'s in ``run``: median [min, max] over
    the items both recorded; ValueError naming the argument that is wrong."""
    mine, theirs = run.config(config, "CONFIG"), run.config(reference, "REFERENCE")
    ratio = speed_ratio(mine, theirs)
    if ratio is None:
        raise ValueError(
            f"RUN: {run.path} holds no item that both {config!r} and {reference!r} decoded"
        )
    shared = len(mine.keys() & theirs.keys())
    return f"{config} / {reference}: {format_interval(ratio.as_list(), suffix='x')}, {shared} items"


def main_post(args: argparse.Namespace) -> int:
    """Run the subcommand ``args.bench_command`` names; 1 where ``diff`` found tokens that
    differ, else 0."""
    if args.bench_command == "ratio":
        print(ratio_line(read_run(args.run, "RUN"), args.config, args.reference))
        return 0
    if args.bench_command == "diff":
        return _diff(args)
    runs = [read_run(path, "RUN") for path in args.runs]
    print("\n".join(quality_tables(scored_summaries(runs))))
    return 0


def _diff(args: argparse.Namespace) -> int:
    named = [("BEFORE", args.before), ("AFTER", args.after), ("BEFORE_AGAIN", args.before_again)]
    runs = [read_run(path, label) for label, path in named if path is not None]
    check_same_rows(runs)
    diffs = diff_runs(runs)
    print("\n".join(diff_table(runs, diffs)))
    return 1 if any(d.differing for d in diffs) else 0
