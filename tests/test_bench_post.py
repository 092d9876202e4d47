"""`cactus-spec bench ratio`, `diff` and `quality-table` on real runs of the bench (tiny
random-weight models): what they print is recomputed here from the records themselves, and
bad input is one line naming the argument."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
from test_bench_run import one_thread, run, settings  # noqa: F401 (an autouse fixture)

from cactus_spec.bench.grid import Config
from cactus_spec.bench.runner import write_summaries
from cactus_spec.bench.store import RESULTS_FILE, RUN_FILE, SUMMARY_FILE, RunDirectory
from cactus_spec.bench.tasks import TaskSpec, load_items
from cactus_spec.cli import main

GRID = ["ar", "sps", "sps:drafter=ngram", "cactus"]
SPS, NGRAM, CACTUS = "sps/K3/model", "sps/K3/ngram", "cactus(delta=1.0,exact=false)/K3/model"
CONFIGS = ("ar", SPS, NGRAM, CACTUS)
ITEMS = ("line1", "line2", "line3")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """Three token-id prompts, each with an answer (so a run of them is scored)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    base = [5, 17, 3, 99, 42, 7]
    lines = [json.dumps({"prompt": base[: 3 + i], "answer": i}) + "\n" for i in range(3)]
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def runs(models, prompt_file, tmp_path_factory) -> tuple[Path, Path]:
    """Two runs of one grid on the same items: BEFORE and AFTER."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("before", "after"):
        run(settings(prompt_file, n=3, grid=GRID), models, root / name)
    return root / "before", root / "after"


def records(out: Path) -> dict[tuple[str, str], dict]:
    """(configuration, item) -> record, read here without the package."""
    lines = (out / RESULTS_FILE).read_text().splitlines()
    return {(r["config"], r["item"]): r for r in map(json.loads, lines)}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}, {max(values):.2f}]"


def rewritten(run_dir: Path, dest: Path, change) -> Path:
    """A copy of ``run_dir`` whose records are ``change(record)``, written by the store's
    own writer."""
    shutil.copytree(run_dir, dest)
    store = RunDirectory(dest, json.loads((dest / RUN_FILE).read_text()))
    store.replace_rows([change(row) for row in store.rows()])
    return dest


def table(text: str) -> dict[str, list[str]]:
    """The first markdown table of ``text``: first cell -> the row's cells."""
    header, _, *lines = text.split("\n\n")[0].splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in [header, *lines]]
    return {row[0]: row for row in cells}


