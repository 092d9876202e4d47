"""The options that load the models, read and checked once.

As ``core.spec.parse_spec`` reads the decoding options, ``parse_load`` reads the loading
options (``LOAD_KEYS``) for the engine, the command line (``generate``, ``demo``, ``serve``,
``bench``) and lm-eval's model args: each caller hands what it was given and a ``label`` that
names a key the way its user wrote it (``--draft-vocab``, ``draft_vocab``), and gets the same
one-line errors, before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import PreTrainedModel

from cactus_spec.backends.ggml import GgufModel
from cactus_spec.backends.quant import QUANTS
from cactus_spec.core.checks import is_int
from cactus_spec.loading.backend_choice import auto_backend
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.gguf import READS, check_ggml, check_gguf_source
from cactus_spec.loading.models import (
    BACKENDS,
    LoadedModel,
    ModelSource,
    check_device,
    resolve_draft_quant,
    resolve_dtype,
    resolve_verifier_quant,
)

__all__ = ["BACKENDS", "LOAD_KEYS", "LoadOptions", "parse_load"]

#: What ``parse_load`` reads.
LOAD_KEYS = (
    "verifier", "draft", "verifier_quant", "draft_quant", "draft_vocab", "dtype", "device",
    "threads", "backend",
)  # fmt: skip


@dataclass(frozen=True)
class LoadOptions:
    """Which models load and how. ``draft`` is None exactly when nothing is drafted by a
    model; ``verifier_quant`` and ``draft_quant`` are resolved (never ``auto``:
    ``resolve_verifier_quant``, ``resolve_draft_quant``; none on the ggml backend, whose
    weights are the GGUF's own). One built directly rather than by ``parse_load`` drafts in
    int8, which needs no choice of level or rows."""

    verifier: ModelSource = DEFAULT_PAIR[0]
    draft: ModelSource | None = None
    verifier_quant: str = "none"
    draft_quant: str = "int8"
    draft_vocab: int | None = None
    dtype: str | torch.dtype | None = None
    device: str = "cpu"
    threads: int | None = None
    backend: str = "auto"
    backend_why: str = field(default="", compare=False)  # why auto chose it (backend_choice)

    def as_kwargs(self) -> dict[str, Any]:
        """Every option by its key, as ``SpeculativeDecoder`` takes them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "backend_why"}

    def model_kwargs(self) -> dict[str, Any]:
        """What ``load_model`` takes for either model, beside its quantisation."""
        return {
            "dtype": self.dtype, "device": self.device, "threads": self.threads,
            "backend": self.backend,
        }  # fmt: skip


