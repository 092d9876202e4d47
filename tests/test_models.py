"""Tests for model loading, vocabulary checks and the transformers backend."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_lm
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from cactus_spec.backends.hf import TransformersBackend
from cactus_spec.loading.models import (
    FETCH_HINT,
    LoadedModel,
    ModelNotFoundError,
    VocabularyMismatchError,
    check_same_vocabulary,
    load_model,
    resolve_dtype,
)


def _word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(words)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=words[0])))


def _loaded(vocab_size: int, tokenizer: PreTrainedTokenizerFast | None = None) -> LoadedModel:
    return LoadedModel(make_tiny_lm(vocab_size=vocab_size), tokenizer, "tiny", None)


def test_append_returns_float32_logits_per_new_token(tiny_lm):
    backend = TransformersBackend(tiny_lm)
    logits = backend.append([1, 2, 3, 4])
    assert logits.shape == (4, 128) and logits.dtype == torch.float32
    assert backend.append(torch.tensor([5])).shape == (1, 128)
    assert backend.length_of(0) == 5
    assert backend.vocab_size == 128 and backend.context_length == 256


def test_rollback_matches_fresh_forward(tiny_lm):
    prompt = [3, 17, 42, 8, 99, 1]
    backend = TransformersBackend(tiny_lm)
    backend.append(prompt)
    first = backend.append([5, 6, 7, 8, 9])  # [5, V]
    backend.rollback(len(prompt) + 2)
    after = backend.append([70, 71, 72])  # [3, V]

    fresh = TransformersBackend(tiny_lm)
    expected = fresh.append([*prompt, 5, 6, 70, 71, 72])  # [T, V]
    torch.testing.assert_close(after, expected[-3:], atol=1e-5, rtol=0)
    kept = slice(len(prompt), len(prompt) + 2)
    torch.testing.assert_close(first[:2], expected[kept], atol=1e-5, rtol=0)
    assert backend.length_of(0) == len(prompt) + 5


def test_reset_and_bad_rollback(tiny_lm):
    backend = TransformersBackend(tiny_lm)
    expected = backend.append([1, 2, 3])
    with pytest.raises(ValueError, match="rollback length"):
        backend.rollback(4)
    backend.reset()
    assert backend.length_of(0) == 0
    torch.testing.assert_close(backend.append([1, 2, 3]), expected, atol=1e-5, rtol=0)


def test_vocabulary_mismatch_names_both_sizes():
    with pytest.raises(VocabularyMismatchError, match=r"128.*96"):
        check_same_vocabulary(_loaded(128), _loaded(96))


def test_vocabulary_uses_tokenizer_size_and_allows_padded_rows():
    words = [f"w{i}" for i in range(100)]
    target, draft = _loaded(128, _word_tokenizer(words)), _loaded(112, _word_tokenizer(words))
    assert check_same_vocabulary(target, draft) == 100


def test_vocabulary_same_size_different_ids_raises():
    words = [f"w{i}" for i in range(100)]
    target = _loaded(128, _word_tokenizer(words))
    draft = _loaded(128, _word_tokenizer(words[::-1]))
    with pytest.raises(VocabularyMismatchError, match="different ids"):
        check_same_vocabulary(target, draft)


def test_resolve_dtype():
    assert resolve_dtype("fp32") is torch.float32
    assert resolve_dtype("BF16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype(None) in (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match=r"dtype must be one of .*float32.*'int8'"):
        resolve_dtype("int8")


@pytest.mark.parametrize("source", ["/no/such/dir", "missing-model.gguf", "./nope"])
def test_missing_path_raises_with_fetch_hint(source):
    with pytest.raises(ModelNotFoundError, match=FETCH_HINT):
        load_model(source)


def test_load_model_object_and_local_directory(tmp_path):
    model = make_tiny_lm()
    loaded = load_model(model)
    assert loaded.model is model and loaded.tokenizer is None and loaded.sha256 is None
    assert loaded.model.dtype == torch.float32  # a model object keeps its dtype by default

    model.save_pretrained(tmp_path)
    reloaded = load_model(tmp_path, dtype="float32")
    assert reloaded.identity == str(tmp_path) and reloaded.tokenizer is None
    ids = [4, 5, 6]
    torch.testing.assert_close(
        TransformersBackend(reloaded.model).append(ids), TransformersBackend(model).append(ids)
    )


@pytest.mark.slow
def test_smollm2_fetch_load_and_greedy():
    from cactus_spec.loading.catalog import REGISTRY
    from cactus_spec.loading.fetch import fetch

    path = fetch("smollm2-135m")
    loaded = load_model(path, dtype="float32")
    assert loaded.sha256 == REGISTRY["smollm2-135m"].sha256
    assert loaded.model.dtype == torch.float32
    vocab = check_same_vocabulary(loaded, loaded)
    assert vocab == len(loaded.tokenizer) == 49152

    backend = TransformersBackend(loaded.model)
    logits = backend.append(loaded.tokenizer.encode("The capital of France is"))  # [T, V]
    assert logits.shape[-1] == backend.vocab_size and torch.isfinite(logits).all()
    assert "Paris" in loaded.tokenizer.decode([int(logits[-1].argmax())])
