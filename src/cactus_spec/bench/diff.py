"""Bench runs of one grid compared (``cactus-spec bench diff``): for every configuration,
the items whose token ids differ between the first run and any other, each run's median
tokens/s, and each later run's per-item tokens/s over the first's (median [min, max],
``summary.speed_ratio``). In an A/B/A sitting (BEFORE, AFTER, BEFORE again) the third run
against the first is the machine's noise to read the second against.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cactus_spec.bench.finished import FinishedRun
from cactus_spec.bench.report import DASH, format_interval, markdown_table
from cactus_spec.bench.stats import Interval
from cactus_spec.bench.summary import Rows, speed_ratio


@dataclass(frozen=True)
class ConfigDiff:
    """One configuration across the runs: ``differing``, the items whose tokens differ;
    ``rates``, each run's median tokens/s; ``ratios``, each later run over the first."""

    config: str
    differing: tuple[str, ...]
    rates: tuple[float, ...]
    ratios: tuple[Interval | None, ...]


def check_same_rows(runs: Sequence[FinishedRun]) -> None:
    """ValueError naming the first later run that holds other (configuration, item) pairs
    than the first run, and one such pair."""
    first = _pairs(runs[0])
    for run in runs[1:]:
        other = _pairs(run) ^ first
        if other:
            config, item = min(other)
            raise ValueError(
                f"{run.label}: {run.path} and {runs[0].label}: {runs[0].path} hold other "
                f"records ({config} on {item} is in one only); give runs of one grid and items"
            )


def _pairs(run: FinishedRun) -> set[tuple[str, str]]:
    return {(config, item) for config, rows in run.rows.items() for item in rows}


def diff_runs(runs: Sequence[FinishedRun]) -> list[ConfigDiff]:
    """Every configuration the first run recorded, compared across ``runs`` (which hold the
    same records: ``check_same_rows``)."""
    return [_config_diff(config, runs) for config, rows in runs[0].rows.items() if rows]


def _config_diff(config: str, runs: Sequence[FinishedRun]) -> ConfigDiff:
    rows = runs[0].rows[config]
    others = [run.rows[config] for run in runs[1:]]
    differing = [i for i in rows if any(o[i]["token_ids"] != rows[i]["token_ids"] for o in others)]
    rates = [_median_rate(run.rows[config]) for run in runs]
    ratios = [speed_ratio(other, rows) for other in others]
    return ConfigDiff(config, tuple(differing), tuple(rates), tuple(ratios))


def _median_rate(rows: Rows) -> float:
    return statistics.median(row["tokens_per_s"] for row in rows.values())


def diff_table(runs: Sequence[FinishedRun], diffs: Sequence[ConfigDiff]) -> list[str]:
    """The comparison as a markdown table, one row per configuration."""
    first = runs[0].label
    header = ["configuration", "tokens identical"]
    header += [f"tokens/s {run.label}" for run in runs]
    header += [f"{run.label} / {first} (per item)" for run in runs[1:]]
    rows = [
        [
            d.config,
            "NO: " + ", ".join(d.differing) if d.differing else "yes",
            *(f"{rate:.2f}" for rate in d.rates),
            *(DASH if r is None else format_interval(r.as_list(), suffix="x") for r in d.ratios),
        ]
        for d in diffs
    ]
    return markdown_table(header, rows)
