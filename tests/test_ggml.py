"""The ggml backend: llama.cpp runs SmolLM2-135M's GGUF (Q4_1) itself, with no dense copy.

Greedy AR through the engine gives llama.cpp's own greedy tokens (the binding's ``Llama``, fed
as the engine feeds: the prompt but its last token, then one token at a time); rollback
leaves the cache a fresh read's; a row among three others reads the bits it reads alone and
decodes the tokens it decodes alone; greedy SpS with a ggml draft gives AR's tokens; SpS
through ggml keeps the ggml verifier's law; the ggml verifier's KL from the dense bfloat16
copy of the same GGUF is measured (the copy against itself reads zero) and ``generate``
reports it, cached under the GGUF's type apart from int8's; bad input is one line naming the
backend and what it reads, before anything loads. On aarch64 the same llama.cpp (cross-compiled
with NEON, dotprod and i8mm by ``make aarch64``, run under qemu-user) reads the engine's law
within a small KL.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import AR, make_tiny_lm, need_llama_cpp
from test_engine import chi_square_p_value, sampled_pairs

from cactus_spec.backends.ggml import build_level as ggml_build_level
from cactus_spec.cli import main
from cactus_spec.core.audit import kl
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading import divergence, gguf
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.loading.options import parse_load
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request

MODEL = "smollm2-135m"
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one sentence.",
    "List three prime numbers and explain why each is prime.",
]
NEW_TOKENS = 64
GREEDY = SamplingConfig(temperature=0.0)
THREADS = 2
#: ``make aarch64``'s program: tests/cross/logits.c against llama.cpp built for aarch64.
AARCH64_LOGITS = Path(__file__).resolve().parents[1] / "build" / "aarch64" / "bin" / "logits"
#: An emulated token costs about 1 s, so the aarch64 check reads fewer.
EMULATED_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    need_llama_cpp()
    from cactus_spec.loading.fetch import fetch

    return fetch(MODEL)


@pytest.fixture(scope="module")
def smollm(gguf_path: Path) -> LoadedModel:
    return load_model(gguf_path, backend="ggml", threads=THREADS)


@pytest.fixture(scope="module")
def ar(smollm: LoadedModel) -> SpeculativeDecoder:
    """AR through ggml, without prefix caching: every prompt is read whole, as the
    reference reads it."""
    return SpeculativeDecoder(smollm, None, AR, backend="ggml", prefix_cache=False)


def _llama_cpp_greedy(llm, ids: list[int], count: int, eos: frozenset[int]) -> list[int]:
    """llama.cpp's own greedy decoding (``Llama.generate`` at temperature 0, top-k 1), fed as
    the engine feeds: the prompt but its last token first, then one token at a time."""
    llm.reset()
    llm.eval(ids[:-1])
    tokens: list[int] = []
    stream = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    for token in stream:  # reuses the prompt's cached part, reads its last token alone
        tokens.append(int(token))
        if token in eos or len(tokens) == count:
            break
    stream.close()
    return tokens


@pytest.mark.slow
def test_greedy_ar_gives_llama_cpps_own_greedy_tokens(
    ar: SpeculativeDecoder, smollm: LoadedModel, gguf_path: Path
) -> None:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=ar.context_length,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        flash_attn=True,  # as the backend (the binding's default is off)
        verbose=False,
    )
    runs = []
    for text in PROMPTS:
        ids = ar.encode(text)
        ours = ar.generate(ids, NEW_TOKENS, temperature=0.0).token_ids
        assert ours == _llama_cpp_greedy(llm, ids, NEW_TOKENS, smollm.eos_ids), text
        runs.append((ids, ours))
    # negative control: the check can fail; another prompt's tokens are not these
    (ids, ours), (other, _) = runs[0], runs[1]
    assert _llama_cpp_greedy(llm, other, NEW_TOKENS, smollm.eos_ids) != ours
    llm.close()


def _aarch64_logits(gguf_path: Path, ids: list[int], prompt: int, vocab: int) -> torch.Tensor:
    """The logits llama.cpp built for aarch64 reads along ``ids`` after its first ``prompt``
    [len(ids) - prompt + 1, V], under qemu-user (Debian's sysroot; ``-cpu max`` has dotprod,
    i8mm and half-precision arithmetic)."""
    command = ["qemu-aarch64", "-cpu", "max", "-L", "/usr/aarch64-linux-gnu", str(AARCH64_LOGITS)]
    command += [str(gguf_path), str(THREADS), str(prompt), *map(str, ids)]
    done = subprocess.run(command, capture_output=True, timeout=600, check=True)
    return torch.frombuffer(bytearray(done.stdout), dtype=torch.float32).reshape(-1, vocab)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row of logits, in nats [T]."""
    return kl(p_logits.softmax(-1), q_logits.softmax(-1))


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="cross-compiled from x86")
def test_llama_cpp_built_for_aarch64_reads_the_engines_law(
    ar: SpeculativeDecoder, smollm: LoadedModel, gguf_path: Path
) -> None:
    """What the ggml backend runs on ARM: the pinned llama.cpp compiled for aarch64 (its NEON,
    dotprod and i8mm kernels) reads, along the engine's greedy answers here, a law within
    0.01 nats per token of the one the engine reads through ggml here (measured 0.0006-0.0025
    mean on SmolLM2: its kernels round otherwise, half-precision arithmetic among them, so
    its logits move by up to about 1.2), and the same greedy token wherever the top two stand
    2.5 apart."""
    from cactus_spec.backends.ggml import GgmlBackend

    if not (AARCH64_LOGITS.is_file() and shutil.which("qemu-aarch64")):
        if os.environ.get("CACTUS_SPEC_REQUIRE_GGML"):
            pytest.fail(f"no aarch64 build at {AARCH64_LOGITS} or no qemu-aarch64: make aarch64")
        pytest.skip("no aarch64 build (make aarch64)")
    assert AARCH64_LOGITS.read_bytes()[18:20] == (183).to_bytes(2, "little")  # ELF: AArch64
    for text in PROMPTS[:2]:
        ids = ar.encode(text)
        answer = ids + ar.generate(ids, EMULATED_TOKENS, temperature=0.0).token_ids
        backend = GgmlBackend(smollm.model, slots=1)  # fed as the program feeds
        backend.append(answer[: len(ids) - 1], keep=1)
        ours = torch.cat([backend.append([t], keep=1) for t in answer[len(ids) - 1 :]])  # [T, V]
        theirs = _aarch64_logits(gguf_path, answer, len(ids), smollm.model.vocab_size)  # [T, V]
        assert theirs.shape == ours.shape
        divergence = _kl(theirs, ours)  # [T]
        assert divergence.mean() < 0.01 and divergence.max() < 0.05, text
        top = ours.topk(2).values  # [T, 2]
        clear = top[:, 0] - top[:, 1] > 2.5
        assert clear.sum() >= len(clear) // 2
        assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear]), text
        # negative control: the check can fail; a position's law is not the next one's
        assert _kl(theirs[:-1], ours[1:]).mean() > 1.0


