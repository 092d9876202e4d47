"""The command line refuses bad input with one clear line and a non-zero exit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_lm

from cactus_spec.bench.demo import demo_runs
from cactus_spec.bench.store import RUN_FILE
from cactus_spec.cli import main
from cactus_spec.core.methods import build_rule
from cactus_spec.core.rules import TAS, Cactus, Interp, SpS, TopK
from cactus_spec.core.spec import DEFAULT_NUM_DRAFT_TOKENS, DecodeSpec


def test_build_rule_defaults_and_overrides() -> None:
    assert build_rule("ar", {}) is None
    assert build_rule("sps", {"delta": None}) == SpS()
    assert build_rule("cactus", {}) == Cactus(1.0)
    assert build_rule("cactus", {"delta": 0.5, "exact": True}) == Cactus(0.5, exact=True)
    assert build_rule("tas", {"alpha": 0.2}) == TAS(0.09, 0.2)
    assert build_rule("interp", {}) == Interp(0.5)
    assert build_rule("topk", {"k": 3}) == TopK(3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "bogus"], "method must be one of ar, sps, cactus"),
        (["--method", "sps", "--delta", "0.5"], "--delta does not apply to --method sps"),
        (["--method", "cactus", "--k", "3"], r"--k does not apply to --method cactus \(it applies"),
        (["--method", "ar", "--drafter", "ngram"], "--drafter does not apply to --method ar"),
        (["--method", "tas", "--verification", "block"], "--verification block takes a method"),
        (["--num-draft-tokens", "often"], "--num-draft-tokens must be an integer >= 1 or auto"),
        (["--method", "cactus", "--delta", "-1"], "delta must be a finite number >= 0"),
        (["--method", "cactus", "--kl-budget", "-1"], "--kl-budget must be a finite number >= 0"),
        (["--method", "sps", "--kl-budget", "1"], "--kl-budget applies to method cactus"),
        (["--method", "cactus", "--allocation", "paced"], "--allocation applies with --kl-budget"),
        (
            ["--method", "cactus", "--kl-budget", "1", "--allocation", "all"],
            "--allocation must be one of greedy, paced, marginal, got 'all'",
        ),
        (["--method", "tas", "--epsilon", "2"], r"epsilon must be a number in \[0, 1\]"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens must be an integer >= 1 or auto, got 0"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
        (["--verifier", "/nonexistent/model.gguf"], "cactus-spec models fetch"),
        (["--threads", "0"], "threads must be an integer >= 1, got 0"),
        (["--threads", "-1"], "threads must be an integer >= 1, got -1"),
        (["--device", "gpu9"], "device must be cpu, cuda, cuda:N or mps, got 'gpu9'"),
        (["--seed", "-1"], r"--seed must be an integer in \[0, 2\*\*64 - 1\], got -1"),
        (["--stop", ""], "stop strings must be non-empty"),
        (["--drafter", "ngram", "--draft", "/no/draft.gguf"], "--draft does not apply"),
        (["--seed", str(2**64)], r"--seed must be an integer in \[0, 2\*\*64 - 1\]"),
        (["--dtype", "int3"], "dtype must be one of"),
        (["--presence-penalty", "3"], r"--presence-penalty must be a number in \[-2, 2\]"),
        (["--repetition-penalty", "0"], r"--repetition-penalty must be a number in \(0, 10\]"),
        (["--min-p", "2"], r"min_p must be in \[0, 1\]"),
        (["--logprobs", "21"], r"--logprobs must be an integer in \[0, 20\]"),
        (["--json-schema", "/no/such.json"], "--json-schema: cannot read '/no/such.json'"),
        (["--grammar", "g.txt"], r"--grammar: the file must end in .lark or .gbnf"),
        (["--regex", " "], "--regex: a regex grammar needs a non-empty source"),
    ],
)
def test_bad_generate_input_is_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "sps", "--delta", "0.5"], "--delta does not apply to --method sps"),
        (["--method", "ar", "--drafter", "ngram"], "--drafter does not apply to --method ar"),
        (["--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
        (["--max-queue", "0"], "--max-queue must be an integer >= 1, got 0"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be an integer >= 1, got 0"),
        (["--default-max-tokens", "0"], "--default-max-tokens must be an integer >= 1, got 0"),
        (["--port", "70000"], r"--port must be in \[0, 65535\], got 70000"),
        (["--device", "gpu9"], "device must be cpu, cuda, cuda:N or mps, got 'gpu9'"),
    ],
)
def test_bad_serve_input_is_one_line_and_exit_2_before_loading(argv, message, capsys) -> None:
    assert main(["serve", "--verifier", "/nonexistent/model.gguf", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_empty_prompt(capsys) -> None:
    assert main(["generate", "  "]) == 2
    assert "prompt must not be empty" in capsys.readouterr().err


def one_line_error(capsys) -> str:
    """The error line: the last line of stderr, the only one starting "error: "."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[-1].startswith("error: ") and err.count("error: ") == 1, err
    assert "Traceback" not in err
    return lines[-1]


