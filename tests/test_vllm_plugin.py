"""The vLLM plugin's reading of requests and its meter, which need no vLLM: a request's
``cactus_*`` extra args and the server's default go through the one spec parser."""

from __future__ import annotations

import json

import pytest
import torch

from cactus_spec.core.audit import kl, one_hot_divergences, step_divergences
from cactus_spec.core.block_verification import verify_block
from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm.calls import RuleRow, rule_targets, spans
from cactus_spec.integrations.vllm.meter import METER_FILE_ENV, Chain, Meter
from cactus_spec.integrations.vllm.plugin import check_version, resolve, resolve_all
from cactus_spec.integrations.vllm.requests import default_spec, request_spec
from cactus_spec.integrations.vllm.sampler import judge_blocks
from cactus_spec.runtime.drafters import Draft
from cactus_spec.runtime.verifications import Block, Verification

CACTUS = DecodeSpec.of("cactus", delta=0.5)
CHAIN = Verification()  # a row's kind: token by token
BLOCK = DecodeSpec.of("sps", verification="block")


def test_a_request_names_its_rule_with_prefixed_keys_and_text_values() -> None:
    spec = request_spec({"cactus_method": "cactus", "cactus_delta": "0.5", "other": 1}, None)
    assert (spec.method, dict(spec.params)) == ("cactus", {"delta": 0.5, "exact": False})
    exact = request_spec({"cactus_method": "cactus", "cactus_exact": "true"}, None)
    assert exact.rule.exact is True


def test_nothing_asked_is_the_default_and_no_default_is_vllms_own() -> None:
    default = default_spec({"cactus_spec": {"method": "cactus", "delta": 0.5}})
    assert default == CACTUS
    assert request_spec({"seed_like": 3}, default) == CACTUS
    assert request_spec(None, None) is None
    assert default_spec({}) is None and default_spec(None) is None
    assert request_spec({"cactus_method": "sps"}, default) == DecodeSpec.of("sps")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cactus_method": "nope"}, "cactus_method must be one of ar, sps, cactus"),
        ({"cactus_method": "cactus", "cactus_delta": -1}, "cactus_delta must be a finite"),
        ({"cactus_method": "cactus", "cactus_exact": 1}, "cactus_exact must be true or false"),
        ({"cactus_method": "topk", "cactus_k": 0}, "cactus_k must be an integer >= 1"),
        ({"cactus_delta": 0.5}, "cactus_method is required with method parameters"),
        ({"cactus_method": "sps", "cactus_delta": 0.5}, "cactus_delta does not apply to"),
        ({"cactus_num_draft_tokens": 4}, "cactus_num_draft_tokens does not apply in vLLM"),
        ({"cactus_drafter": "ngram"}, "cactus_drafter does not apply in vLLM"),
        (
            {"cactus_method": "cactus", "cactus_verification": "tree"},
            "cactus_verification tree does not apply in vLLM: it drafts one chain; the values "
            "are chain, block",
        ),
        ({"cactus_method": "topk", "cactus_verification": "block"}, "cactus_verification block"),
        ({"cactus_branches": 2}, "cactus_branches does not apply in vLLM"),
        ({"cactus_method": "cactus", "cactus_kl_budget": 0.1}, "cactus_kl_budget does not apply"),
        ({"cactus_method": "cactus", "cactus_allocation": "paced"}, "cactus_allocation does not"),
        ({"cactus_method": "ar"}, "cactus_method ar does not apply in vLLM"),
        ({"cactus_foo": 1}, "unknown key cactus_foo; the keys are cactus_method"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message):
        request_spec(extra, None)


def test_a_request_or_the_default_may_verify_blocks() -> None:
    block = request_spec({"cactus_method": "cactus", "cactus_verification": "block"}, None)
    assert (block.method, block.verification) == ("cactus", "block")
    default = default_spec({"cactus_spec": {"method": "sps", "verification": "block"}})
    assert request_spec({"cactus_method": "cactus"}, default).verification == "block"
    assert request_spec({"cactus_method": "tas"}, default).verification == "chain"


