"""Shared test fixtures: tiny seeded random-weight language models."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS, METHODS
from cactus_spec.core.rules import Rule
from cactus_spec.core.spec import DecodeSpec, parse_spec
from cactus_spec.loading.models import LoadedModel, load_model

#: Autoregressive decoding: the verifier alone.
AR = DecodeSpec.of("ar")


def need_llama_cpp() -> None:
    """Skip the calling test unless llama-cpp-python (the ggml backend's library) imports;
    under ``CACTUS_SPEC_REQUIRE_GGML`` (set by ``make test``, which builds it), fail instead."""
    if os.environ.get("CACTUS_SPEC_REQUIRE_GGML"):
        importlib.import_module("llama_cpp")
    else:
        pytest.importorskip("llama_cpp", reason="the ggml backend needs llama-cpp-python")


def spec_of(
    rule: Rule | None, k: int | None = DEFAULT_NUM_DRAFT_TOKENS, drafter: str = "model"
) -> DecodeSpec:
    """The spec of a rule object (None: ar) with K and the drafter, through the registry."""
    if rule is None:
        return AR
    (method,) = [m.name for m in METHODS.values() if m.rule is type(rule)]
    params = {name: getattr(rule, name) for name in METHODS[method].defaults}
    given = {"method": method, **params, "drafter": drafter}
    spec = parse_spec({**given, "num_draft_tokens": 1 if k is None else k})
    return spec if k is not None else spec.with_num_draft_tokens(None)


LM_HEAD_STD = 0.5  # large enough that next-token distributions are peaky, not near-uniform


def make_tiny_lm(
    vocab_size: int = 128, seed: int = 0, num_layers: int = 2, heads: int = 4, head_dim: int = 16
) -> LlamaForCausalLM:
    """A float32 Llama of ``heads`` heads of ``head_dim`` (hidden size 64 by default), half as
    many key/value heads, and random weights fixed by `seed`, in eval mode."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=heads * head_dim,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        torch.nn.init.normal_(model.lm_head.weight, std=LM_HEAD_STD)
    return model.float().eval()


@pytest.fixture
def tiny_lm() -> LlamaForCausalLM:
    """The default tiny model (vocabulary 128, seed 0)."""
    return make_tiny_lm()


@pytest.fixture(scope="module")
def models() -> tuple[LoadedModel, LoadedModel]:
    """A tiny verifier and a tiny one-layer draft, loaded as the bench loads models."""
    return load_model(make_tiny_lm(seed=0)), load_model(make_tiny_lm(seed=1, num_layers=1))


@pytest.fixture
def prompts(tmp_path) -> Path:
    """A prompt file of four token-id prompts of 3 to 6 tokens."""
    path = tmp_path / "prompts.jsonl"
    base = [5, 17, 3, 99, 42, 7, 17, 3]
    path.write_text("".join(json.dumps({"prompt": base[: 3 + i]}) + "\n" for i in range(4)))
    return path