def test_prompt_with_invalid_utf8_is_refused(capsys) -> None:
    """Invalid bytes on a command line reach Python as lone surrogates."""
    assert main(["generate", "abc\udcff\udcfe"]) == 2
    assert "prompt is not valid UTF-8 text" in one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_refused(capsys) -> None:
    assert main(["generate", "hello", "--device", "cuda"]) == 2
    assert "device 'cuda' is not available" in one_line_error(capsys)


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--num-draft-tokens", "--rounds"])
def test_demo_checks_counts_before_loading(flag: str, capsys) -> None:
    assert main(["demo", flag, "0", "--verifier", "/no/such.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # nothing loaded first
    assert f"{flag} must be an integer >= 1" in err and err.rstrip().endswith("got 0")


@pytest.mark.parametrize(("given", "k"), [("auto", None), (4, 4)])
def test_demo_drafts_the_k_it_is_given(given: int | str, k: int | None) -> None:
    """The demo's speculative rows leave K to the policy by default (K None) and draft a
    given K; the control: a K of None given to the parser means none given, the default."""
    ar, *speculative = demo_runs(given)
    assert not ar[1].drafts
    assert [spec.num_draft_tokens for _, spec in speculative] == [k, k]
    assert DecodeSpec.of("sps", num_draft_tokens=None).num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS


def test_demo_names_the_models_it_loads(capsys) -> None:
    assert main(["demo", "--verifier", "/no/such.gguf", "--draft", "/no/draft.gguf"]) == 2
    err = capsys.readouterr().err
    assert "default pair" not in err and "/no/such.gguf (verifier)" in err


def test_bench_out_below_a_regular_file_is_refused_before_loading(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = ["bench", "--quick", "--out", str(blocker / "run"), "--verifier", "/no/such.gguf"]
    assert main(argv) == 2
    assert f"{blocker} is a file, not a directory" in one_line_error(capsys)


def test_bench_out_in_an_unwritable_place_is_refused(tmp_path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    # root writes through file permissions: then use a place no one can write in
    out = locked / "run" if not _writes_anyway(locked) else Path("/proc/cactus-spec-run")
    assert main(["bench", "--quick", "--out", str(out), "--verifier", "/no/such.gguf"]) == 2
    assert "cannot write in" in one_line_error(capsys)


def _writes_anyway(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        probe.write_text("")
    except OSError:
        return False
    probe.unlink()
    return True


def test_bench_bad_token_ids_name_file_and_line_and_write_nothing(tmp_path, capsys) -> None:
    model_dir = tmp_path / "tiny"
    make_tiny_lm().save_pretrained(model_dir)  # vocabulary 128, no tokenizer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n" + json.dumps({"prompt": [4, 999]}))
    out = tmp_path / "run"
    argv = ["bench", "--prompts", str(prompts), "--verifier", str(model_dir), "--method", "ar"]
    assert main([*argv, "--out", str(out), "--no-progress", "--max-new-tokens", "4"]) == 2
    err = one_line_error(capsys)
    assert f"{prompts}:2: prompt token ids must lie in [0, 128)" in err
    assert not (out / RUN_FILE).exists()


def test_bench_seed_range_covers_every_item(tmp_path, capsys) -> None:
    argv = ["bench", "--task", "gsm", "--n", "3", "--seed", str(2**64 - 2)]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    assert "exceeds the largest seed" in one_line_error(capsys)


@pytest.mark.slow
def test_generate_with_a_json_schema_prints_a_matching_object(tmp_path, capsys) -> None:
    from cactus_spec.loading.fetch import fetch

    schema = {
        "type": "object",
        "properties": {"animal": {"type": "string", "maxLength": 10}, "legs": {"type": "integer"}},
        "required": ["animal", "legs"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    verifier = str(fetch("smollm2-135m"))
    argv = ["generate", "Describe a cat as JSON.", "--verifier", verifier, "--method", "sps"]
    argv += ["--drafter", "ngram", "--json-schema", str(path), "--json", "--max-new-tokens", "40"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    answer = json.loads(out["text"])
    assert set(answer) == {"animal", "legs"} and isinstance(answer["legs"], int)