def test_a_bad_default_names_the_config_key() -> None:
    with pytest.raises(ValueError, match=r"^additional_config\.cactus_spec\.delta must be"):
        default_spec({"cactus_spec": {"method": "cactus", "delta": "lots"}})
    with pytest.raises(ValueError, match=r"^additional_config\.cactus_spec must be an object"):
        default_spec({"cactus_spec": "cactus"})


def test_rule_targets_replace_only_the_rule_rows_with_h() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(3 * torch.randn(7, 40, generator=gen), -1)  # [T, V]
    p = torch.softmax(torch.randn(7, 40, generator=gen), -1)
    ids = torch.multinomial(p, 1, generator=gen).squeeze(-1).to(torch.int32)
    assert spans([3, 0, 4]) == [(0, 3), (3, 3), (3, 7)]
    targets = rule_targets(q, ids, p, [RuleRow(1, "a", CACTUS, (3, 7), CHAIN)])
    assert torch.equal(targets[:3], q[:3])
    assert torch.equal(targets[3:], CACTUS.rule.h(q[3:], ids[3:].long(), p[3:]))


@pytest.mark.parametrize("spec", [BLOCK, DecodeSpec.of("cactus", delta=1.0, verification="block")])
@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_blocks_judged_on_their_support_draw_what_the_whole_vocabulary_draws(
    spec: DecodeSpec, one_hot_drafts: bool
) -> None:
    """judge_blocks drops the tokens where q is 0 (top-k) and that no draft or bonus names:
    the same tokens as verify_block over all V columns, draw for draw, seeded rows and not."""
    gen = torch.Generator().manual_seed(3)
    rows, n, vocab = 6, 3, 500
    logits = 3 * torch.randn(rows * n, vocab, generator=gen)  # [T, V], then top-k 20
    logits[logits < logits.topk(20, -1).values[:, -1:]] = -torch.inf
    q = logits.softmax(-1)
    p = torch.softmax(torch.randn(rows * n, vocab, generator=gen), -1)  # full support
    ids = torch.multinomial(p, 1, generator=gen).squeeze(-1)  # [T]
    bonus = torch.randint(0, vocab, (rows, 1), generator=gen)
    blocks = [RuleRow(i, str(i), spec, (i * n, i * n + n), Block()) for i in range(rows)]
    seeds = {i: torch.Generator().manual_seed(10 + i) for i in range(0, rows, 2)}  # 0, 2, 4
    draft_probs = None if one_hot_drafts else p
    out = torch.full((rows, n + 1), -1, dtype=torch.int32)
    torch.manual_seed(7)
    judge_blocks(out, blocks, q, ids.int(), draft_probs, bonus, seeds, -1)
    seeds = {i: torch.Generator().manual_seed(10 + i) for i in range(0, rows, 2)}
    torch.manual_seed(7)
    whole = {}
    for group in ([0, 2, 4], [1, 3, 5]):  # judge_blocks's groups: seeded rows, then the rest
        index = torch.tensor(group)
        q_rows = torch.cat(
            [q.view(rows, n, vocab)[index], one_hot(bonus[index, 0], vocab)[:, None]], 1
        )
        p_rows = None if one_hot_drafts else p.view(rows, n, vocab)[index]
        generator = [seeds[i] for i in group] if group[0] in seeds else None
        result = verify_block(ids.view(rows, n)[index], q_rows, p_rows, generator, rule=spec.rule)
        whole.update(zip(group, result.tokens.int(), strict=True))
    assert torch.equal(out, torch.stack([whole[i] for i in range(rows)]))
    assert len({tuple(r.tolist()) for r in out}) > 1  # rows differ: the check can fail


