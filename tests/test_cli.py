"""The command line refuses bad input with one clear line and a non-zero exit."""

from __future__ import annotations

import re

import pytest

from cactus_spec.cli import build_rule, main
from cactus_spec.rules import TAS, Cactus, Interp, SpS, TopK


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
        (["--method", "cactus", "--k", "3"], "--k does not apply to --method cactus"),
        (["--method", "ar", "--drafter", "ngram"], "--drafter does not apply to --method ar"),
        (["--method", "cactus", "--delta", "-1"], "delta must be a finite number >= 0"),
        (["--method", "tas", "--epsilon", "2"], r"epsilon must be a number in \[0, 1\]"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--target", "/nonexistent/model.gguf"], "cactus-spec models fetch"),
    ],
)
def test_bad_generate_input_is_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_empty_prompt(capsys) -> None:
    assert main(["generate", "  "]) == 2
    assert "prompt must not be empty" in capsys.readouterr().err
