"""The harness end to end on tiny random-weight models: every output file, one row per
(configuration, item), resume without rework, and refusal of a directory of another run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_lm

from cactus_spec.bench import llamacpp
from cactus_spec.bench.grid import expand, parse_entry
from cactus_spec.bench.plots import write_plots
from cactus_spec.bench.runner import BenchSettings, run_bench, schedule
from cactus_spec.bench.store import RESULTS_FILE, RUN_FILE, RunMismatchError
from cactus_spec.bench.tasks import Item, TaskSpec, load_items
from cactus_spec.cli import main
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.loading.models import load_model
from cactus_spec.loading.options import LoadOptions

GRID = [
    "ar",
    "hf",
    "hf_assisted",
    "hf_assisted:drafter=ngram",
    "sps",
    "tas",
    "cactus:exact=false,true",
    "sps:drafter=ngram",
]
OUTPUTS = [
    RESULTS_FILE,
    RUN_FILE,
    "summary.json",
    "summary.md",
    "accuracy_vs_acceptance.png",
    "cactus_delta.png",
    "acceptance_by_position.png",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def settings(prompts: Path, n: int | None = 2, grid=GRID, tokens: int = 8) -> BenchSettings:
    entries = [parse_entry(spec) for spec in grid]
    return BenchSettings(
        TaskSpec("prompts", n, path=str(prompts)), expand(entries, [3]), max_new_tokens=tokens
    )


def run(config: BenchSettings, models, out: Path) -> dict:
    return run_bench(config, load_items(config.task), *models, out, progress=False)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_run_writes_every_file_and_one_row_per_pair(models, prompts, tmp_path) -> None:
    config = settings(prompts)
    assistant = models[1].model.generation_config
    before = (assistant.num_assistant_tokens, assistant.num_assistant_tokens_schedule)
    summary = run(config, models, tmp_path / "out")
    assert (assistant.num_assistant_tokens, assistant.num_assistant_tokens_schedule) == before
    for name in OUTPUTS:
        assert (tmp_path / "out" / name).is_file(), name
    for name in OUTPUTS[-3:]:
        assert (tmp_path / "out" / name).read_bytes().startswith(PNG_MAGIC)
    rows = lines(tmp_path / "out")
    assert sorted((r["config"], r["item"]) for r in rows) == sorted(
        (c.id, item) for c in config.grid for item in ("line1", "line2")
    )
    by_id = {c["id"]: c for c in summary["configs"]}
    assert by_id["ar"]["speedup"] == [1.0, 1.0, 1.0]
    assert by_id["sps/K3/model"]["kl_nats_per_token"] == 0.0
    assert by_id["sps/K3/model"]["bound"] > 0
    assert by_id["cactus(delta=1.0,exact=true)/K3/model"]["kl_nats_per_token"] >= 0
    assert by_id["hf"]["tokens_per_s"] > 0 and "mean_accepted" not in by_id["hf"]
    env = json.loads((tmp_path / "out" / "summary.json").read_text())["environment"]
    assert {"torch", "transformers", "cactus_spec", "device", "dtype", "threads"} <= set(env)
    assert "| sps | - | 3 (model) | dense | 2 |" in (tmp_path / "out" / "summary.md").read_text()


def test_rerun_skips_finished_items_and_larger_n_extends(models, prompts, tmp_path) -> None:
    out = tmp_path / "out"
    run(settings(prompts), models, out)
    before = (out / RESULTS_FILE).read_bytes()
    run(settings(prompts), models, out)
    assert (out / RESULTS_FILE).read_bytes() == before  # nothing ran again
    summary = run(settings(prompts, n=3), models, out)
    new = lines(out)[before.count(b"\n") :]
    assert {r["item"] for r in new} == {"line3"} and len(new) == len(settings(prompts).grid)
    assert summary["n_items"] == 3


def test_interrupted_run_resumes_where_it_stopped(models, prompts, tmp_path) -> None:
    out = tmp_path / "out"
    run(settings(prompts), models, out)
    full = (out / RESULTS_FILE).read_text().splitlines()
    # Keep three records and half of the fourth, as a crash mid-write would.
    (out / RESULTS_FILE).write_text("\n".join(full[:3]) + "\n" + full[3][: len(full[3]) // 2])
    run(settings(prompts), models, out)
    raw = (out / RESULTS_FILE).read_text().splitlines()
    assert raw[:3] == full[:3]  # the whole records are untouched
    rows = [json.loads(line) for line in raw]  # the half-written one is gone
    pairs = [(r["config"], r["item"]) for r in rows]
    assert len(pairs) == len(set(pairs)) == len(full)  # each pair once, none lost


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ({"grid": ["ar", "sps"]}, "grid"),
        ({"tokens": 9}, "max_new_tokens"),
    ],
)
def test_directory_of_another_run_is_refused(models, prompts, tmp_path, change, differs) -> None:
    out = tmp_path / "out"
    run(settings(prompts), models, out)
    before = snapshot(out)
    with pytest.raises(RunMismatchError, match=f"differs in: {differs}"):
        run(settings(prompts, **change), models, out)
    assert snapshot(out) == before


def test_other_models_are_refused(models, prompts, tmp_path) -> None:
    out = tmp_path / "out"
    config = settings(prompts, grid=["ar"])
    run(config, models, out)
    other = load_model(make_tiny_lm(seed=2))
    other.identity, other.sha256 = "elsewhere", "f" * 64
    with pytest.raises(RunMismatchError, match="models.target.path, models.target.sha256"):
        run(config, (other, None), out)


def test_results_without_run_file_are_refused(models, prompts, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / RESULTS_FILE).write_text('{"config": "ar", "item": "x"}\n')
    with pytest.raises(RunMismatchError, match="no run.json"):
        run(settings(prompts), models, out)
    assert not (out / RUN_FILE).exists()


def test_schedule_alternates_and_skips_done() -> None:
    items = [Item(f"i{n}", "x") for n in range(3)]
    grid = expand([parse_entry("ar"), parse_entry("sps"), parse_entry("tas")])
    order = [(i.id, c.method) for _, i, c in schedule(items, grid, {("ar", "i2")})]
    assert order == [
        ("i0", "ar"), ("i0", "sps"), ("i0", "tas"),
        ("i1", "tas"), ("i1", "sps"), ("i1", "ar"),
        ("i2", "sps"), ("i2", "tas"),
    ]  # fmt: skip


def scored_summary() -> dict:
    config = {"params": {}, "num_draft_tokens": 0, "drafter": None, "n": 20}
    cactus = {
        **config,
        "id": "c", "label": "cactus d=1.0 K6", "method": "cactus", "num_draft_tokens": 6,
        "drafter": "model", "params": {"delta": 1.0, "exact": False}, "mean_accepted": 2.5,
        "accuracy": [0.55, 0.34, 0.74], "speedup": [1.4, 1.2, 1.6], "kl_nats_per_token": 0.01,
        "acceptance_by_position": [0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
    }  # fmt: skip
    ar = {**config, "id": "ar", "label": "ar", "method": "ar", "accuracy": [0.6, 0.39, 0.78]}
    return {"scored": True, "reference": "ar", "n_items": 20, "configs": [ar, cactus]}


def test_plots_are_png_files(tmp_path) -> None:
    paths = write_plots(tmp_path, scored_summary())
    assert [p.name for p in paths] == OUTPUTS[-3:]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUTS[-3:])  # no temp files


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "mmlu"], "task must be one of gsm, humaneval, prompts"),
        (["--method", "bogus"], "method must be one of"),
        (["--method", "cactus:gamma=1"], "cactus does not take gamma"),
        (["--method", "cactus:delta=-1"], "delta must be a finite number >= 0"),
        (["--num-draft-tokens", "0"], "num_draft_tokens must be an integer >= 1"),
        (["--grid", "g.toml", "--method", "ar"], "--grid takes methods"),
        (["--top-p", "2"], r"top_p must be in \(0, 1\]"),
        (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1, got 0"),
        (["--task", "gsm", "--prompts", "p.jsonl"], "prompts task only"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch) -> None:
    """One line, whether or not the default grid's llama.cpp peers are installed here."""
    monkeypatch.setattr(llamacpp, "missing_reason", lambda: "llama-cpp-python is not installed")
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_cli_empty_prompt_file(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["bench", "--prompts", str(empty), "--out", str(tmp_path / "out")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_one_run_compares_verifier_formats(prompts: Path, models, tmp_path) -> None:
    """A grid naming verifier=none,int8 runs each configuration on the matching model, labels
    the rows, and refuses to run without the model a configuration asks for."""
    target, draft = models
    int8 = load_model(make_tiny_lm(seed=0), quant="int8")
    config = settings(prompts, grid=["ar:verifier=none,int8", "sps:verifier=none,int8"])
    items = load_items(config.task)
    summary = run_bench(config, items, {"none": target, "int8": int8}, draft, tmp_path / "o")
    by_id = {c["id"]: c for c in summary["configs"]}
    assert set(by_id) == {"ar", "ar@int8", "sps/K3/model", "sps/K3/model@int8"}
    assert by_id["sps/K3/model@int8"]["verifier"] == "int8"
    assert summary["verifier_divergence"] == {"int8": None}  # an in-memory model: no file
    assert summary["run"]["models"]["verifiers"]["int8"]["quant"] == "int8"
    text = (tmp_path / "o" / "summary.md").read_text()
    assert "| ar | - | - | int8 |" in text and "| ar | - | - | dense |" in text
    with pytest.raises(ValueError, match="asks for a verifier in int8 weights"):
        run_bench(config, items, target, draft, tmp_path / "other")


def test_one_run_compares_draft_models(prompts: Path, models, tmp_path) -> None:
    """A grid naming another draft runs it beside the run's draft, records both, and refuses
    to run without it."""
    target, draft = models  # the other draft: the verifier itself, which keeps every draft
    other = load_model(make_tiny_lm(seed=0))
    config = settings(prompts, grid=["sps", "sps:draft=other"])
    items = load_items(config.task)
    summary = run_bench(config, items, target, {None: draft, "other": other}, tmp_path / "o")
    by_id = {c["id"]: c for c in summary["configs"]}
    assert by_id["sps/K3/model=other"]["draft"] == "other"
    assert by_id["sps/K3/model=other"]["n"] == by_id["sps/K3/model"]["n"] == 2
    assert by_id["sps/K3/model=other"]["mean_accepted"] > by_id["sps/K3/model"]["mean_accepted"]
    assert summary["run"]["models"]["other_drafts"]["other"] is not None
    text = (tmp_path / "o" / "summary.md").read_text()
    assert "| 3 (other) |" in text and "- Draft `other`: `" in text
    with pytest.raises(ValueError, match="names draft models not given: other"):
        run_bench(config, items, target, draft, tmp_path / "other")


def test_one_run_compares_draft_heads_and_weights(prompts: Path, models, tmp_path) -> None:
    """A grid naming a cut head or other weights of the run's draft drafts with the model
    given under its key (``--draft vocab=N``, ``--draft quant=Q``), records it beside the
    run's, and refuses to run without it."""
    target, draft = models
    config = settings(prompts, grid=["sps", "sps:draft_vocab=7", "sps:draft_quant=int4"])
    assert config.other_drafts == {
        "--draft vocab=7": (None, 7, None),
        "--draft quant=int4": (None, None, "int4"),
    }
    items = load_items(config.task)
    # the verifier keeps every draft it drafts
    cut = {None: draft, "--draft vocab=7": target, "--draft quant=int4": target}
    summary = run_bench(config, items, target, cut, tmp_path / "o")
    by_id = {c["id"]: c for c in summary["configs"]}
    assert by_id["sps/K3/model/vocab7"]["draft_vocab"] == 7
    assert by_id["sps/K3/model/draft-int4"]["draft_quant"] == "int4"
    for recast in ("sps/K3/model/vocab7", "sps/K3/model/draft-int4"):
        assert by_id[recast]["mean_accepted"] > by_id["sps/K3/model"]["mean_accepted"]
    assert summary["run"]["models"]["other_drafts"]["--draft vocab=7"] is not None
    text = (tmp_path / "o" / "summary.md").read_text()
    assert "| 3 (model, vocab 7) |" in text and "| 3 (model, int4 draft) |" in text
    with pytest.raises(ValueError, match="names draft models not given: --draft vocab=7"):
        run_bench(config, items, target, draft, tmp_path / "other")


def test_the_bench_loads_each_model_and_head_once(monkeypatch) -> None:
    """A draft that is the verifier, or a grid's head equal to --draft-vocab, shares what was
    loaded; another head or quantisation is loaded on its own."""
    from cactus_spec.bench import command

    calls = []

    def loaded(name, source, *, quant, head_vocab, **options):
        calls.append((source, quant))
        return object()

    monkeypatch.setattr(command, "as_loaded", loaded)
    load = command._loader(LoadOptions())
    verifier = load("v", "none", None)
    assert load("v", "none", None) is verifier and load("d", "int8", 7) is load("d", "int8", 7)
    assert load("d", "int8", None) is not load("d", "int8", 7) and load("v", "int8", None)
    assert calls == [("v", "none"), ("d", "int8"), ("d", "int8"), ("v", "int8")]


def test_a_resumed_run_drops_a_line_cut_short_by_a_crash(tmp_path, capsys) -> None:
    from cactus_spec.bench.store import RunDirectory

    run = RunDirectory(tmp_path / "run", {"task": "t"})
    run.append({"config": "ar", "item": "a"})
    with (tmp_path / "run" / RESULTS_FILE).open("a") as f:
        f.write('{"config": "ar", "it')  # the process died mid-line
    again = RunDirectory(tmp_path / "run", {"task": "t"})
    text = (tmp_path / "run" / RESULTS_FILE).read_text()
    assert text == '{"config": "ar", "item": "a"}\n'
    assert again.finished() == {("ar", "a")}
    assert "dropped a partial last line" in capsys.readouterr().err


def test_an_unknown_model_to_fetch_is_one_error_line(capsys) -> None:
    assert main(["models", "fetch", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'") and err.count("\n") == 1


def test_one_run_compares_answer_budgets_with_sps(prompts: Path, models, tmp_path) -> None:
    """Budgeted Cactus beside SpS: each answer's KL within its budget, the Pinsker bound and
    the per-item speed over SpS in the summary, and the budget table in summary.md."""
    grid = ["sps", "cactus:kl_budget=0.01,0.2:allocation=greedy,paced", "cactus"]
    config = BenchSettings(
        TaskSpec("prompts", 2, path=str(prompts)),
        expand([parse_entry(spec) for spec in grid], [3]),
        SamplingConfig(temperature=1.0, top_k=0, top_p=1.0),
        max_new_tokens=16,
    )
    summary = run(config, models, tmp_path / "o")
    budgeted = [c for c in summary["configs"] if "kl_budget" in c]
    assert len(budgeted) == 4
    for c in budgeted:
        assert 0 <= c["kl_nats_per_sequence_max"] <= c["kl_budget"] * (1 + 1e-9), c["id"]
        assert c["tv_bound"] == pytest.approx((c["kl_budget"] / 2) ** 0.5)
        assert len(c["speedup_vs_sps"]) == 3
    plain = next(
        c for c in summary["configs"] if c["id"] == "cactus(delta=1.0,exact=false)/K3/model"
    )
    assert "kl_budget" not in plain and plain["kl_nats_per_sequence_max"] > 0.2  # can fail
    assert any("gain_kept" in c for c in budgeted)  # against SpS and Cactus(1) of the run
    assert "## An answer's divergence budget" in (tmp_path / "o" / "summary.md").read_text()