def test_the_meter_counts_kept_drafts_and_exact_kl(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(METER_FILE_ENV, str(tmp_path / "meter.jsonl"))
    gen = torch.Generator().manual_seed(1)
    q = torch.softmax(3 * torch.randn(8, 30, generator=gen), -1)  # [T, V]
    ids = torch.randint(0, 30, (8,), generator=gen)
    meter = Meter()
    # a: 4 drafts, 2 kept then a recovered token; b: 4 drafts all kept plus the bonus token
    meter.record(
        [Chain("a", CACTUS, 0, 4, 3, CHAIN), Chain("b", CACTUS, 4, 4, 5, CHAIN)], q, ids, None
    )
    a, b = meter.finish("a"), meter.finish("b")
    assert (a.drafted, a.accepted, a.positions) == (4, 2, 3)
    assert (b.drafted, b.accepted, b.positions) == (4, 4, 4)
    expected = one_hot_divergences(q, ids, CACTUS.rule)
    assert a.kl_nats == pytest.approx(float(expected[:3].sum()))
    assert b.kl_nats == pytest.approx(float(expected[4:].sum()))
    lines = [json.loads(x) for x in (tmp_path / "meter.jsonl").read_text().splitlines()]
    assert [x["request_id"] for x in lines] == ["a", "b"]
    assert lines[0]["params"] == {"delta": 0.5, "exact": False}
    assert meter.finish("a") is None


def test_the_meter_reads_a_blocks_targets_not_the_chains_law() -> None:
    """A block emits t = kl_target(q, p) at each drafted position: the meter adds KL(t || q)
    over the positions it emitted, handed over by judge_blocks (solved there on the block's
    support), which the chain's law (the per-token h) does not give (the negative control)."""
    gen = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(6, 30, generator=gen)  # [T, V], then top-k 12
    logits[logits < logits.topk(12, -1).values[:, -1:]] = -torch.inf
    q = logits.softmax(-1)
    p = torch.softmax(torch.randn(6, 30, generator=gen), -1)
    ids = torch.multinomial(p, 1, generator=gen).squeeze(-1)
    block = DecodeSpec.of("cactus", delta=0.5, verification="block")
    out = torch.full((1, 7), -1, dtype=torch.int32)
    rows = [RuleRow(0, "b", block, (0, 6), Block())]
    block_kl = judge_blocks(out, rows, q, ids.int(), p, torch.tensor([[ids[0]]]), {}, -1)
    emitted = int((out != -1).sum())
    positions = min(emitted, 6)
    meter = Meter()
    chains = [Chain("b", block, 0, 6, emitted, Block()), Chain("c", CACTUS, 0, 6, emitted, CHAIN)]
    meter.record(chains, q, ids, p, block_kl)
    measured_block, measured_chain = meter.finish("b").kl_nats, meter.finish("c").kl_nats
    expected = kl(kl_target(q, p, 0.5), q)[:positions].sum()  # the whole vocabulary's t
    assert positions > 0 and measured_block == pytest.approx(float(expected), rel=1e-6)
    assert measured_chain == pytest.approx(
        float(step_divergences(p[:positions], q[:positions], CACTUS.rule).sum())
    )
    assert measured_block != pytest.approx(measured_chain, rel=1e-3)
    with pytest.raises(ValueError, match="block_kl must hold the divergences"):
        meter.record(chains[:1], q, ids, p)


def test_the_engine_and_the_plugin_meter_one_hot_drafts_alike_at_any_vocabulary() -> None:
    """One meter: an n-gram chain's KL in the engine (``Verification.divergence``, one row)
    equals the plugin's (``Meter.record``), exact on a vocabulary wider than the audit's
    support limit; the per-step audit on the same one-hot rows cannot measure it (the
    control: NaN)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(5, 6000, generator=gen), -1)  # [T, V], no top-k
    ids = torch.randint(0, 6000, (5,), generator=gen)
    engine = CHAIN.divergence(CACTUS.rule, Draft(ids.tolist(), None), q, q, [], 4)  # 4 emitted
    meter = Meter()
    meter.record([Chain("n", CACTUS, 0, 5, 4, CHAIN)], q, ids, None)
    assert torch.isfinite(engine).all() and engine.shape == (4,)
    assert meter.finish("n").kl_nats == pytest.approx(float(engine.sum()), rel=1e-9)
    assert float(engine.sum()) > 0
    control = step_divergences(one_hot(ids[:4], 6000), q[:4], CACTUS.rule)
    assert torch.isnan(control).all()


def test_a_lossless_rule_spends_nothing() -> None:
    q = torch.softmax(torch.randn(4, 10), -1)
    meter = Meter()
    meter.record([Chain("s", DecodeSpec.of("sps"), 0, 4, 2, CHAIN)], q, torch.zeros(4).long(), None)
    assert meter.finish("s").kl_nats == 0.0


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_an_unsupported_vllm_is_refused_by_name(version: str) -> None:
    with pytest.raises(RuntimeError, match=f"supports vLLM 0.32 up to .* found {version}"):
        check_version(version)
    check_version("0.32.0")
    check_version("0.33.1rc1")


def test_a_missing_patch_target_is_named_and_nothing_is_patched() -> None:
    assert resolve("json", "JSONDecoder.decode") is json.JSONDecoder.decode
    with pytest.raises(RuntimeError, match=r"cannot find json\.JSONDecoder\.nope .* nothing"):
        resolve_all((("json", "loads"), ("json", "JSONDecoder.nope")))
    with pytest.raises(RuntimeError, match=r"cannot find no_such_module\.x"):
        resolve("no_such_module", "x")


def _normalising_kernel_law(p: torch.Tensor, q: torch.Tensor, target) -> torch.Tensor:
    """The exact law MRV2's kernels emit for one draft n ~ p [V] when handed target(n) [V]:
    they normalise it to t, accept n with min(1, t_n / p_n) and redraw from
    normalize(max(0, t - p)) -> [V] float64."""
    law = torch.zeros(q.shape[-1], dtype=torch.float64)
    for n in range(q.shape[-1]):
        t = target(n).double()
        t = t / t.sum()
        accept = min(1.0, float(t[n] / p[n]))
        excess = (t - p.double()).clamp(min=0)
        if excess.sum() == 0:  # rejection impossible; accept < 1 only by rounding
            accept = 1.0
        law[n] += p[n] * accept
        if accept < 1:
            law += p[n] * (1 - accept) * excess / excess.sum()
    return law


RULE_SPECS = [
    CACTUS,
    DecodeSpec.of("tas", epsilon=0.3, alpha=0.6),
    DecodeSpec.of("interp", alpha=0.4),
    DecodeSpec.of("topk", k=2),
    DecodeSpec.of("topk", k=3),
]


@pytest.mark.parametrize("spec", RULE_SPECS, ids=lambda s: f"{s.method}{dict(s.params)}")
def test_mrv2_targets_keep_each_rules_exact_law(spec) -> None:
    """A kernel target made a distribution (``as_distribution``) gives, in kernels that
    normalise what they are handed, the rule's exact step law; TopK's indicator handed as it
    is does not (the negative control)."""
    from cactus_spec.core.audit import step_law
    from cactus_spec.integrations.vllm.sampler_v2 import as_distribution

    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(1.5 * torch.randn(7, generator=gen), -1)
    q = torch.softmax(3 * torch.randn(7, generator=gen), -1)

    def raw(n: int) -> torch.Tensor:
        rows = [RuleRow(0, "a", spec, (0, 1), CHAIN)]
        return rule_targets(q[None], torch.tensor([n]), p[None], rows)[0]

    def made(n: int) -> torch.Tensor:
        return as_distribution(raw(n)[None], p[None])[0]

    law = step_law(p, q, spec.rule)
    assert torch.allclose(_normalising_kernel_law(p, q, made), law, atol=1e-6)
    if spec.method == "topk":
        assert not torch.allclose(_normalising_kernel_law(p, q, raw), law, atol=1e-3)
