"""Which backend runs a loaded model: the lean code where it applies, else transformers;
llama.cpp for a GGUF loaded for the ggml backend."""

from __future__ import annotations

import torch

from cactus_spec.backends.base import Backend
from cactus_spec.backends.ggml import GgmlBackend, GgufModel
from cactus_spec.backends.hf import TransformersBackend
from cactus_spec.backends.lean import LeanBackend, LeanModel, unsupported_reason
from cactus_spec.loading.models import BACKENDS, LoadedModel

#: The class ``make_backend`` builds for each backend named outright (``auto`` picks lean or
#: hf by the model).
BACKEND_TYPES: dict[str, type[Backend]] = {
    "lean": LeanBackend, "hf": TransformersBackend, "ggml": GgmlBackend,
}  # fmt: skip


def reads_trees(kind: str) -> bool:
    """Whether backend ``kind`` has token-tree attention (``Backend.reads_trees``); True for
    ``auto``, whose choice waits for the model (the engine checks the backend it built)."""
    chosen = BACKEND_TYPES.get(kind)
    return chosen is None or chosen.reads_trees


def make_backend(
    loaded: LoadedModel, kind: str = "auto", slots: int = 1, draft: bool = False
) -> Backend:
    """A backend over ``loaded``: ``lean`` (Qwen2/Llama in plain torch, static per-row
    cache), ``hf`` (any transformers model), ``auto`` (lean when it supports the model), or
    ``ggml`` (llama.cpp, for a model loaded with ``load_model(..., backend="ggml")``, which
    ``auto`` runs on ggml too). The cache holds ``slots`` rows of the model's full
    context, at most ``lean.DEFAULT_CONTEXT`` tokens each; the transformers backend holds
    one row. A ``draft`` model's lean cache holds bfloat16 keys and values where its blocks
    are native (``LeanModel.native``): half the memory and half the bytes its attention reads
    (docs/DESIGN.md), for a draft law within bfloat16's rounding of the float32 cache's;
    every rule keeps its law whatever the draft's (a verifier's cache keeps its model's dtype)."""
    if kind not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    if isinstance(loaded.model, GgufModel):
        if kind not in ("auto", "ggml"):
            raise ValueError(
                f"backend {kind} cannot run {loaded.identity}, loaded for backend ggml"
            )
        return GgmlBackend(loaded.model, slots)
    if kind == "ggml":
        raise ValueError(
            f"backend ggml runs a GGUF loaded for it (load_model(..., backend='ggml')); "
            f"{loaded.identity} is a transformers model"
        )
    reason = unsupported_reason(loaded.model)
    if kind == "hf" or (kind == "auto" and reason is not None):
        if slots > 1:
            why = f" ({reason})" if reason else ""
            raise ValueError(
                f"a batch of {slots} rows needs the lean backend; the transformers backend"
                f"{why} decodes one sequence at a time (use max batch 1)"
            )
        return TransformersBackend(loaded.model)
    if reason is not None:
        raise ValueError(f"backend lean does not support {reason}; use backend hf or auto")
    model = LeanModel(loaded.model)
    return LeanBackend(
        model, batch=slots, cache_dtype=torch.bfloat16 if draft and model.native else None
    )
