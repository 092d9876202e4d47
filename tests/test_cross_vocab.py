"""Cross-vocabulary drafting: a draft with its own tokenizer drafts text that the verifier's
tokenizer encodes again (``runtime.cross_vocab``); SpS stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_lm
from test_engine import chi_square_p_value, exact_pair_law, reference_greedy, sampled_pairs
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.fetch import fetch
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.runtime.cross_vocab import CrossVocabDrafter, added_text
from cactus_spec.runtime.drafters import ModelDrafter
from cactus_spec.runtime.engine import SpeculativeDecoder


def bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over letters whose tokens decode to their letters, joined."""
    tokenizer = Tokenizer(BPE(vocab, merges))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


#: The verifier's: letters and the merges ab, cd, abcd. The draft's: other ids, bc and da.
VERIFIER_TOKENIZER = bpe_tokenizer(
    {"a": 0, "b": 1, "c": 2, "d": 3, "ab": 4, "cd": 5, "abcd": 6},
    [("a", "b"), ("c", "d"), ("ab", "cd")],
)
DRAFT_TOKENIZER = bpe_tokenizer(
    {"d": 0, "c": 1, "b": 2, "a": 3, "bc": 4, "da": 5}, [("b", "c"), ("d", "a")]
)


def tiny_pair() -> tuple[LoadedModel, LoadedModel]:
    verifier = LoadedModel(make_tiny_lm(vocab_size=7, seed=6), VERIFIER_TOKENIZER, "v", None)
    draft = LoadedModel(make_tiny_lm(vocab_size=6, seed=0), DRAFT_TOKENIZER, "d", None)
    return verifier, draft


def test_a_draft_with_another_tokenizer_drafts_text() -> None:
    verifier, draft = tiny_pair()
    decoder = SpeculativeDecoder(verifier, draft, DecodeSpec.of("sps", num_draft_tokens=3))
    drafter = decoder._drafter
    assert isinstance(drafter, CrossVocabDrafter)
    context = VERIFIER_TOKENIZER("abcab").input_ids  # [abcd, ab]
    assert drafter.draft_context(0, context) == DRAFT_TOKENIZER("abcab").input_ids
    drafted = DRAFT_TOKENIZER("dabc").input_ids  # [da, bc]
    assert drafter.verifier_tokens([3], drafted) == [3, 4, 2]  # d, ab, c
    same = LoadedModel(make_tiny_lm(vocab_size=7, seed=0), VERIFIER_TOKENIZER, "d", None)
    plain = SpeculativeDecoder(verifier, same, DecodeSpec.of("sps", num_draft_tokens=3))
    assert isinstance(plain._drafter, ModelDrafter)  # negative control: same tokenizer, ids


def test_the_drafted_text_keeps_characters_split_across_tokens_and_drops_a_cut_one() -> None:
    tokenizer = load_model(fetch("smollm2-135m")).tokenizer  # byte level: é is two tokens
    before = tokenizer("x").input_ids
    split = [tokenizer.convert_tokens_to_ids(b) for b in ("Ã", "©")]  # é's two bytes
    assert tokenizer.decode(split[:1]) == "\ufffd"
    assert added_text(tokenizer, before, [*tokenizer(" ab").input_ids, *split]) == " abé"
    assert added_text(tokenizer, before, [*tokenizer(" ab").input_ids, split[0]]) == " ab"


@pytest.mark.parametrize("verification", ["chain", "block"])
def test_joint_law_of_first_two_tokens_is_the_verifiers(verification: str) -> None:
    verifier, draft = tiny_pair()
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
    prompt, runs = [4, 5, 6, 0], 1200
    law = exact_pair_law(verifier.model, prompt, sampling)
    sps = SpeculativeDecoder(
        verifier, draft, DecodeSpec.of("sps", num_draft_tokens=2, verification=verification)
    )
    cactus = SpeculativeDecoder(verifier, draft, DecodeSpec.of("cactus", delta=5.0))
    assert chi_square_p_value(sampled_pairs(sps, prompt, runs, sampling), law, runs) > 1e-3
    negative = chi_square_p_value(sampled_pairs(cactus, prompt, runs, sampling), law, runs)
    assert negative < 1e-6  # negative control: the same test can fail
    kept = sum(sps.generate(prompt, 2, 1.0, 3, seed=s).stats.accepted for s in range(100))
    assert kept >= 10  # the first two positions do keep drafts


def test_greedy_across_vocabularies_equals_the_verifiers_greedy() -> None:
    verifier, draft = tiny_pair()
    decoder = SpeculativeDecoder(verifier, draft, DecodeSpec.of("sps", num_draft_tokens=4))
    prompt = [0, 1, 2, 3, 4]
    result = decoder.generate(prompt, 30, 0.0)
    assert result.token_ids == reference_greedy(verifier.model, prompt, 30)
    assert result.stats.drafted > 0


def permuted(loaded: LoadedModel, tmp_path) -> LoadedModel:
    """The same model and tokenizer with every id reversed: another vocabulary, the same text."""
    size = loaded.model.get_input_embeddings().weight.shape[0]
    loaded.tokenizer.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["vocab"] = {t: size - 1 - i for t, i in data["model"]["vocab"].items()}
    for token in data["added_tokens"]:
        token["id"] = size - 1 - token["id"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)))
    model = type(loaded.model)(loaded.model.config).eval()
    model.load_state_dict(loaded.model.state_dict())
    with torch.no_grad():  # tied: the head reads the reversed embedding too
        model.get_input_embeddings().weight.copy_(
            loaded.model.get_input_embeddings().weight.flip(0)
        )
    return LoadedModel(model, tokenizer, "smollm2-reversed", None)


@pytest.mark.slow
def test_smollm2_drafting_for_itself_in_reversed_ids_keeps_its_drafts(tmp_path) -> None:
    """The reversed copy drafts SmolLM2's own text: greedy equals AR token for token and keeps
    nearly every draft; the reversed tokenizer on the unreversed model (its text garbled)
    keeps few, so the count can fail."""
    smollm = load_model(fetch("smollm2-135m"), dtype="float32")
    ar = SpeculativeDecoder(smollm, spec=DecodeSpec.of("ar"))
    prompt = ar.encode("Write a Python function that reverses a list.", chat=True)
    expected = ar.generate(prompt, 48, 0.0).token_ids
    spec = DecodeSpec.of("sps", num_draft_tokens=6)
    reversed_copy = permuted(smollm, tmp_path)
    result = SpeculativeDecoder(smollm, reversed_copy, spec).generate(prompt, 48, 0.0)
    assert result.token_ids == expected
    assert result.stats.accepted >= 0.9 * result.stats.drafted > 0
    garbled = LoadedModel(smollm.model, reversed_copy.tokenizer, "garbled", None)
    control = SpeculativeDecoder(smollm, garbled, spec).generate(prompt, 48, 0.0)
    assert control.token_ids == expected
    assert control.stats.accepted < 0.2 * control.stats.drafted
