"""The registry of drafters: name -> what the drafter needs and what it can draft.

A spec names its drafter (``DecodeSpec.drafter``); every interface reads the names and their
needs here: the spec's parser, the command line's ``--drafter`` choices, the server's checks,
the bench's grids and the engine. How a drafter is built from the engine's pieces is the
runtime's (``runtime.drafting``, which holds one builder per name here): core imports nothing
above it, so the registry states what a drafter needs, and ``runtime.drafting.register_drafter``
adds a drafter to both at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterKind:
    """A drafter: ``needs_draft_model``, whether the engine loads a draft model for it;
    ``drafts_trees``, whether it can draft trees (``verification`` tree or traversal)."""

    name: str
    needs_draft_model: bool
    drafts_trees: bool
    help: str


#: The drafter of a spec that names none.
DEFAULT_DRAFTER = "model"

DRAFTERS: dict[str, DrafterKind] = {
    d.name: d
    for d in (
        DrafterKind("model", True, True, "a small draft model samples K tokens (or a tree)"),
        DrafterKind("ngram", False, False, "the latest n-gram of the context repeats"),
    )
}


def get_drafter(name: str, label: str = "drafter") -> DrafterKind:
    """The registered drafter called ``name``; ValueError naming ``label`` and listing the
    names otherwise."""
    if name not in DRAFTERS:
        raise ValueError(f"{label} must be one of {', '.join(DRAFTERS)}, got {name!r}")
    return DRAFTERS[name]


def drafts_without_a_model(name: str | None) -> bool:
    """Whether ``name`` is a registered drafter that needs no draft model: False for None (a
    method that drafts nothing) and for a name not registered."""
    kind = DRAFTERS.get(name) if name is not None else None
    return kind is not None and not kind.needs_draft_model


def tree_drafters() -> list[str]:
    """The names of the drafters that draft trees."""
    return [d.name for d in DRAFTERS.values() if d.drafts_trees]
