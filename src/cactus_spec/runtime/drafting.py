"""How the engine builds a spec's drafter: one builder per name of ``core.drafters.DRAFTERS``.

A builder takes the engine's pieces (``DrafterParts``: the verifier, its vocabulary, and the
draft model with its backend when the drafter needs one) and returns a ``Drafter``. A new
drafter is a class (``drafters.Drafter``) and ``register_drafter``, which enters its needs in
the core registry and its builder here; from then on the spec's parser, the command line, the
server, lm-eval and the bench take its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cactus_spec.backends.base import Backend
from cactus_spec.core.drafters import DRAFTERS, DrafterKind
from cactus_spec.loading.models import LoadedModel
from cactus_spec.runtime.cross_vocab import CrossVocabDrafter
from cactus_spec.runtime.drafters import Drafter, ModelDrafter, NGramDrafter


@dataclass(frozen=True)
class DrafterParts:
    """What a drafter is built from: the ``verifier``, the ``vocab_size`` its drafts' ids lie
    in, and, for a drafter that needs a draft model, the ``draft``, its ``draft_backend``
    (None otherwise) and ``drafts_text``: whether the draft's tokenizer differs from the
    verifier's (``loading.models.tokenizers_differ``), so that it drafts text."""

    verifier: LoadedModel
    vocab_size: int
    draft: LoadedModel | None = None
    draft_backend: Backend | None = None
    drafts_text: bool = False


Build = Callable[[DrafterParts], Drafter]


def _model_drafter(parts: DrafterParts) -> Drafter:
    """The draft model samples; a draft with another tokenizer drafts text (``cross_vocab``)."""
    draft, backend = parts.draft, parts.draft_backend
    assert draft is not None and backend is not None  # the model drafter needs a draft model
    if not parts.drafts_text:
        return ModelDrafter(backend, parts.vocab_size, draft.head_tokens)
    assert draft.tokenizer is not None and parts.verifier.tokenizer is not None  # they differ
    drafter = ModelDrafter(backend, len(draft.tokenizer), draft.head_tokens)
    return CrossVocabDrafter(drafter, draft.tokenizer, parts.verifier.tokenizer)


#: The builder of each drafter of ``core.drafters.DRAFTERS``.
BUILDERS: dict[str, Build] = {
    "model": _model_drafter,
    "ngram": lambda parts: NGramDrafter(),
}


def register_drafter(
    name: str,
    build: Build,
    *,
    needs_draft_model: bool = False,
    drafts_trees: bool = False,
    help: str = "",
) -> None:
    """Make ``name`` a drafter that every interface takes, built by ``build``; ValueError
    when the name is taken."""
    if name in DRAFTERS:
        raise ValueError(f"drafter {name!r} is registered already")
    DRAFTERS[name] = DrafterKind(name, needs_draft_model, drafts_trees, help)
    BUILDERS[name] = build


def build_drafter(name: str, parts: DrafterParts) -> Drafter:
    """The drafter called ``name``, built from ``parts``."""
    return BUILDERS[name](parts)
