"""The loading options are read by one parser (``loading.options.parse_load``): the engine,
the command line's generate and bench, and lm-eval's model args give the same one-line
error for the same bad value, before any model loads."""

from __future__ import annotations

import pytest
from conftest import make_tiny_lm

from cactus_spec import cli, isa
from cactus_spec.backends import native
from cactus_spec.backends.quant import QUANTS
from cactus_spec.bench import command as bench_command
from cactus_spec.cli import main
from cactus_spec.cli_args import parser
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.models import resolve_draft_quant, resolve_verifier_quant
from cactus_spec.loading.options import LOAD_KEYS, LoadOptions, parse_load
from cactus_spec.runtime.engine import SpeculativeDecoder

NOWHERE = "/nonexistent/model.gguf"  # never loads: every error below comes first

#: (key, a bad value, what the error says after the key's name)
BAD = [
    ("threads", 0, "must be an integer >= 1, got 0"),
    ("draft_vocab", 0, "must be an integer >= 1, got 0"),
    ("device", "gpu9", "must be cpu, cuda, cuda:N or mps, got 'gpu9'"),
    ("dtype", "int3", "must be one of bfloat16, bf16, float32"),
]


def _flag(key: str) -> str:
    return f"--{key.replace('_', '-')}"


def test_defaults_and_resolution() -> None:
    options = parse_load({}, needs_draft=True)
    assert (options.verifier, options.draft) == DEFAULT_PAIR
    assert options == LoadOptions(draft=DEFAULT_PAIR[1], draft_quant=options.draft_quant)
    assert parse_load({"draft": "x"}, needs_draft=True).draft == "x"
    assert parse_load({}, needs_draft=False).draft is None
    auto = parse_load({"verifier_quant": "auto"}, needs_draft=False).verifier_quant
    assert auto == resolve_verifier_quant("auto") and auto in ("none", "int8")
    assert parse_load({"threads": "2", "draft_vocab": "7"}, needs_draft=True).threads == 2
    assert set(parse_load({}, needs_draft=False).as_kwargs()) == set(LOAD_KEYS)
    assert options.draft_quant == resolve_draft_quant("auto", 1)


def test_the_drafts_format_fits_the_rows_decoded_at_once(monkeypatch) -> None:
    """``draft_quant`` auto, given or not: int4 (its one-row step reads about half of int8's
    bytes), but int8 where AMX tiles run several rows, int8 without the native kernels, dense
    off the CPU. A format asked for is kept whatever the rows and level (the control: rows
    and level pick only auto's)."""
    monkeypatch.setattr(native, "available", lambda: True)
    formats = {}
    for level in ("amx", "avx512", "avx2"):
        monkeypatch.setattr(isa, "level", lambda level=level: level)
        formats[level] = [parse_load({}, needs_draft=True, rows=r).draft_quant for r in (1, 2, 8)]
        for quant in QUANTS:
            kept = {
                parse_load({"draft_quant": quant}, needs_draft=True, rows=r).draft_quant
                for r in (1, 8)
            }
            assert kept == {quant}
    assert formats == {
        "amx": ["int4", "int8", "int8"], "avx512": ["int4"] * 3, "avx2": ["int4"] * 3,
    }  # fmt: skip
    assert parse_load({"draft_quant": "auto"}, needs_draft=True) == parse_load({}, needs_draft=True)
    assert resolve_draft_quant("auto", 1, "cuda") == "none"
    monkeypatch.setattr(native, "available", lambda: False)
    assert resolve_draft_quant("auto", 1) == "int8"