def test_ratio_is_the_median_of_per_item_ratios(runs, capsys) -> None:
    found = records(runs[0])
    ratios = [found[SPS, i]["tokens_per_s"] / found["ar", i]["tokens_per_s"] for i in ITEMS]
    assert main(["bench", "ratio", str(runs[0]), SPS, "ar"]) == 0
    assert capsys.readouterr().out == f"{SPS} / ar: {spread(ratios)}, 3 items\n"
    assert main(["bench", "ratio", str(runs[0]), "ar", SPS]) == 0  # the other way round
    assert capsys.readouterr().out == f"ar / {SPS}: {spread([1 / r for r in ratios])}, 3 items\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{run}", "bogus", "ar"], r"CONFIG: .* has no configuration 'bogus'; one of ar, sps/K3"),
        (["{run}", "ar", "bogus"], r"REFERENCE: .* has no configuration 'bogus'; one of ar,"),
        (["{run}/nothing", "ar", "sps"], r"RUN: .*nothing: no such folder; give the --out"),
        (["{run}/..", "ar", "sps"], r"RUN: .*: it holds no run.json; give the --out folder"),
    ],
)
def test_ratio_bad_input_is_one_line(runs, argv, message, capsys) -> None:
    assert main(["bench", "ratio", *(a.format(run=runs[0]) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err), err


def test_the_flags_of_a_bench_run_are_refused_beside_a_subcommand(runs, capsys) -> None:
    assert main(["bench", "--quick", "ratio", str(runs[0]), SPS, "ar"]) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: --quick is a flag of a bench run; bench ratio reads finished runs "
        "and takes none\n"
    )


def test_diff_of_identical_runs_says_so_with_their_speeds(runs, capsys) -> None:
    before, after = records(runs[0]), records(runs[1])
    assert main(["bench", "diff", str(runs[0]), str(runs[1])]) == 0
    rows = table(capsys.readouterr().out)
    assert set(rows) == {"configuration", *CONFIGS}
    assert rows["configuration"][1:] == [
        "tokens identical",
        "tokens/s BEFORE",
        "tokens/s AFTER",
        "AFTER / BEFORE (per item)",
    ]
    for config in CONFIGS:
        rates = [[run[config, i]["tokens_per_s"] for i in ITEMS] for run in (before, after)]
        ratios = [b / a for a, b in zip(*rates, strict=True)]
        medians = [f"{statistics.median(r):.2f}" for r in rates]
        assert rows[config][1:] == ["yes", *medians, spread(ratios)]


def test_diff_names_the_item_whose_tokens_differ(runs, tmp_path, capsys) -> None:
    def spoil(row: dict) -> dict:
        if (row["config"], row["item"]) != (SPS, "line2"):
            return row
        return row | {"token_ids": [*row["token_ids"][:-1], row["token_ids"][-1] + 1]}

    after = rewritten(runs[1], tmp_path / "after", spoil)
    assert main(["bench", "diff", str(runs[0]), str(after)]) == 1
    rows = table(capsys.readouterr().out)
    assert rows[SPS][1] == "NO: line2"
    assert rows["ar"][1] == rows[NGRAM][1] == rows[CACTUS][1] == "yes"


def test_diff_of_an_a_b_a_sitting_reads_the_repeat_as_noise(runs, capsys) -> None:
    assert main(["bench", "diff", str(runs[0]), str(runs[1]), str(runs[0])]) == 0
    rows = table(capsys.readouterr().out)
    assert rows["configuration"][3:5] == ["tokens/s AFTER", "tokens/s BEFORE_AGAIN"]
    assert rows["configuration"][-1] == "BEFORE_AGAIN / BEFORE (per item)"
    for config in CONFIGS:
        assert rows[config][2] == rows[config][4]  # the same run read twice
        assert rows[config][-1] == "1.00x [1.00, 1.00]"  # against itself: no noise


def test_diff_refuses_runs_of_other_items(runs, tmp_path, capsys) -> None:
    shutil.copytree(runs[1], tmp_path / "after")
    store = RunDirectory(tmp_path / "after", json.loads((runs[1] / RUN_FILE).read_text()))
    store.replace_rows([row for row in store.rows() if row["item"] != "line3"])
    assert main(["bench", "diff", str(runs[0]), str(tmp_path / "after")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^error: AFTER: .* and BEFORE: .* hold other records \(ar on line3", err)
    assert main(["bench", "diff", str(tmp_path / "none"), str(runs[1])]) == 2
    assert "error: BEFORE: " in capsys.readouterr().err


def scored(run_dir: Path, dest: Path, correct: dict[str, set[str]], fallback: bool) -> Path:
    """A copy of ``run_dir`` whose records are graded correct on the items ``correct`` gives
    each configuration (with gsm's last-number reading beside it when ``fallback``), and
    whose summaries are written again from them as the bench writes them."""

    def grade(row: dict) -> dict:
        right = row["item"] in correct[row["config"]]
        return row | {"correct": right} | ({"correct_fallback": not right} if fallback else {})

    rewritten(run_dir, dest, grade)
    identity = json.loads((dest / RUN_FILE).read_text())
    summary = json.loads((dest / SUMMARY_FILE).read_text())
    task = identity["task"]
    items = load_items(TaskSpec(task["name"], task["n"], task["seed"], task["path"]))
    grid = [Config.from_dict(c) for c in identity["configs"]]
    meta = {key: summary[key] for key in ("run", "environment", "verifier_divergence")}
    write_summaries(RunDirectory(dest, identity), grid, items, meta)
    return dest


def test_quality_table_pass_rates_are_the_counts(runs, tmp_path, capsys) -> None:
    first = {"ar": {"line1", "line2"}, SPS: {"line1"}, NGRAM: set(), CACTUS: {"line2"}}
    second = {"ar": set(ITEMS), SPS: {"line3"}, NGRAM: {"line2", "line3"}, CACTUS: set()}
    a = scored(runs[0], tmp_path / "a", first, fallback=False)
    b = scored(runs[1], tmp_path / "b", second, fallback=True)
    assert main(["bench", "quality-table", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    header = rows.pop("configuration")
    assert header[1:4] == ["prompts correct / N", "prompts accuracy [95% Wilson]"] + [
        "prompts vs AR [Newcombe]"
    ]
    assert header[-1] == "prompts last number [95% Wilson]" and len(header) == 8
    labels = {c["id"]: c["label"] for c in json.loads((a / SUMMARY_FILE).read_text())["configs"]}
    for config, label in labels.items():
        for run_dir, cells in ((a, rows[label][1:4]), (b, rows[label][4:7])):
            graded = [r["correct"] for (c, _), r in records(run_dir).items() if c == config]
            assert cells[0] == f"{sum(graded)} / {len(graded)}"
            assert cells[1].startswith(f"{sum(graded) / len(graded):.3f} [")
    assert rows[labels["ar"]][3] == "-" and rows[labels[SPS]][3] != "-"  # AR is the reference
    claims = out.split("\n\nprompts:\n\n")[1:]  # each run's check of the paper's claim
    assert len(claims) == 2 and all(f"| {labels[CACTUS]} |" in claim for claim in claims)


def test_quality_table_needs_scored_runs_of_one_grid(runs, models, prompt_file, tmp_path, capsys):
    assert main(["bench", "quality-table", str(runs[0])]) == 2
    assert re.search(r"^error: RUN: .*before is not scored", capsys.readouterr().err)
    other = tmp_path / "other"
    run(settings(prompt_file, n=1, grid=["ar"]), models, other)
    graded = scored(runs[0], tmp_path / "a", dict.fromkeys(CONFIGS, set()), False)
    scored(other, tmp_path / "b", {"ar": {"line1"}}, fallback=False)
    assert main(["bench", "quality-table", str(graded), str(tmp_path / "b")]) == 2
    assert re.search(r"^error: RUN: .*b ran another grid than", capsys.readouterr().err)
