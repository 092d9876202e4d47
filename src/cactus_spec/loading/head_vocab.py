"""A truncated LM head for the draft: only the most frequent tokens (FR-Spec, Zhao et al. 2025).

A one-token draft step reads every weight once, and the 0.5B draft's head (151,936 x 896,
tied to its embedding) is 28% of those bytes. Keeping the N most frequent tokens cuts the
head to N rows; the draft's p is then zero off them, the verifier's q is untouched, and
every lossless method stays lossless (only acceptance can drop, where the verifier wants a
token the draft can no longer propose).

The ranking comes from real text that ships with every Python: the standard library's
sources (code with English docstrings and comments, about 12 MB, files in sorted order,
test suites left out), tokenised by the draft's tokenizer; tokens never seen there follow in
the order of their ids, which for a BPE vocabulary is the order of its merges, the tokenizer's
own frequency ranking. Special and added tokens (EOS, the chat template's) are always kept.
The ranking is computed once per tokenizer (it reads all of those sources) and cached under
the cache root.
"""

from __future__ import annotations

import glob
import hashlib
import json
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cactus_spec.files import write_json_atomic
from cactus_spec.paths import cache_dir

#: The corpus: at most this many characters of the standard library's sources.
_CORPUS_CHARS = 16_000_000


def standard_library_sources() -> list[Path]:
    """The standard library's .py files in sorted order, without site-packages or tests."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(f"{root}/**/*.py", recursive=True))
    return [Path(f) for f in files if "site-packages" not in f and "/test" not in f]


def ranked_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id, most frequent first (see the module docstring); cached per tokenizer."""
    key = _tokenizer_key(tokenizer)
    path = cache_dir() / "head-vocab" / f"{key}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())["ranked"]
        except (ValueError, KeyError):  # a damaged cache entry is rebuilt
            pass
    counts: Counter[int] = Counter()
    read = 0
    for source in standard_library_sources():
        text = source.read_text(encoding="utf-8", errors="ignore")
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
        read += len(text)
        if read >= _CORPUS_CHARS:
            break
    seen = [token for token, _ in counts.most_common()]
    rest = sorted(set(range(len(tokenizer))) - set(seen))
    ranked = seen + rest
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"python": sys.version, "characters": read, "ranked": ranked})
    return ranked


def head_tokens(tokenizer: PreTrainedTokenizerBase, size: int, vocab_size: int) -> torch.Tensor:
    """The ids a head of ``size`` keeps [N], ascending: the ``size`` most frequent, plus every
    special and added token, all below ``vocab_size`` (the model's rows)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"draft_vocab must be an integer >= 1, got {size!r}")
    keep = set(ranked_tokens(tokenizer)[:size])
    keep |= set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return torch.tensor(sorted(t for t in keep if t < vocab_size), dtype=torch.long)


def restrict_head(model: PreTrainedModel, ids: torch.Tensor) -> None:
    """Replace the model's LM head by one over the rows ``ids`` [N] (a copy: a tied
    embedding stays whole); its logits come out in the order of ``ids``."""
    head = model.get_output_embeddings()
    weight = head.weight.detach()[ids].clone()  # [N, E]
    small = nn.Linear(weight.shape[1], weight.shape[0], bias=head.bias is not None)
    small = small.to(dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        small.weight.copy_(weight)
        if head.bias is not None:
            small.bias.copy_(head.bias.detach()[ids])
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(small)


def _tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of the tokenizer's vocabulary (the same tokens give the same ranking)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:32]