@pytest.mark.slow
def test_rollback_leaves_the_cache_a_fresh_reads(smollm: LoadedModel) -> None:
    from cactus_spec.backends.ggml import GgmlBackend

    backend = GgmlBackend(smollm.model, slots=1)
    prompt = [1, 504, 3458, 314, 253, 1345, 28, 1530, 314, 4118, 30]
    backend.append(prompt, keep=1)
    backend.append([216, 1054, 4591, 17], keep=0)  # drafts, then rejected
    backend.rollback(len(prompt))
    assert backend.length_of(0) == len(prompt)
    after = backend.append([216], keep=1)  # [1, V]
    backend.reset()
    backend.append(prompt, keep=1)
    fresh = backend.append([216], keep=1)  # [1, V] the same feeding: prompt, then one token
    # the same cells hold the same keys at the same positions, so the logits are the same
    assert torch.equal(after, fresh)
    # negative control: without the rollback the drafts are still read, and the logits move
    backend.append([1054], keep=1)
    drifted = backend.append([216], keep=1)
    assert (drifted - fresh).abs().max() > 0.1


@pytest.mark.slow
def test_a_row_among_three_others_reads_what_it_reads_alone(smollm: LoadedModel) -> None:
    from cactus_spec.backends.ggml import GgmlBackend

    prompts = [[1, 504, 3458, 314, 253, 1345], [1, 2683], [1, 330, 1345, 314, 28, 8, 19], [1, 9]]
    feeds = [[216, 1054, 4591, 17, 30], [28], [19, 40, 1345], [504] * 11]
    alone = GgmlBackend(smollm.model, slots=1)
    alone.append(prompts[0], keep=1)
    own = alone.append(feeds[0])  # [5, V]
    batch = GgmlBackend(smollm.model, slots=4)
    rows = [2, 0, 3, 1]  # the caller's order, not the ids'
    batch.append_ragged([prompts[r] for r in rows], rows, last_only=True)
    mixed = batch.append_ragged([feeds[r] for r in rows], rows)  # 4 x [T_i, V]
    assert [m.shape[0] for m in mixed] == [len(feeds[r]) for r in rows]
    lengths = [len(p) + len(f) for p, f in zip(prompts, feeds, strict=True)]
    assert [batch.length_of(r) for r in range(4)] == lengths
    # each row has a KV stream of its own: its logits are the bits it reads alone
    assert torch.equal(mixed[1], own)
    # negative control: another row's logits are not these
    assert (mixed[2][:5] - own).abs().max() > 1.0


