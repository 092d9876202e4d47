"""A bench run read back from its folder, for the commands that read finished runs
(``cactus-spec bench ratio``, ``diff``, ``quality-table``): its configurations in grid
order (run.json), its records by configuration and item (results.jsonl) and its figures
(summary.json).

``label`` is the command-line argument the folder was given as (``RUN``, ``BEFORE``); every
error names it and what it allows, as a ValueError the command line prints as one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cactus_spec.bench.store import RESULTS_FILE, RUN_FILE, SUMMARY_FILE, read_records
from cactus_spec.bench.summary import Rows


@dataclass(frozen=True)
class FinishedRun:
    """A run folder's records: ``rows[config id][item id]``, every configuration of its
    grid present (empty where none was recorded yet)."""

    path: Path
    label: str
    grid: tuple[str, ...]
    rows: dict[str, Rows]

    def config(self, name: str, label: str) -> Rows:
        """The records of configuration ``name`` by item; ValueError naming ``label`` and
        the run's configurations where the grid has no such one."""
        if name not in self.rows:
            raise ValueError(
                f"{label}: {self.path} has no configuration {name!r}; one of {', '.join(self.grid)}"
            )
        return self.rows[name]

    def summary(self) -> dict:
        """The run's summary.json; ValueError naming the label where none was written."""
        path = self.path / SUMMARY_FILE
        if not path.is_file():
            raise ValueError(f"{self.label}: {self.path} holds no {SUMMARY_FILE} yet")
        return json.loads(path.read_text())


def read_run(path: str | Path, label: str) -> FinishedRun:
    """The run in the folder ``path``; ValueError naming ``label`` unless the folder holds a
    bench run (its run.json)."""
    folder = Path(path)
    run_file = folder / RUN_FILE
    if not run_file.is_file():
        what = "no such folder" if not folder.is_dir() else f"it holds no {RUN_FILE}"
        raise ValueError(f"{label}: {folder}: {what}; give the --out folder of a bench run")
    grid = tuple(json.loads(run_file.read_text())["grid"])
    rows: dict[str, Rows] = {config: {} for config in grid}
    for row in read_records(folder / RESULTS_FILE):
        rows.setdefault(row["config"], {})[row["item"]] = row
    return FinishedRun(folder, label, grid, rows)
