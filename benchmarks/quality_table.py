"""The quality tables of docs/RESULTS.md from the two runs of benchmarks/quality.sh.

    .venv/bin/python benchmarks/quality_table.py [bench-out]

Per configuration: HumanEval pass@1 and GSM accuracy (stated form; last number beside it),
each with its 95% Wilson interval and the paired Newcombe difference from AR; mean accepted
length per iteration, alpha, the divergence meter and throughput per task. Then the
paper's claim per lossy method and task (``summary.claim_check``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cactus_spec.bench.report import (
    claim_table,
    format_interval,
    format_number,
    markdown_table,
)
from cactus_spec.bench.summary import claim_check

TASKS = {"humaneval": "quality-humaneval", "gsm": "quality-gsm"}


def load(root: Path) -> dict[str, dict]:
    """Each task's summary.json (a task not run yet is left out)."""
    found = {}
    for task, name in TASKS.items():
        path = root / name / "summary.json"
        if path.is_file():
            found[task] = json.loads(path.read_text())
    return found


def rows(summaries: dict[str, dict], cells) -> list[list[str]]:
    """One row per configuration: its label, then ``cells(task, config)`` for each task."""
    first = next(iter(summaries.values()))
    found = []
    for i, config in enumerate(first["configs"]):
        row = [config["label"]]
        for task, summary in summaries.items():
            row += cells(task, summary["configs"][i])
        found.append(row)
    return found


def accuracy_cells(task: str, c: dict) -> list[str]:
    cells = [str(c["n"]), format_interval(c.get("accuracy"), 3)]
    cells += [format_interval(c.get("difference_vs_ar"), 3)]
    return cells + ([format_interval(c.get("accuracy_fallback"), 3)] if task == "gsm" else [])


def acceptance_cells(task: str, c: dict) -> list[str]:
    cells = [format_number(c.get("mean_accepted")), format_number(c.get("alpha"), 3)]
    cells += [format_number(c.get("kl_nats_per_token"), 4)]
    return cells + [format_number(c.get("throughput_tokens_per_s"), 1)]


def main(root: Path) -> None:
    summaries = load(root)
    if not summaries:
        raise SystemExit(f"no quality run under {root}: run benchmarks/quality.sh first")
    header = ["configuration"]
    for task in summaries:
        header += [f"{task} N", f"{task} accuracy [95% Wilson]", f"{task} vs AR [Newcombe]"]
        header += ["gsm last number [95% Wilson]"] if task == "gsm" else []
    print("\n".join(markdown_table(header, rows(summaries, accuracy_cells))), end="\n\n")
    header = ["configuration"]
    for task in summaries:
        header += [f"{task} mean accepted", f"{task} alpha", f"{task} KL nats/token"]
        header += [f"{task} tokens/s (batched)"]
    print("\n".join(markdown_table(header, rows(summaries, acceptance_cells))), end="\n\n")
    for task, summary in summaries.items():
        summary["claim"] = claim_check(summary["configs"], summary["reference"])
        print(f"{task}:\n\n" + "\n".join(claim_table(summary)), end="\n\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out"))
