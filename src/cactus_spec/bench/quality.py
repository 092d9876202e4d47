"""The quality tables of scored bench runs of one grid, side by side
(``cactus-spec bench quality-table``), each run's columns named by its task.

Accuracy, per configuration and run: correct / N, the accuracy with its 95% Wilson interval
and the paired Newcombe difference from AR, and where the run read a fallback (gsm's last
number) its accuracy too. Acceptance: mean accepted length per iteration, alpha, the
divergence meter and the batched throughput. Then the paper's claim checked in each run
that holds a lossy method beside SpS (``report.claim_table``). All figures are the runs'
own summary.json.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cactus_spec.bench.finished import FinishedRun
from cactus_spec.bench.report import claim_table, format_interval, format_number, markdown_table


def scored_summaries(runs: Sequence[FinishedRun]) -> list[dict]:
    """Each run's summary; ValueError naming the run that is not scored or whose grid is not
    the first run's."""
    summaries = [run.summary() for run in runs]
    for run, summary in zip(runs, summaries, strict=True):
        if not summary["scored"]:
            raise ValueError(f"{run.label}: {run.path} is not scored (no answers to grade)")
        if run.grid != runs[0].grid:
            raise ValueError(
                f"{run.label}: {run.path} ran another grid than {runs[0].path}; give runs of "
                "one grid"
            )
    return summaries


def _task(summary: dict) -> str:
    return summary["run"]["task"]["name"]


def _fallback(summary: dict) -> bool:
    return any("accuracy_fallback" in c for c in summary["configs"])


def _accuracy_header(summary: dict) -> list[str]:
    task = _task(summary)
    header = [f"{task} correct / N", f"{task} accuracy [95% Wilson]", f"{task} vs AR [Newcombe]"]
    return header + ([f"{task} last number [95% Wilson]"] if _fallback(summary) else [])


def _accuracy_cells(summary: dict, c: dict) -> list[str]:
    cells = [f"{c.get('correct', 0)} / {c['n']}", format_interval(c.get("accuracy"), 3)]
    cells += [format_interval(c.get("difference_vs_ar"), 3)]
    return cells + ([format_interval(c.get("accuracy_fallback"), 3)] if _fallback(summary) else [])


def _acceptance_header(summary: dict) -> list[str]:
    task = _task(summary)
    header = [f"{task} mean accepted", f"{task} alpha", f"{task} KL nats/token"]
    return header + [f"{task} tokens/s (batched)"]


def _acceptance_cells(summary: dict, c: dict) -> list[str]:
    cells = [format_number(c.get("mean_accepted")), format_number(c.get("alpha"), 3)]
    cells += [format_number(c.get("kl_nats_per_token"), 4)]
    return cells + [format_number(c.get("throughput_tokens_per_s"), 1)]


def _table(
    summaries: Sequence[dict],
    header: Callable[[dict], list[str]],
    cells: Callable[[dict, dict], list[str]],
) -> list[str]:
    """One row per configuration: its label, then ``cells`` of it in every run."""
    columns = ["configuration"] + [name for s in summaries for name in header(s)]
    rows = [
        [config["label"]] + [cell for s in summaries for cell in cells(s, s["configs"][i])]
        for i, config in enumerate(summaries[0]["configs"])
    ]
    return markdown_table(columns, rows)


def quality_tables(summaries: Sequence[dict]) -> list[str]:
    """The accuracy table, the acceptance table and the claim table of each run that
    checked one, as markdown lines."""
    lines = _table(summaries, _accuracy_header, _accuracy_cells) + [""]
    lines += _table(summaries, _acceptance_header, _acceptance_cells)
    for summary in (s for s in summaries if s["claim"]):
        lines += ["", f"{_task(summary)}:", "", *claim_table(summary)]
    return lines
