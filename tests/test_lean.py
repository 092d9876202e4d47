"""The lean backend gives transformers' logits, rolls back exactly, batches rows of different
lengths exactly, and an int8 draft keeps SpS exact."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_lm, spec_of
from test_engine import (
    PROMPT,
    chi_square_p_value,
    exact_pair_law,
    noisy_copy,
    reference_greedy,
    sampled_pairs,
)
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from cactus_spec.backends.hf import TransformersBackend
from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.backends.native_block import NativeBlock
from cactus_spec.backends.quant import quantize
from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.runtime.engine import SpeculativeDecoder

FP32_TOLERANCE = 1e-4


def make_tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """A float32 Qwen2 with random weights and non-zero q/k/v biases."""
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    return model.float().eval()


MODELS = {"llama": make_tiny_lm, "qwen2": make_tiny_qwen2}


@pytest.mark.parametrize("arch", MODELS)
def test_logits_equal_transformers_in_float32(arch: str) -> None:
    model = MODELS[arch]()
    hf, lean = TransformersBackend(model), LeanBackend(LeanModel(model))
    for block in ([3, 17, 42, 8, 99, 1], [5], [6, 7, 8, 9]):
        expected, got = hf.append(block), lean.append(block)  # [T, V]
        assert (got - expected).abs().max() <= FP32_TOLERANCE
    assert lean.length_of(0) == hf.length_of(0) == 11


@pytest.mark.parametrize("arch", MODELS)
def test_rollback_then_append_equals_a_fresh_forward(arch: str) -> None:
    model = MODELS[arch]()
    backend = LeanBackend(LeanModel(model))
    backend.append([3, 17, 42, 8, 99, 1])
    backend.append([5, 6, 7, 8, 9])
    backend.rollback(8)
    after = backend.append([70, 71, 72])  # [3, V]
    fresh = LeanBackend(LeanModel(model)).append([3, 17, 42, 8, 99, 1, 5, 6, 70, 71, 72])
    assert (after - fresh[-3:]).abs().max() <= FP32_TOLERANCE


@pytest.mark.parametrize("arch", MODELS)
def test_rows_of_different_lengths_get_their_own_logits(arch: str) -> None:
    model = MODELS[arch]()
    prompts = [[3, 17], [42, 8, 99, 1], [5, 6, 7, 8, 9, 10]]
    block = torch.tensor([[20, 21, 22], [30, 31, 32], [40, 41, 42]])  # [B, T]
    batched = LeanBackend(LeanModel(model), batch=3)
    padded = torch.tensor([p + [0] * (6 - len(p)) for p in prompts])  # [B, 6]
    batched.append_ragged(padded.tolist(), [0, 1, 2])
    for row, prompt in enumerate(prompts):
        batched.rollback(len(prompt), row)
    together = batched.append_ragged(block.tolist(), [0, 1, 2])  # B x [T, V]
    for row, prompt in enumerate(prompts):
        alone = LeanBackend(LeanModel(model))
        alone.append(prompt)
        assert (together[row] - alone.append(block[row])).abs().max() <= FP32_TOLERANCE
    assert batched.cache.lengths.tolist() == [5, 7, 9]


def test_negative_control_a_row_without_its_rollback_differs() -> None:
    model = make_tiny_lm()
    batched = LeanBackend(LeanModel(model), batch=2)
    batched.append_ragged([[3, 17, 0], [42, 8, 99]], [0, 1])
    together = batched.append_ragged([[20, 21], [30, 31]], [0, 1])  # row 0 keeps its 0
    alone = LeanBackend(LeanModel(model))
    alone.append([3, 17])
    assert (together[0] - alone.append([20, 21])).abs().max() > 1e-2


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_sps_on_the_lean_backend_equals_the_verifier(k: int) -> None:
    target = make_tiny_qwen2()
    draft = noisy_copy(make_tiny_lm(), 0.0, 0)  # a different model: many rejections
    draft.config.vocab_size = 128
    for backend in ("lean", "hf"):
        result = SpeculativeDecoder(target, draft, spec_of(SpS(), k), backend=backend).generate(
            PROMPT, 30, temperature=0
        )
        assert result.token_ids == reference_greedy(target, PROMPT, 30), backend


def test_backend_choice() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    loaded = LoadedModel(gpt2, None, "gpt2", None)
    assert isinstance(make_backend(loaded), TransformersBackend)
    with pytest.raises(ValueError, match="backend lean does not support architecture 'gpt2'"):
        make_backend(loaded, "lean")
    with pytest.raises(ValueError, match="backend must be one of auto, lean, hf"):
        make_backend(loaded, "fast")
    assert isinstance(make_backend(LoadedModel(make_tiny_lm(), None, "t", None)), LeanBackend)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantised_draft_keeps_sps_exact_in_law(quant) -> None:
    """The joint law of the first two tokens with an int8 or int4 draft is the verifier's
    exact law; the same test rejects Cactus(5) with that draft (negative control)."""
    target = make_tiny_lm(vocab_size=32, seed=6)
    draft = quantize(noisy_copy(target, 1.0, seed=7), quant)
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
    prompt, runs = [5, 17, 3, 19, 11], 1200
    law = exact_pair_law(target, prompt, sampling)
    sps = SpeculativeDecoder(target, draft, spec_of(SpS(), 2))
    cactus = SpeculativeDecoder(target, draft, spec_of(Cactus(5.0), 2))
    assert chi_square_p_value(sampled_pairs(sps, prompt, runs, sampling), law, runs) > 1e-3
    assert chi_square_p_value(sampled_pairs(cactus, prompt, runs, sampling), law, runs) < 1e-6


def _kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position [T] in nats, from logits [T, V]."""
    log_p, log_q = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@pytest.mark.slow
