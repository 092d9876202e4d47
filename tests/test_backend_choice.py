"""Backend ``auto``: our kernels where they measure faster, ggml (llama.cpp over the GGUF
files) elsewhere, and only where ggml runs what was asked as asked; the choice says why."""

from __future__ import annotations

import pytest
from conftest import need_llama_cpp

from cactus_spec import isa
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.backend_choice import auto_backend, choose_backend
from cactus_spec.loading.options import parse_load
from cactus_spec.runtime.engine import SpeculativeDecoder


@pytest.mark.parametrize(
    ("level", "drafts", "blocker", "backend"),
    [
        ("amx", False, None, "auto"),
        ("avx512", False, None, "auto"),
        ("avx512", True, None, "auto"),
        ("avx2", True, None, "auto"),  # speculation pays on ours, not through ggml
        ("avx2", False, None, "ggml"),  # AR: llama.cpp's Q4_K_M kernels are faster
        ("avx2", False, "it is missing", "auto"),
        ("portable", True, None, "ggml"),  # off x86 ours are portable C++
        ("portable", False, "it is missing", "auto"),
    ],
)
def test_the_rule_by_level_drafting_and_what_blocks_ggml(level, drafts, blocker, backend) -> None:
    choice = choose_backend(level, drafts, blocker)
    assert choice.backend == backend
    assert choice.why.startswith("ggml: " if backend == "ggml" else "our kernels: ")
    assert blocker is None or blocker in choice.why  # a blocked choice names its blocker


@pytest.fixture
def off_x86(monkeypatch):
    """This process as one with no x86 level of ours (an ARM CPU): its CPU's own level,
    llama.cpp's own build."""
    need_llama_cpp()
    monkeypatch.setattr(isa, "level", lambda: "portable")
    monkeypatch.setattr(isa, "chosen", lambda: "native")


AUTO = {"verifier": "smollm2-135m", "verifier_quant": "auto"}


def test_auto_takes_ggml_where_it_runs_what_was_asked(off_x86) -> None:
    options = parse_load(AUTO, needs_draft=False, default_pair=None)
    assert options.backend == "ggml" and options.verifier_quant == "none"
    assert options.backend_why.startswith("ggml: where our kernels are portable C++")
    drafting = parse_load({**AUTO, "draft": "smollm2-135m"}, needs_draft=True, default_pair=None)
    assert drafting.backend == "ggml" and drafting.draft_quant == "none"


@pytest.mark.parametrize(
    ("asked", "trees", "named"),
    [
        ({"verifier_quant": "int8"}, False, "verifier_quant is int8"),
        ({"verifier_quant": "none"}, False, "verifier_quant is none"),
        ({}, False, "verifier_quant is none"),  # not given: the library's dense law
        ({"verifier_quant": "auto", "dtype": "float32"}, False, "dtype float32"),
        ({"verifier_quant": "auto", "draft_quant": "int4"}, False, "draft_quant int4"),
        ({"verifier_quant": "auto", "draft_vocab": 1000}, False, "draft_vocab 1000"),
        ({"verifier_quant": "auto", "device": "cuda"}, False, "device cuda"),
        ({"verifier_quant": "auto"}, True, "draft trees"),
        ({"verifier_quant": "auto", "draft": "/models/draft"}, False, "draft is not a GGUF"),
    ],
)
def test_auto_stays_ours_where_ggml_cannot_run_what_was_asked(off_x86, asked, trees, named):
    """Each option that ggml cannot honour keeps ours, named (the control, ggml without
    them: ``test_auto_takes_ggml_where_it_runs_what_was_asked``)."""
    given = {"verifier": "smollm2-135m", "draft": "smollm2-135m", **asked}
    choice = auto_backend(given, drafts=True, trees=trees)
    assert choice.backend == "auto" and named in choice.why, choice.why


def test_on_this_machines_own_level_the_rule_reads_the_cpu() -> None:
    """Unpatched: on AMX or AVX512 auto is ours, saying so; the bench keeps ours wherever
    (it has no ggml rows)."""
    options = parse_load(AUTO, needs_draft=False, default_pair=None)
    if isa.level() in ("amx", "avx512"):
        assert options.backend == "auto"
        assert options.backend_why == f"our kernels: on {isa.level()} they measure faster than ggml"
    kept = parse_load(AUTO, needs_draft=False, auto_ggml=False, default_pair=None)
    assert kept.backend == "auto" and kept.backend_why == ""


@pytest.mark.slow
def test_an_engine_auto_chose_ggml_for_decodes_as_ggml_named(off_x86) -> None:
    """SmolLM2 through ``auto`` where it takes ggml: the engine runs ggml, and its greedy
    tokens are those of ``backend="ggml"`` named outright; asked for float32 weights, auto
    runs ours."""
    spec = DecodeSpec.of("ar")
    chosen = SpeculativeDecoder("smollm2-135m", spec=spec, verifier_quant="auto")
    named = SpeculativeDecoder("smollm2-135m", spec=spec, backend="ggml")
    dense = SpeculativeDecoder("smollm2-135m", spec=spec, dtype="float32")  # blocked: ours
    assert (chosen.backend, named.backend, dense.backend) == ("ggml", "ggml", "lean")
    prompt = "def fibonacci(n):"
    tokens = [d.generate(prompt, 24, temperature=0, chat=False).token_ids for d in (chosen, named)]
    assert tokens[0] == tokens[1]