@pytest.mark.slow
def test_a_row_decodes_the_same_tokens_beside_three_others(smollm: LoadedModel) -> None:
    engine = SpeculativeDecoder(smollm, None, AR, backend="ggml", max_batch=4, prefix_cache=False)
    requests = [
        Request(prompt_ids=engine.encode(text), max_new_tokens=24, seed=0)
        for text in [*PROMPTS, "Tell me a joke about cats."]
    ]
    alone = [engine.decode_many([r], GREEDY)[0].token_ids for r in requests]
    together = [r.token_ids for r in engine.decode_many(requests, GREEDY)]
    assert together == alone
    assert len({tuple(t) for t in alone}) == 4  # negative control: the rows differ


@pytest.mark.slow
def test_greedy_sps_with_a_ggml_draft_gives_ar_tokens(
    ar: SpeculativeDecoder, smollm: LoadedModel
) -> None:
    spec = DecodeSpec.of("sps", num_draft_tokens=4)
    sps = SpeculativeDecoder(smollm, smollm, spec, backend="ggml", prefix_cache=False)
    for text in PROMPTS:
        ids = ar.encode(text)
        result = sps.generate(ids, 32, temperature=0.0)
        assert result.token_ids == ar.generate(ids, 32, temperature=0.0).token_ids
        assert result.stats.accepted > 0  # the draft's tokens were kept, not only corrected


def _ggml_pair_law(smollm: LoadedModel, prompt: list[int], sampling) -> dict:
    """P(t1, t2) = q(t1 | prompt) q(t2 | prompt, t1) from the ggml verifier's logits,
    enumerating t1 over q's support."""
    from cactus_spec.backends.ggml import GgmlBackend

    backend = GgmlBackend(smollm.model, slots=1)
    q1 = logits_to_probs(backend.append(prompt, keep=1)[0], sampling)
    law = {}
    for t1 in q1.nonzero().flatten().tolist():
        backend.rollback(len(prompt))
        q2 = logits_to_probs(backend.append([t1], keep=1)[0], sampling)
        for t2 in q2.nonzero().flatten().tolist():
            law[(t1, t2)] = float(q1[t1] * q2[t2])
    return law


@pytest.mark.slow
def test_sps_through_ggml_emits_the_ggml_verifiers_law_and_rejects_cactus(
    smollm: LoadedModel,
) -> None:
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
    prompt = [19, 28, 20, 28, 21, 28, 19, 28, 20, 28, 21, 28, 19, 28]  # the n-gram drafter drafts
    runs = 200

    def engine(method: str, **params) -> SpeculativeDecoder:
        spec = DecodeSpec.of(method, num_draft_tokens=2, drafter="ngram", **params)
        return SpeculativeDecoder(smollm, None, spec, backend="ggml")

    sps, cactus = engine("sps"), engine("cactus", delta=5.0)
    law = _ggml_pair_law(smollm, prompt, sampling)
    assert chi_square_p_value(sampled_pairs(sps, prompt, runs, sampling), law, runs) > 1e-3
    negative = chi_square_p_value(sampled_pairs(cactus, prompt, runs, sampling), law, runs)
    assert negative < 1e-6  # negative control: the same test can fail


@pytest.mark.slow
def test_trees_are_refused_by_name(smollm: LoadedModel) -> None:
    engine = SpeculativeDecoder(smollm, smollm, DecodeSpec.of("sps"), backend="ggml")
    spec = DecodeSpec.of("sps", num_draft_tokens=2, verification="tree", branches=2)
    with pytest.raises(ValueError, match="token-tree attention, which the verifier's backend"):
        engine.generate([1, 504, 3458], 4, spec=spec)
    from cactus_spec.backends.ggml import GgmlBackend

    with pytest.raises(ValueError, match="the ggml backend does not read token trees"):
        GgmlBackend(smollm.model, slots=1).append_tree([[5]], [[-1]], [0])


#: Tokens the divergence tests measure (the engine's measure reads 256: minutes here).
MEASURED = 24