def test_smollm2_bf16_lean_agrees_with_transformers_on_real_text(monkeypatch) -> None:
    """The lean model's Python blocks compute what transformers computes on the same bf16
    layers (exactly enough: KL <= 1e-3 at every position); the lean model as built (native
    blocks where the CPU has AMX or AVX512-BF16, which compute in float32 between their
    products) is at least as faithful to float32 as stock transformers, and against stock
    transformers it stays within issue 8's bound (argmax on >= 99% of positions, KL <= 1e-3
    nats per position on average) or, with native blocks, within the sum of both models' own
    distances to float32 (each rounds differently: 0.0007 and 0.0004 here), its argmax off
    stock's on at most 1% of positions beyond those where stock's own is off float32's
    (AVX512-BF16's blocks: 3 of 252, 2 of them stock's, near-ties of float32). Packed and stock
    bf16 products differ only in the last bits (oneDNN's: bit-identical for blocks of up to 32
    rows)."""
    from cactus_spec.loading.fetch import fetch

    loaded = load_model(fetch("smollm2-135m"), dtype="bfloat16")
    text = (
        "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"
        "    pivot = items[0]\n    smaller = [x for x in items[1:] if x < pivot]\n"
        "    larger = [x for x in items[1:] if x >= pivot]\n"
        "    return quicksort(smaller) + [pivot] + quicksort(larger)\n"
    ) * 3
    ids = loaded.tokenizer(text).input_ids
    stock = TransformersBackend(loaded.model).append(ids)  # [T, V], torch's bf16 linears
    built = LeanModel(loaded.model)  # repacks the model's linears
    lean = LeanBackend(built).append(ids)
    monkeypatch.setattr(NativeBlock, "kind", staticmethod(lambda layer: None))
    python_blocks = LeanBackend(LeanModel(loaded.model)).append(ids)
    same_layers = TransformersBackend(loaded.model).append(ids)  # transformers, repacked
    assert _agreement(python_blocks, same_layers) >= 0.99
    assert _kl(python_blocks, same_layers).max() <= 1e-3
    reference = TransformersBackend(load_model(loaded.identity, dtype="float32").model)
    exact = reference.append(ids)  # [T, V] float32
    assert _agreement(lean, exact) >= _agreement(stock, exact) - 0.01
    assert _kl(lean, exact).mean() <= 1.5 * _kl(stock, exact).mean() + 1e-4
    bound, agreed = 1e-3, 0.99
    if any(isinstance(block, NativeBlock) for block in built.blocks):
        bound = max(bound, float(_kl(stock, exact).mean() + _kl(lean, exact).mean()) + 1e-4)
        agreed -= 1 - _agreement(stock, exact)  # where stock's own argmax is off float32's
    assert _agreement(lean, stock) >= agreed and _kl(lean, stock).mean() <= bound