@pytest.mark.parametrize(
    ("command", "rows"),
    [(["generate", "hi"], 1), (["demo"], 1), (["bench"], 1), (["bench", "--max-batch", "8"], 8)],
)
def test_each_command_drafts_in_the_format_of_the_rows_it_decodes(command, rows, monkeypatch):
    """generate and demo decode one row, bench its --max-batch (serve's: its --max-batch,
    ``test_serve_shutdown``); on AMX one row drafts in int4, eight in int8."""
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(isa, "level", lambda: "amx")
    args = parser().parse_args(command)
    read = bench_command._load_options if command[0] == "bench" else cli._load_options
    assert read(args, True).draft_quant == {1: "int4", 8: "int8"}[rows]


@pytest.mark.parametrize("command", [["generate", "hi"], ["demo"], ["serve"], ["bench"]])
def test_a_flag_left_out_reads_as_the_key_left_out(command: list[str]) -> None:
    """The model flags' defaults are ``parse_load``'s (--draft-quant's among them), bar
    --verifier-quant, auto on the command line."""
    args = parser().parse_args(command)
    given = {key: getattr(args, key) for key in LOAD_KEYS if key != "verifier_quant"}
    assert parse_load(given, needs_draft=True) == parse_load({}, needs_draft=True)


def test_refusals_name_the_key_as_the_caller_writes_it() -> None:
    with pytest.raises(ValueError, match="unknown key 'thread'"):
        parse_load({"thread": 2}, needs_draft=False)
    with pytest.raises(ValueError, match="--draft-vocab does not apply: nothing is drafted"):
        parse_load({"draft_vocab": 8}, needs_draft=False, label=_flag)
    with pytest.raises(ValueError, match="backend must be one of auto, lean, hf, ggml, got 'fast'"):
        parse_load({"backend": "fast"}, needs_draft=False)
    with pytest.raises(ValueError, match="draft_quant must be one of none, int8, int4"):
        parse_load({"draft_quant": "int3"}, needs_draft=True)
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 'two'"):
        parse_load({"threads": "two"}, needs_draft=False)
    with pytest.raises(TypeError, match="verifier must be a model name.*got NoneType"):
        parse_load({}, needs_draft=False, default_pair=None)
    with pytest.raises(ValueError, match="verifier must be a model name, path or hub id"):
        parse_load({"verifier": " "}, needs_draft=False)


@pytest.mark.parametrize(("key", "value", "says"), BAD)
def test_the_same_error_from_every_caller(key: str, value: object, says: str, capsys) -> None:
    """The engine, generate, bench and lm-eval: one message, the key named their way."""
    spec = DecodeSpec.of("sps", num_draft_tokens=2)
    with pytest.raises(ValueError) as engine:
        SpeculativeDecoder(NOWHERE, NOWHERE, spec, **{key: value})
    assert str(engine.value).startswith(f"{key} {says}"), engine.value
    for command in (["generate", "hi"], ["bench", "--task", "gsm", "--n", "1", "--method", "sps"]):
        argv = [*command, "--verifier", NOWHERE, "--draft", NOWHERE, _flag(key), str(value)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {_flag(key)} {says}") and err.count("\n") == 1, err
    pytest.importorskip("lm_eval")
    from cactus_spec.lm_eval.model import CactusSpecLM

    with pytest.raises(ValueError) as lm_eval:
        CactusSpecLM.create_from_arg_string(f"verifier={NOWHERE},method=sps,{key}={value}")
    assert str(lm_eval.value) == str(engine.value)


def test_a_draft_where_nothing_drafts_is_refused_everywhere(capsys) -> None:
    """Control: the same draft is taken where the spec drafts with a model."""
    with pytest.raises(ValueError, match="draft does not apply: nothing is drafted"):
        SpeculativeDecoder(make_tiny_lm(), make_tiny_lm(), DecodeSpec.of("ar"))
    assert main(["generate", "hi", "--method", "ar", "--draft", NOWHERE]) == 2
    assert "--draft does not apply: nothing is drafted" in capsys.readouterr().err
    tiny = make_tiny_lm()
    engine = SpeculativeDecoder(tiny, tiny, DecodeSpec.of("sps", num_draft_tokens=2))
    assert engine.spec.drafter == "model"
