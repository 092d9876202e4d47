"""``cactus-spec bench --rescore``: grade a run's recorded texts again, decoding nothing.

A grading change (a better completion extractor, a stricter answer form) then costs seconds
for GSM and a few minutes of test runs for HumanEval, not hours of decoding. The run's
identity (run.json) says the task, its items and the grid; every row with a text is graded
by ``grading`` as when it was recorded, results.jsonl is rewritten atomically, and the
summaries and plots are written again (keeping the environment and divergence figures the
last summary recorded). It also writes the summaries of a run stopped before its first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cactus_spec.bench.grading import SCORE_FIELDS, grade
from cactus_spec.bench.grid import Config
from cactus_spec.bench.provenance import environment
from cactus_spec.bench.runner import write_summaries
from cactus_spec.bench.store import RUN_FILE, SUMMARY_FILE, RunDirectory
from cactus_spec.bench.tasks import TaskSpec, load_items


def rescore(out: str | Path) -> dict:
    """Re-grade the run in ``out``; return its new summary."""
    path = Path(out)
    run_file = path / RUN_FILE
    if not run_file.is_file():
        raise ValueError(f"--rescore: {path} holds no {RUN_FILE}; give the --out of a bench run")
    identity = json.loads(run_file.read_text())
    if "configs" not in identity:
        raise ValueError(f"--rescore: {run_file} predates rescoring (it lists no configs)")
    task = identity["task"]
    items = load_items(TaskSpec(task["name"], task["n"], task["seed"], task.get("path")))
    by_id = {item.id: item for item in items}
    store = RunDirectory(path, identity)
    rows = store.rows()
    current = [i for i, row in enumerate(rows) if row["item"] in by_id]
    bare = [{k: v for k, v in rows[i].items() if k not in SCORE_FIELDS} for i in current]
    scores = grade(task["name"], [(by_id[row["item"]], row.get("text")) for row in bare])
    for i, row, score in zip(current, bare, scores, strict=True):
        rows[i] = row | score  # rows of items beyond the current n stay as they were
    store.replace_rows(rows)
    grid = [Config.from_dict(c) for c in identity["configs"]]
    return write_summaries(store, grid, items, _meta(path, identity))


def _meta(path: Path, identity: dict) -> dict:
    """The last summary's environment and divergence figures, with the run's identity; for a
    run stopped before its first summary, this machine's environment with the run's device
    and dtype (and no divergence figures)."""
    summary_file = path / SUMMARY_FILE
    old = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    setup = identity["setup"]
    here = environment(torch.device(setup["device"]), getattr(torch, setup["dtype"]))
    return {
        "run": identity,
        "environment": old.get("environment", here | {"threads": setup["threads"]}),
        "verifier_divergence": old.get("verifier_divergence", {}),
    }
