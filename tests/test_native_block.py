"""A block of native layers run as one native call (``NativeBlock``) computes what the Python block
computes on the same layers: for int8 and int4 layers the same logits up to float rounding, for
native bfloat16 layers logits at least as close to the float32 model's as the Python block's (which
rounds to bfloat16 after every operation, the native block only at its ends and at its products'
inputs); on one row and on a batch of rows of different lengths, for Llama and for Qwen2 (q/k/v
biases), and it writes the same keys and values into the cache."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_lm
from test_lean import make_tiny_qwen2

from cactus_spec.backends import native
from cactus_spec.backends.lean import Block, LeanBackend, LeanModel
from cactus_spec.backends.native_block import NativeBlock
from cactus_spec.backends.packed import NativeBf16Linear
from cactus_spec.backends.quant import quantize
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import LoadedModel

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native kernels could not be built here"
)

MODELS = {"llama": make_tiny_lm, "qwen2": make_tiny_qwen2}
KINDS = [
    "int8",
    "int4",
    pytest.param(
        "bf16",
        marks=pytest.mark.skipif(not NativeBf16Linear.available(), reason="no native bf16 here"),
    ),
]
#: Largest |fused - python| / max |python| of the logits. int8, int4: float sums in another order
#: may move an activation code by one step. bf16: the Python block's roundings after every
#: operation (the float32 model is the reference, see _check).
TOLERANCE = {"int8": 1e-4, "int4": 1e-4, "bf16": 2e-2}


def _fused_and_python(arch: str, kind: str, monkeypatch, seed: int = 0):
    """The model of ``kind`` with native blocks, with Python blocks, and in float32."""
    reference = MODELS[arch](seed=seed)
    quantised = kind in ("int8", "int4")
    model = quantize(copy.deepcopy(reference), kind) if quantised else reference.bfloat16()
    fused = LeanModel(model)
    with monkeypatch.context() as patch:
        patch.setattr(NativeBlock, "kind", staticmethod(lambda layer: None))
        python = LeanModel(model)
    assert all(isinstance(b, NativeBlock) for b in fused.blocks)
    assert all(isinstance(b, Block) for b in python.blocks)
    return fused, python, LeanModel(MODELS[arch](seed=seed))


def _gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def _check(kind: str, got, expected, exact) -> None:
    """got (native) within the kind's tolerance of expected (Python), and for bf16 no
    further from the float32 logits ``exact`` than the Python block is."""
    assert _gap(got, expected) < TOLERANCE[kind]
    if kind == "bf16":
        assert _gap(got, exact) <= 1.5 * _gap(expected, exact)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", MODELS)
def test_one_row_prefill_then_steps_gives_the_python_logits(arch, kind, monkeypatch) -> None:
    models = _fused_and_python(arch, kind, monkeypatch)
    fused, python, exact = (LeanBackend(m) for m in models)
    for block in ([3, 17, 42, 8, 99, 1, 5], [6], [7, 8], [9]):
        _check(kind, fused.append(block), python.append(block), exact.append(block))
    keys, values = fused.cache.layer(1)
    expected_keys, expected_values = python.cache.layer(1)
    assert _gap(keys, expected_keys) < TOLERANCE[kind]
    assert _gap(values, expected_values) < TOLERANCE[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", MODELS)
def test_rows_of_different_lengths_each_get_the_python_logits(arch, kind, monkeypatch) -> None:
    models = _fused_and_python(arch, kind, monkeypatch)
    fused, python, exact = (LeanBackend(m, batch=3) for m in models)
    prompts = [[3, 17, 42], [5, 6, 7, 8, 9, 10], [11]]
    steps = [[1, 2], [4], [12, 13, 14]]
    for backend in (fused, python, exact):
        backend.append_ragged(prompts, [0, 1, 2])
    got, expected, reference = (b.append_ragged(steps, [2, 0, 1]) for b in (fused, python, exact))
    for a, b, c in zip(got, expected, reference, strict=True):
        _check(kind, a, b, c)


@pytest.mark.parametrize("kind", KINDS)
def test_control_another_model_is_far_beyond_the_tolerance(kind, monkeypatch) -> None:
    fused, _, _ = _fused_and_python("llama", kind, monkeypatch)
    _, other, _ = _fused_and_python("llama", kind, monkeypatch, seed=1)
    block = [3, 17, 42, 8]
    assert _gap(LeanBackend(fused).append(block), LeanBackend(other).append(block)) > 0.1


def _check_long(kind: str, got, expected, exact) -> None:
    """``_check`` for a long feed of a quantised kind: with more tokens, more activations meet
    a code boundary that float rounding moves them across (about 1e-3 of the logits each, and
    carried to later positions through the cache), so every position within a few such steps
    (the control's other tokens move them by 0.1 to 0.8)."""
    if kind == "bf16":
        return _check(kind, got, expected, exact)
    gaps = (got.float() - expected.float()).abs().amax(-1) / expected.float().abs().max()  # [T]
    assert float(gaps.max()) < 2e-2, gaps


def _long_feeds(arch: str, kind: str, monkeypatch, swap: bool = False) -> None:
    """Two rows read feeds of 70 and 45 tokens, then 50 and 33 more: the native and Python
    blocks' logits of each (``swap``: the Python side reads each feed's first two tokens
    swapped, the control)."""
    models = _fused_and_python(arch, kind, monkeypatch)
    fused, python, exact = (LeanBackend(m, batch=2) for m in models)
    g = torch.Generator().manual_seed(0)
    for lengths in ((70, 45), (50, 33)):
        feeds = [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]
        other = [[f[1], f[0], *f[2:]] for f in feeds] if swap else feeds
        outs = (
            fused.append_ragged(feeds, [0, 1]),
            *(b.append_ragged(other, [0, 1]) for b in (python, exact)),
        )
        for got, expected, reference in zip(*outs, strict=True):
            _check_long(kind, got, expected, reference)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", MODELS)
def test_long_feeds_attend_in_blocks_as_the_python_block_does(arch, kind, monkeypatch) -> None:
    """Feeds of more than 32 tokens a row take the blocked attention: from slot 0 (causal as
    the kernel means it), after cached slots (a mask), on rows of different lengths."""
    _long_feeds(arch, kind, monkeypatch)


def test_control_long_feeds_of_other_tokens_fail_the_check(monkeypatch) -> None:
    with pytest.raises(AssertionError):
        _long_feeds("llama", "int8", monkeypatch, swap=True)


def _chunked(backend: LeanBackend, prompt: list[int], size: int, shift: bool = False):
    """The logits after ``prompt`` read ``size`` tokens a forward from an empty row, and the
    row's keys (``shift``: the control, the first chunk's last token fed twice)."""
    backend.reset(0)
    for first in range(0, len(prompt) - 1, size):
        backend.append(prompt[first : min(first + size, len(prompt) - 1)])
        if shift and first == 0:
            backend.append([prompt[size - 1]])
    keys, _ = backend.cache.layer(1)
    return backend.append(prompt[-1:]), keys[0, :, : len(prompt) - 1].clone()


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_read_in_chunks_is_the_prompt_read_whole(kind, monkeypatch) -> None:
    """Chunks of 40, 17 and 1 tokens (blocked attention after cached slots, and query by
    query) leave the keys and give the logits of the whole read; the shifted read fails."""
    fused = LeanBackend(_fused_and_python("qwen2", kind, monkeypatch)[0])
    prompt = torch.randint(0, 100, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = _chunked(fused, prompt, len(prompt))
    for size in (40, 17, 1):
        got = _chunked(fused, prompt, size)
        assert all(_gap(a, b) < 2e-2 for a, b in zip(got, whole, strict=True)), size
    shifted = _chunked(fused, prompt, 17, shift=True)
    assert not all(_gap(a, b) < 2e-2 for a, b in zip(shifted, whole, strict=True))


def _keys_after(model, steps: list[list[int]], dtype=None) -> list[torch.Tensor]:
    """Every layer's cached keys (a cache in ``dtype``; None: the model's) after a prompt and
    then ``steps`` fed one call each."""
    backend = LeanBackend(model, cache_dtype=dtype)
    backend.append([3, 17, 42, 8, 99])
    for step in steps:
        backend.append(step)
    return [backend.cache.layer(layer)[0].clone() for layer in range(len(model.blocks))]


def _one_call_is_steps(model, tokens: list[int], dtype=None) -> bool:
    """Whether reading ``tokens`` in one call leaves the bits of reading them one at a time."""
    together = _keys_after(model, [tokens], dtype)
    alone = _keys_after(model, [[t] for t in tokens], dtype)
    return all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_a_chains_verification_has_the_bits_of_its_decode_steps(kind, monkeypatch) -> None:
    """Eleven tokens in one call (a chain's verification at K = 10) leave every layer's keys
    with the bits that eleven decode steps leave: each row's products and each query's
    attention are computed as they would be alone, so a lossless rule verifies with the q that
    plain decoding samples from. Control: a feed of 40 tokens (attention blocked in bfloat16)
    does not."""
    fused = _fused_and_python("qwen2", kind, monkeypatch)[0]
    assert _one_call_is_steps(fused, list(range(20, 31)))
    assert not _one_call_is_steps(fused, list(range(20, 60)))


def _head_dim_64(seed: int = 0):
    """A tiny Llama whose heads are 64 wide (a draft's: attention's 16-lane paths)."""
    return make_tiny_lm(seed=seed, heads=2, head_dim=64)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("make", [make_tiny_lm, _head_dim_64], ids=["head16", "head64"])
def test_a_bfloat16_cache_holds_and_reads_the_float32_caches_entries_rounded(kind, make) -> None:
    """A native model's cache in bfloat16 (a draft's): layer 0's keys and values (before any
    attention) are the float32 cache's rounded, and the logits after a prompt and steps lie
    within bfloat16's rounding of the float32 cache's (a model with another seed: far)."""
    model = LeanModel(quantize(make(seed=0), kind))
    compact = LeanBackend(model, batch=2, cache_dtype=torch.bfloat16)
    full, other = LeanBackend(model, batch=2), LeanBackend(LeanModel(quantize(make(seed=1), kind)))
    assert compact.cache.keys.dtype == torch.bfloat16
    prompt = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for feed in (prompt[:9], prompt[9:], [5], [6, 7, 8]):
        got, expected = compact.append(feed, row=1), full.append(feed, row=1)
        assert _gap(got, expected) < 2e-2
        assert _gap(other.append(feed), expected) > 0.1
    for got, expected in zip(compact.cache.layer(0), full.cache.layer(0), strict=True):
        assert torch.equal(got[1, :, :44], expected[1, :, :44].bfloat16())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_on_a_bfloat16_cache_a_chains_verification_has_its_decode_steps_bits(kind) -> None:
    """As on the model's own cache: eleven tokens in one call leave the bits of eleven
    steps (control: 40 tokens, attention blocked, do not)."""
    model = LeanModel(quantize(make_tiny_qwen2(), kind))
    assert _one_call_is_steps(model, list(range(20, 31)), torch.bfloat16)
    assert not _one_call_is_steps(model, list(range(20, 60)), torch.bfloat16)


def test_a_cache_in_another_dtype_needs_native_blocks(monkeypatch) -> None:
    _, python, _ = _fused_and_python("llama", "int8", monkeypatch)
    with pytest.raises(ValueError, match="needs native blocks"):
        LeanBackend(python, cache_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("quant", "draft", "dtype"),
    [
        ("int8", True, torch.bfloat16),
        ("int4", True, torch.bfloat16),
        ("int8", False, torch.float32),
        (None, True, torch.float32),
    ],  # fmt: skip
)
def test_a_drafts_native_cache_is_bfloat16_a_verifiers_the_models(quant, draft, dtype) -> None:
    """``make_backend``: a draft model of native blocks caches in bfloat16; a verifier, and a
    draft of Python blocks (float32 layers), in the model's dtype."""
    model = make_tiny_lm() if quant is None else quantize(make_tiny_lm(), quant)
    backend = make_backend(LoadedModel(model, None, "t", None), "lean", draft=draft)
    assert backend.cache.keys.dtype == dtype


def _stacked_and_looped(kind: str) -> tuple[LeanBackend, LeanBackend]:
    """Backends of 3 rows over one native model of ``kind``: its blocks in one call (the stack),
    and one call per block."""
    reference = make_tiny_qwen2(seed=0)
    model = quantize(reference, kind) if kind in ("int8", "int4") else reference.bfloat16()
    stacked, looped = LeanModel(model), LeanModel(model)
    assert stacked.stack is not None
    looped.stack = None
    return LeanBackend(stacked, batch=3), LeanBackend(looped, batch=3)


@pytest.mark.parametrize("kind", KINDS)
def test_the_stack_computes_the_blocks_one_call_each_bit_for_bit(kind) -> None:
    stacked, looped = _stacked_and_looped(kind)
    feeds = [  # ragged prompts; one-token steps; then token trees (a masked feed)
        lambda b, swap=False: b.append_ragged([[3, 17, 42], [5, 6, 7, 8, 9, 10], [11]], [0, 1, 2]),
        lambda b, swap=False: b.append_ragged([[1], [4], [12]], [2, 0, 1]),
        lambda b, swap=False: b.append_tree([[5, 6, 7], [9]], [[-1, 0, 0], [-1]], [0, 2]),
        lambda b, swap=False: b.append_ragged([[2, 8] if swap else [8, 2], [13, 14]], [1, 0]),
    ]
    for feed in feeds:
        for got, expected in zip(feed(stacked), feed(looped), strict=True):
            assert torch.equal(got, expected)
    for layer in range(len(stacked.model.blocks)):
        pairs = zip(stacked.cache.layer(layer), looped.cache.layer(layer), strict=True)
        assert all(torch.equal(got, expected) for got, expected in pairs)
    # the control: the same comparison tells two tokens read in another order apart
    stacked, looped = _stacked_and_looped(kind)
    for feed in feeds[:-1]:
        feed(stacked), feed(looped)
    assert not torch.equal(feeds[-1](stacked)[0], feeds[-1](looped, swap=True)[0])
