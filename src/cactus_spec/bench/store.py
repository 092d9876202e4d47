"""The run directory: its identity (run.json), the results log (results.jsonl) and atomic
writes of everything derived from them.

A run's identity is what makes its results comparable: the grid, the task, the seeds,
the sampling settings and the models (path and sha256). A rerun into the same directory
with the same identity skips the (configuration, item) pairs already in results.jsonl;
one with a different identity is refused before anything is written. Only the number of
items may change (items come in a fixed order, so a larger N extends the same run), and
the path of the prompt file (its content must not).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from cactus_spec.files import write_json_atomic, write_text_atomic

RUN_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
#: The run's figures (``summary.summarise``), written beside summary.md and the plots.
SUMMARY_FILE = "summary.json"
#: Batched runs: one record per batch of items a configuration decoded together.
BATCHES_FILE = "batches.jsonl"
#: Identity keys that may differ between runs into one directory: the number of items,
#: where the prompt file lies (its sha256 is what must match), and the configurations'
#: descriptions (their ids, under "grid", are compared and say everything they say).
MUTABLE_KEYS = ("task.n", "task.path", "configs")


class RunMismatchError(ValueError):
    """The output directory holds results of a different run."""


def check_writable_dir(path: Path, flag: str = "--out") -> None:
    """ValueError unless ``path`` is (or can be made) a writable directory: its nearest
    existing ancestor must be a directory where a file can be created. Writes nothing."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write in {existing} ({err.strerror})") from None


def flatten(data: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts as dotted keys: {"a": {"b": 1}} -> {"a.b": 1}; lists stay whole."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    flat: dict[str, object] = {}
    for key, value in data.items():
        flat |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return flat


def differing_keys(old: dict, new: dict) -> list[str]:
    """Dotted keys whose values differ (or exist on one side only)."""
    a, b = flatten(old), flatten(new)
    return sorted(key for key in a.keys() | b.keys() if a.get(key, ...) != b.get(key, ...))


class RunDirectory:
    """An output directory bound to one run identity."""

    def __init__(self, path: str | Path, identity: dict) -> None:
        self.path = Path(path)
        self.results = self.path / RESULTS_FILE
        self.batches = self.path / BATCHES_FILE
        self._check(identity)
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / RUN_FILE, identity)
        for log in (self.results, self.batches):
            _drop_partial_last_line(log)

    def _check(self, identity: dict) -> None:
        """Refuse a directory that holds another run's results."""
        if self.path.exists() and not self.path.is_dir():
            raise RunMismatchError(f"output path {self.path} exists and is not a directory")
        run_file = self.path / RUN_FILE
        if not run_file.exists():
            if self.results.exists():
                raise RunMismatchError(
                    f"{self.path} holds {RESULTS_FILE} but no {RUN_FILE}; use a new directory"
                )
            return
        try:
            old = json.loads(run_file.read_text())
        except json.JSONDecodeError:
            raise RunMismatchError(f"{run_file} is not valid JSON; use a new directory") from None
        differ = [key for key in differing_keys(old, identity) if key not in MUTABLE_KEYS]
        if differ:
            raise RunMismatchError(
                f"{self.path} holds results of a different run (differs in: "
                f"{', '.join(differ)}); use a new output directory, nothing was overwritten"
            )

    def rows(self) -> list[dict]:
        """Every complete record in results.jsonl (a line cut short by a crash is skipped)."""
        return read_records(self.results)

    def replace_rows(self, rows: list[dict]) -> None:
        """Rewrite results.jsonl with ``rows``, atomically (a crash leaves the old file)."""
        write_text_atomic(self.results, "".join(json.dumps(row) + "\n" for row in rows))

    def batch_rows(self) -> list[dict]:
        """Every complete record in batches.jsonl."""
        return read_records(self.batches)

    def finished(self) -> set[tuple[str, str]]:
        """The (configuration id, item id) pairs already recorded."""
        return {(row["config"], row["item"]) for row in self.rows()}

    def append(self, row: dict) -> None:
        """Add one result and flush it to disk before returning."""
        append_record(self.results, row)

    def append_batch(self, record: dict) -> None:
        """Add one batch record (batched runs) and flush it to disk before returning."""
        append_record(self.batches, record)


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line to ``path`` and flush it to disk before returning."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line cut short by a crash is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _drop_partial_last_line(path: Path) -> None:
    """After an interrupted write, cut the record it left half-written (with a warning), so
    the next record starts a line of its own and the log holds whole records only."""
    if not path.exists() or not path.stat().st_size:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with path.open("rb+") as f:
        f.truncate(keep)
    print(
        f"warning: dropped a partial last line of {path} ({len(data) - keep} bytes; a run "
        "was cut off while writing it)",
        file=sys.stderr,
    )