@pytest.mark.slow
def test_the_ggml_verifier_diverges_from_bf16_where_bf16_reads_zero_from_itself(
    smollm: LoadedModel, gguf_path: Path
) -> None:
    """The ggml verifier (Q4_1) against the dense bfloat16 copy of the same GGUF, as the lean
    backend runs it, in both regimes; the copy against itself is the negative control."""
    reference = load_model(gguf_path, dtype="bfloat16")
    text = divergence.reference_text()
    ids = smollm.tokenizer(text).input_ids[: divergence.PREFIX_TOKENS + MEASURED]
    ggml = divergence.measure(make_backend(reference), make_backend(smollm), ids, "Q4_1")
    assert 0 < ggml.kl_one_row < 0.1 and 0 < ggml.kl_block < 0.1
    assert ggml.tokens == MEASURED and ggml.agreement_one_row > 0.8
    itself = divergence.measure(make_backend(reference), make_backend(reference), ids, "none")
    assert itself.kl_one_row == itself.kl_block == 0.0
    assert itself.agreement_one_row == itself.agreement_block == 1.0


@pytest.mark.slow
def test_generate_on_ggml_reports_the_verifiers_divergence_apart_from_int8s(
    gguf_path: Path, capsys, monkeypatch, tmp_path
) -> None:
    """``generate --backend ggml`` measures the GGUF verifier's KL from bfloat16 once, reports
    it in --json and the table, and caches it under the GGUF's type: the int8 verifier of the
    same file gets an entry of its own."""
    monkeypatch.setattr(divergence, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(divergence, "MEASURED_TOKENS", MEASURED)
    monkeypatch.setenv("COLUMNS", "200")  # the table's rows on one line each
    argv = ["generate", "Say hello.", "--verifier", str(gguf_path), "--method", "ar"]
    argv += ["--max-new-tokens", "4", "--threads", str(THREADS)]
    assert main([*argv, "--backend", "ggml", "--json"]) == 0
    first = capsys.readouterr()
    assert "measuring the Q4_1 verifier's divergence from bfloat16" in first.err
    reported = json.loads(first.out)["verifier"]
    found = reported["divergence"]
    assert reported["quant"] == found["quant"] == "Q4_1" and found["tokens"] == MEASURED
    assert 0 < found["kl_one_row"] < 0.1 and 0 < found["kl_block"] < 0.1
    assert main([*argv, "--backend", "ggml"]) == 0  # the table, from the cache
    second = capsys.readouterr()
    assert "measuring" not in second.err
    assert f"Q4_1 verifier vs bfloat16 (KL nats/token) │ {found['kl_one_row']:.4f}" in second.out
    assert main([*argv, "--verifier-quant", "int8", "--json"]) == 0
    assert "measuring the int8 verifier" in capsys.readouterr().err
    cache = json.loads((tmp_path / "divergence.json").read_text())
    assert sorted(entry["quant"] for entry in cache.values()) == ["Q4_1", "int8"]
    assert all(f"|{entry['quant']}|" in key for key, entry in cache.items())


# --- bad input: one line naming the backend, before anything loads ------------------------


@pytest.fixture
def installed(monkeypatch) -> None:
    """As if llama-cpp-python were installed: these checks run before it is ever imported."""
    monkeypatch.setattr(gguf, "available", lambda: True)


def _ggml(**given) -> object:
    return parse_load({"backend": "ggml", "verifier": MODEL, **given}, needs_draft=False)


def test_a_missing_library_is_named(monkeypatch) -> None:
    monkeypatch.setattr(gguf, "available", lambda: False)
    with pytest.raises(ValueError, match=r"^backend ggml needs llama-cpp-python; pip install"):
        _ggml()


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"verifier_quant": "int8"}, "verifier_quant int8 does not apply to backend ggml"),
        ({"dtype": "bfloat16"}, "dtype bfloat16 does not apply to backend ggml"),
        ({"verifier": "Org/model"}, "verifier 'Org/model' is neither a known model nor a file"),
        ({"verifier": make_tiny_lm()}, "verifier is a transformers model already loaded"),
    ],
)
def test_options_ggml_cannot_honour_are_refused_by_name(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _ggml(**given)


@pytest.mark.usefixtures("installed")
def test_draft_options_are_refused_by_name_and_auto_reads_none() -> None:
    draft = {"backend": "ggml", "verifier": MODEL, "draft": MODEL}
    options = parse_load(draft | {"verifier_quant": "auto"}, needs_draft=True)
    assert (options.verifier_quant, options.draft_quant) == ("none", "none")
    with pytest.raises(ValueError, match="draft_quant int4 does not apply to backend ggml"):
        parse_load(draft | {"draft_quant": "int4"}, needs_draft=True)
    with pytest.raises(ValueError, match="draft_vocab 100 does not apply to backend ggml"):
        parse_load(draft | {"draft_vocab": 100}, needs_draft=True)


@pytest.mark.usefixtures("installed")
def test_a_folder_without_a_gguf_is_refused_on_the_command_line(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = ["generate", "hi", "--backend", "ggml", "--verifier", str(tmp_path), "--method", "ar"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --backend ggml reads a GGUF file") and "\n" not in err
    assert f"--verifier '{tmp_path}' is a directory without a GGUF file" in err
    (tmp_path / "m.gguf").write_bytes(b"")
    assert main(argv) == 2
    assert "name its GGUF file (m.gguf)" in capsys.readouterr().err


@pytest.mark.usefixtures("installed")
def test_trees_and_a_bad_backend_are_refused_on_the_command_line(capsys) -> None:
    argv = ["generate", "hi", "--backend", "ggml", "--verifier", MODEL, "--draft", MODEL]
    assert main([*argv, "--verification", "tree"]) == 2
    assert "--backend ggml lacks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--backend", "gml"])
    assert "invalid choice: 'gml'" in capsys.readouterr().err


# --- the level llama.cpp's kernels run at -----------------------------------------------


def test_the_installed_build_runs_the_cpus_own_level_and_a_held_process_refuses_it(
    gguf_path: Path, tmp_path
) -> None:
    """``make peers`` builds llama.cpp for this CPU (without AMX, ``Makefile``), so its system
    info reads the CPU's own level; a process held below it, with no build for the held level
    (an empty cache), refuses to load the GGUF and names both levels, while a process held at
    the build's own level loads it (the control: the refusal is the level's, not the file's)."""
    from cactus_spec import isa
    from cactus_spec.backends import ggml

    levels = [level for level in isa.available() if level != "amx"]
    if not levels:
        pytest.skip("not an x86 CPU: llama.cpp's level is its own")
    built = ggml.build_level(ggml._library().llama_print_system_info().decode())
    assert built == levels[0]
    below = isa.ISAS[isa.ISAS.index(built) + 1]
    held = _load_held(gguf_path, below, tmp_path)
    assert held.returncode != 0
    assert f"CACTUS_SPEC_ISA={below}, but llama.cpp's library runs {built}" in held.stderr
    assert f"make ggml-{below}" in held.stderr
    same = _load_held(gguf_path, built, tmp_path)
    assert same.returncode == 0, same.stderr


def _load_held(path: Path, level: str, cache: Path) -> subprocess.CompletedProcess:
    """``load_model(path, backend="ggml")`` in a process held to ``level``, its cache (where
    held builds live) ``cache``, no LLAMA_CPP_LIB_PATH."""
    env = {**os.environ, "CACTUS_SPEC_CACHE": str(cache), "CACTUS_SPEC_ISA": level}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    load = "import sys; from cactus_spec.loading.models import load_model; "
    load += "load_model(sys.argv[1], backend='ggml')"
    command = [sys.executable, "-c", load, str(path)]
    return subprocess.run(command, env=env, capture_output=True, text=True)


def test_a_build_level_is_its_highest_x86_features() -> None:
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | OPENMP = 1"
    assert ggml_build_level(info) == "avx2"
    assert ggml_build_level(info.replace("AVX512 = 0", "AVX512 = 1")) == "avx512"
    assert ggml_build_level(info + " | AMX_INT8 = 1") == "amx"
    assert ggml_build_level("CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1") == "portable"


def test_fetch_makes_no_dense_copy_where_auto_runs_ggml(
    gguf_path: Path, tmp_path, monkeypatch, capsys
) -> None:
    """Off x86 backend auto reads the GGUF through ggml, so ``models fetch`` leaves the dense
    copy unmade (its third column "-"); where ours run (an x86 level with AVX512), it is
    needed: the control."""
    from cactus_spec import isa
    from cactus_spec.loading.fetch import dense_needed, main_fetch
    from cactus_spec.loading.model_store import known_gguf_path

    monkeypatch.setenv("CACTUS_SPEC_CACHE", str(tmp_path))
    known_gguf_path(MODEL).parent.mkdir(parents=True)
    known_gguf_path(MODEL).symlink_to(gguf_path)
    monkeypatch.setattr(isa, "chosen", lambda: "native")
    monkeypatch.setattr(isa, "level", lambda: "avx512")
    assert dense_needed([MODEL]) == (True, "our kernels: on avx512 they measure faster than ggml")
    monkeypatch.setattr(isa, "level", lambda: "portable")
    assert dense_needed([MODEL])[0] is False
    assert main_fetch([MODEL]) == 0
    assert capsys.readouterr().out == f"{MODEL}\t{known_gguf_path(MODEL)}\t-\n"
    assert not (tmp_path / "dense").exists()
