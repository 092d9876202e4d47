"""A truncated draft head (the most frequent tokens): its logits are the full head's at its
ids, its drafts stay inside it, and SpS keeps the verifier's law exactly."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import AR, make_tiny_lm, spec_of
from test_engine import chi_square_p_value, exact_pair_law, noisy_copy, sampled_pairs
from test_smollm import assert_same_greedy_tokens

from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.core.rules import SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading import head_vocab
from cactus_spec.loading.head_vocab import head_tokens, restrict_head
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.runtime.drafters import DraftRequest, ModelDrafter
from cactus_spec.runtime.engine import SpeculativeDecoder


@pytest.fixture(scope="module")
def smollm_path():
    from cactus_spec.loading.fetch import fetch

    return fetch("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return load_model(smollm_path, dtype="float32").tokenizer


def test_kept_ids_are_the_most_frequent_plus_every_special_token(tokenizer) -> None:
    ids = head_tokens(tokenizer, 2048, 49152)
    assert torch.equal(ids, ids.unique())  # ascending, no repeats
    kept = set(ids.tolist())
    assert set(tokenizer.all_special_ids) <= kept
    assert set(head_vocab.ranked_tokens(tokenizer)[:2048]) <= kept
    assert 2048 <= len(kept) <= 2048 + len(tokenizer.get_added_vocab())
    code = tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    assert set(code) <= kept  # common Python is inside a 2,048-token head
    with pytest.raises(ValueError, match="draft_vocab must be an integer >= 1, got 0"):
        head_tokens(tokenizer, 0, 49152)


def test_the_ranking_is_cached_and_a_damaged_entry_rebuilt(
    tokenizer, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("CACTUS_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(head_vocab, "_CORPUS_CHARS", 200_000)
    first = head_vocab.ranked_tokens(tokenizer)
    assert sorted(first) == list(range(len(tokenizer)))  # every token, once
    (entry,) = (tmp_path / "head-vocab").iterdir()
    assert json.loads(entry.read_text())["ranked"] == first
    entry.write_text("{not json")
    assert head_vocab.ranked_tokens(tokenizer) == first


def test_truncated_head_logits_are_the_full_heads_at_its_ids(smollm_path, tokenizer) -> None:
    full = load_model(smollm_path, dtype="float32")
    cut = load_model(smollm_path, dtype="float32", head_vocab=1024)
    ids = cut.head_tokens
    tokens = tokenizer("print('hello world')")["input_ids"]
    whole = LeanBackend(LeanModel(full.model)).append(tokens)  # [T, V]
    part = LeanBackend(LeanModel(cut.model)).append(tokens)  # [T, N]
    assert part.shape == (len(tokens), len(ids))
    # the same products summed in another order (oneDNN blocks a 1,024-row head differently
    # from the whole one on an AMX Xeon): equal within a few float32 roundings of the row's
    # scale, not bit for bit
    eps = torch.finfo(torch.float32).eps
    scale = 32 * eps * whole.abs().amax(dim=-1, keepdim=True)  # [T, 1]
    assert bool(((part - whole[:, ids]).abs() <= scale).all())
    # the control: the head's neighbouring ids are other logits, far outside that tolerance
    assert not bool(((part - whole[:, ids.roll(1)]).abs() <= scale).all())
    # the embedding stays whole: a tied head is copied, not cut
    assert cut.model.get_input_embeddings().weight.shape[0] == 49152


def _tiny_pair(kept: int, ids: torch.Tensor | None = None):
    """A tiny verifier, and a noisy copy drafting through a head of its first ``kept`` ids
    (or of ``ids``)."""
    target = make_tiny_lm(vocab_size=32, seed=6)
    draft = noisy_copy(target, 1.0, seed=7)
    ids = torch.arange(kept) if ids is None else ids
    restrict_head(draft, ids)
    return target, LoadedModel(draft, None, "tiny-draft", None, head_tokens=ids)


def test_drafts_stay_inside_the_head() -> None:
    _, draft = _tiny_pair(12)
    drafter = ModelDrafter(LeanBackend(LeanModel(draft.model)), 32, draft.head_tokens)
    sampling = SamplingConfig(temperature=1.5, top_k=0, top_p=1.0)
    g = torch.Generator().manual_seed(0)
    proposed = drafter.propose([DraftRequest(0, [5, 17, 3], 40, sampling, g)])[0]
    assert set(proposed.tokens) <= set(range(12))
    assert bool((proposed.probs[:, 12:] == 0).all())
    torch.testing.assert_close(proposed.probs.sum(-1), torch.ones(40))


#: Configs a head of 12 holds (greedy, a top-k below 12) and configs it does not.
_CONFIGS = (
    SamplingConfig(top_k=5),
    SamplingConfig(temperature=0),
    SamplingConfig(temperature=1.3, top_k=11, top_p=0.8, min_p=0.05),
    SamplingConfig(temperature=1.2, top_k=12, top_p=0.9),
    SamplingConfig(temperature=0.9, top_k=0, top_p=0.9),
    SamplingConfig(temperature=1.1, top_k=25, top_p=1.0),
)


def _drafted_together(drafter: ModelDrafter, whole_vocabulary: bool, sharpen: float = 1.0):
    """Each config's chain of 6 drafted for two rows, all of them in one proposal; with
    ``whole_vocabulary`` every row through a ``process`` (the head's logits placed in the
    vocabulary, processed alone), ``sharpen`` scaling that process's logits."""

    def alone(sampling: SamplingConfig):
        return lambda logits, _: logits_to_probs(logits * sharpen, sampling)

    asks = []
    for row, sampling in enumerate(_CONFIGS * 2):
        process = alone(sampling) if whole_vocabulary else None
        g = torch.Generator().manual_seed(row)
        asks.append(DraftRequest(row, [5, 17, 3, row], 6, sampling, g, process))
    drafter.reset()
    return drafter.propose(asks)


