"""The bench in batched mode (``--max-batch``) and ``--rescore``.

Batched: at temperature 0 every (configuration, item) gives the tokens of the one-at-a-time
run, batches.jsonl records each batch, the summary reports throughput, and a larger N
extends the run without redoing anything. Rescore: the real SmolLM2's recorded texts graded
again give back the scores a run recorded, from a results file whose scores were spoiled.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_bench_run import lines, one_thread, run, settings  # noqa: F401 (an autouse fixture)

from cactus_spec.bench.grading import SCORE_FIELDS
from cactus_spec.bench.store import BATCHES_FILE
from cactus_spec.cli import main
from cactus_spec.core.sampling import SamplingConfig

GRID = ["ar", "sps", "cactus", "tas"]


def greedy(prompts: Path, n: int, batch: int):
    base = settings(prompts, n=n, grid=GRID, tokens=12)
    return dataclasses.replace(base, sampling=SamplingConfig(0.0, 0, 1.0), max_batch=batch)


def tokens(out: Path) -> dict[tuple[str, str], list[int]]:
    return {(r["config"], r["item"]): r["token_ids"] for r in lines(out)}


def test_batched_rows_equal_one_at_a_time_at_temperature_0(models, prompts, tmp_path) -> None:
    run(greedy(prompts, 4, 1), models, tmp_path / "single")
    summary = run(greedy(prompts, 4, 3), models, tmp_path / "batched")
    assert tokens(tmp_path / "batched") == tokens(tmp_path / "single")
    assert len(tokens(tmp_path / "single")) == len(GRID) * 4
    batches = (tmp_path / "batched" / BATCHES_FILE).read_text()
    records = [json.loads(line) for line in batches.splitlines()]
    assert {r["config"] for r in records} == {c["id"] for c in summary["configs"]}
    assert all(r["max_batch"] == 3 and r["wall_s"] > 0 for r in records)
    assert all(c["throughput_tokens_per_s"] > 0 for c in summary["configs"])
    assert not (tmp_path / "single" / BATCHES_FILE).exists()


def test_negative_control_sampling_is_not_greedy(models, prompts, tmp_path) -> None:
    sampled = dataclasses.replace(greedy(prompts, 4, 3), sampling=SamplingConfig(1.0, 0, 1.0))
    run(greedy(prompts, 4, 3), models, tmp_path / "greedy")
    run(sampled, models, tmp_path / "sampled")
    assert tokens(tmp_path / "sampled") != tokens(tmp_path / "greedy")


def test_a_larger_n_extends_a_batched_run_without_rework(models, prompts, tmp_path) -> None:
    out = tmp_path / "out"
    run(greedy(prompts, 2, 2), models, out)
    first = lines(out)
    run(greedy(prompts, 4, 2), models, out)
    rows = lines(out)
    assert rows[: len(first)] == first
    assert sorted((r["config"], r["item"]) for r in rows) == sorted(
        {(r["config"], r["item"]) for r in rows}
    )
    assert len(rows) == len(GRID) * 4


@pytest.mark.slow
def test_rescore_restores_the_recorded_scores_of_a_real_run(tmp_path, capsys) -> None:
    from cactus_spec.loading.fetch import fetch

    fetch("smollm2-135m")
    out = tmp_path / "run"
    flags = ["--n", "3", "--max-new-tokens", "32", "--method", "ar", "--method", "sps"]
    assert main(["bench", "--quick", *flags, "--max-batch", "2", "--out", str(out)]) == 0
    recorded = (out / "results.jsonl").read_text()
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in recorded.splitlines()]
    assert all({"correct", "correct_fallback", "text"} <= row.keys() for row in rows)
    spoiled = [
        {k: v for k, v in row.items() if k not in SCORE_FIELDS} | {"correct": not row["correct"]}
        for row in rows
    ]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spoiled))
    assert (out / "results.jsonl").read_text() != recorded  # the control: scores did change
    (out / "summary.json").unlink()  # as in a run stopped before its first summary
    capsys.readouterr()
    assert main(["bench", "--rescore", "--out", str(out)]) == 0
    assert (out / "results.jsonl").read_text() == recorded
    again = json.loads((out / "summary.json").read_text())
    assert again["configs"] == summary["configs"]
    reference, sps = again["configs"]
    assert reference["difference_vs_ar"] is None and sps["difference_vs_ar"] is not None
    assert "## Accuracy" in capsys.readouterr().out


def test_rescore_needs_the_directory_of_a_run(tmp_path, capsys) -> None:
    assert main(["bench", "--rescore"]) == 2
    assert "--rescore needs --out" in capsys.readouterr().err
    assert main(["bench", "--rescore", "--out", str(tmp_path)]) == 2
    assert "holds no run.json" in capsys.readouterr().err
