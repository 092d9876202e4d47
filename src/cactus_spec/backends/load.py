"""Which backend runs a loaded model: the lean code where it applies, else transformers."""

from __future__ import annotations

from cactus_spec.backends.base import Backend
from cactus_spec.backends.hf import TransformersBackend
from cactus_spec.backends.lean import LeanBackend, LeanModel, unsupported_reason
from cactus_spec.models import LoadedModel

BACKENDS = ("auto", "lean", "hf")


def make_backend(loaded: LoadedModel, kind: str = "auto") -> Backend:
    """A backend over ``loaded``: ``lean`` (Qwen2/Llama in plain torch, static per-row
    cache), ``hf`` (any transformers model), or ``auto`` (lean when it supports the model).
    The cache holds the model's full context, at most ``lean.DEFAULT_CONTEXT`` tokens."""
    if kind not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    reason = unsupported_reason(loaded.model)
    if kind == "hf" or (kind == "auto" and reason is not None):
        return TransformersBackend(loaded.model)
    if reason is not None:
        raise ValueError(f"backend lean does not support {reason}; use backend hf or auto")
    return LeanBackend(LeanModel(loaded.model))