@pytest.mark.parametrize("cut", [True, False], ids=["cut-head", "whole-head"])
def test_rows_drafted_together_on_the_head_are_each_rows_whole_vocabulary_draft(cut) -> None:
    """Rows that only sample are processed together on the head's logits where their config
    allows it (every config for a whole head); every row's tokens and p then have the bits
    of its draft through the whole vocabulary, alone. The control: a process that changes
    the logits changes p."""
    ids = torch.tensor([0, 2, 3, 5, 8, 9, 13, 17, 20, 21, 26, 31]) if cut else None
    _, draft = _tiny_pair(32, ids)
    backend = LeanBackend(LeanModel(draft.model), batch=2 * len(_CONFIGS))
    drafter = ModelDrafter(backend, 32, ids)
    head = _drafted_together(drafter, whole_vocabulary=False)
    whole = _drafted_together(drafter, whole_vocabulary=True)
    for ours, alone in zip(head, whole, strict=True):
        assert ours.tokens == alone.tokens
        assert torch.equal(ours.probs, alone.probs)
    sharper = _drafted_together(drafter, whole_vocabulary=True, sharpen=1.01)
    assert not all(torch.equal(a.probs, b.probs) for a, b in zip(whole, sharper, strict=True))


def test_sps_through_a_truncated_head_keeps_the_verifiers_law() -> None:
    """The first two tokens' joint law is the verifier's, although the draft cannot propose
    20 of the 32 tokens, the verifier's likeliest first token among them (the engine's own
    pair test, with its negative control there)."""
    target, draft = _tiny_pair(12)
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
    prompt, runs = [5, 17, 3, 19, 11], 1200
    decoder = SpeculativeDecoder(target, draft, spec_of(SpS(), 2))
    counts = sampled_pairs(decoder, prompt, runs, sampling)
    assert chi_square_p_value(counts, exact_pair_law(target, prompt, sampling), runs) > 1e-3


@pytest.mark.slow
def test_greedy_sps_with_a_truncated_head_equals_autoregressive(smollm_path) -> None:
    verifier = load_model(smollm_path, dtype="float32")
    decoder = SpeculativeDecoder(
        verifier,
        smollm_path,
        DecodeSpec.of("sps", num_draft_tokens=4),
        draft_vocab=4096,
        dtype="float32",
    )
    prompt = "Write a Python function that returns the sum of a list of numbers."
    ar = SpeculativeDecoder(verifier, spec=AR).generate(prompt, 48, temperature=0)
    sps = decoder.generate(prompt, 48, temperature=0)
    assert sps.stats.acceptance_by_position[0] > 0.5
    assert_same_greedy_tokens(verifier, prompt, ar.token_ids, sps.token_ids)