def parse_load(
    values: Mapping[str, object],
    *,
    needs_draft: bool,
    trees: bool = False,
    auto_ggml: bool = True,
    rows: int = 1,
    default_pair: tuple[str, str] | None = DEFAULT_PAIR,
    label: Callable[[str], str] = str,
) -> LoadOptions:
    """The options ``values`` describe (keys: ``LOAD_KEYS``; a None value counts as not given).

    The verifier defaults to ``default_pair[0]``; the draft to ``default_pair[1]`` where
    ``needs_draft`` (the spec drafts with a model); without ``default_pair`` both are
    required. A draft or a draft vocabulary given where nothing is drafted by a model is
    refused. Counts may be text (lm-eval's model args). Backend ``auto`` is resolved here
    (``loading.backend_choice``: ggml where llama.cpp's kernels measure faster and run what
    was asked, draft ``trees`` included, else ours; ``auto_ggml`` False keeps it ours), the
    reason kept in ``backend_why``. ``draft_quant`` auto, its default, is the format that
    decodes fastest where up to ``rows`` rows are decoded at once, the caller's most
    (``resolve_draft_quant``). Backend ``ggml`` reads GGUF files only and runs their own
    weights: a quantisation of ours (``auto`` reads as none), a cut draft head or a dtype is
    refused, and both quantisations read none. ValueError naming the key (``label(key)``) and
    what it allows, for the first bad one; TypeError for a model that is neither a name nor
    a model.
    """
    given = {k: v for k, v in values.items() if v is not None}
    if given.get("draft_quant") == "auto":  # the default, given or not (asks for no format)
        del given["draft_quant"]
    unknown = [k for k in given if k not in LOAD_KEYS]
    if unknown:
        allowed = ", ".join(LOAD_KEYS)
        raise ValueError(f"unknown key {unknown[0]!r}; the loading options are {allowed}")
    for key in ("draft", "draft_vocab"):
        if key in given and not needs_draft:
            raise ValueError(
                f"{label(key)} does not apply: nothing is drafted by a model "
                "(method ar, or a drafter without a draft model)"
            )
    defaults = default_pair or (None, None)
    backend = _choice(label("backend"), given.get("backend", _default("backend")), BACKENDS)
    why = ""
    if backend == "auto" and auto_ggml:
        choice = auto_backend(given, needs_draft, trees)
        backend, why = choice.backend, choice.why
    device = str(check_device(given.get("device", _default("device")), label("device")))
    dtype = given.get("dtype")
    if not isinstance(dtype, (str, torch.dtype, type(None))):
        raise ValueError(f"{label('dtype')} must be a dtype's name or a torch.dtype, got {dtype!r}")
    resolve_dtype(dtype, device, label("dtype"))
    verifier_quant = _choice(
        label("verifier_quant"),
        given.get("verifier_quant", _default("verifier_quant")),
        (*QUANTS, "auto"),
    )
    draft_quant = _choice(label("draft_quant"), given.get("draft_quant", "auto"), (*QUANTS, "auto"))
    options = LoadOptions(
        verifier=_source(label("verifier"), given.get("verifier", defaults[0])),
        draft=_source(label("draft"), given.get("draft", defaults[1])) if needs_draft else None,
        verifier_quant="none" if backend == "ggml" else resolve_verifier_quant(verifier_quant),
        draft_quant="none" if backend == "ggml" else resolve_draft_quant(draft_quant, rows, device),
        draft_vocab=_count(label("draft_vocab"), given.get("draft_vocab")),
        dtype=dtype,
        device=device,
        threads=_count(label("threads"), given.get("threads")),
        backend=backend,
        backend_why=why,
    )
    if backend == "ggml":
        asked = {  # auto, or nothing given, leaves the GGUF's own weights
            "verifier_quant": None if verifier_quant == "auto" else verifier_quant,
            "draft_quant": given.get("draft_quant"),
            "draft_vocab": options.draft_vocab,
            "dtype": dtype,
            "device": device,
        }
        check_ggml(asked, label)
        for key in ("verifier", "draft"):
            _check_gguf_model(label(key), getattr(options, key), f"{label('backend')} ggml")
    return options


def _default(key: str) -> object:
    """A loading option's default where none is given: ``LoadOptions``'s, declared there once."""
    return LoadOptions.__dataclass_fields__[key].default


def _check_gguf_model(name: str, source: ModelSource | None, backend: str) -> None:
    """ValueError naming ``name`` and ``backend`` unless the ggml backend reads ``source``
    (None: no model): a known name, a ``.gguf`` path, or a model loaded for it."""
    if source is None or isinstance(source, LoadedModel) and isinstance(source.model, GgufModel):
        return
    if isinstance(source, (LoadedModel, PreTrainedModel)):
        raise ValueError(f"{backend} reads {READS}; {name} is a transformers model already loaded")
    check_gguf_source(source, name, backend)


def _source(name: str, value: object) -> ModelSource:
    """A model name, path or hub id, or a model already loaded: TypeError for another type
    (None included: where there is no default, a model is required), ValueError for ''."""
    if isinstance(value, (LoadedModel, PreTrainedModel)) or hasattr(value, "__fspath__"):
        return value  # type: ignore[return-value]  # a path-like loads as its path
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a model name, path, hub id, LoadedModel or PreTrainedModel, "
            f"got {type(value).__name__}"
        )
    if not value.strip():
        raise ValueError(f"{name} must be a model name, path or hub id, got {value!r}")
    return value


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _count(name: str, value: object) -> int | None:
    """None, or an integer >= 1 (or its text)."""
    if value is None:
        return None
    number = _as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return number


def _as_int(value: object) -> int | None:
    if is_int(value):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None
