"""cactus-spec: speculative sampling with constrained acceptance (Cactus) and exact auditing.

The public API, imported lazily (``import cactus_spec`` does not load torch until a name
below is used)::

    from cactus_spec import DecodeSpec, SpeculativeDecoder
    spec = DecodeSpec.of("cactus", delta=1.0, num_draft_tokens=10)
    engine = SpeculativeDecoder("qwen-coder-1.5b", "qwen-coder-0.5b", spec)
    engine.generate("Write quicksort in Python").text
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

from cactus_spec import isa as _isa

_isa.hold_torch()  # CACTUS_SPEC_ISA holds torch's kernels too, before torch runs anything

try:
    __version__ = version("cactus-spec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

#: Public name -> the module that defines it.
_EXPORTS = {
    "SpeculativeDecoder": "cactus_spec.runtime.engine",
    "GenerationResult": "cactus_spec.runtime.generation",
    "GenerationStats": "cactus_spec.runtime.generation",
    "SamplingConfig": "cactus_spec.core.sampling",
    "Penalties": "cactus_spec.core.penalties",
    "TokenLogprob": "cactus_spec.runtime.logprobs",
    "Grammar": "cactus_spec.runtime.grammar",
    "Rule": "cactus_spec.core.rules",
    "SpS": "cactus_spec.core.rules",
    "Cactus": "cactus_spec.core.rules",
    "TAS": "cactus_spec.core.rules",
    "Interp": "cactus_spec.core.rules",
    "TopK": "cactus_spec.core.rules",
    "verify": "cactus_spec.core.verification",
    "VerifyResult": "cactus_spec.core.verification",
    "step_law": "cactus_spec.core.audit",
    "acceptance_prob": "cactus_spec.core.audit",
    "step_divergences": "cactus_spec.core.audit",
    "kl": "cactus_spec.core.audit",
    "tv": "cactus_spec.core.audit",
    "Drafter": "cactus_spec.runtime.drafters",
    "Draft": "cactus_spec.runtime.drafters",
    "ModelDrafter": "cactus_spec.runtime.drafters",
    "NGramDrafter": "cactus_spec.runtime.drafters",
    "StatelessDrafter": "cactus_spec.runtime.drafters",
    "DRAFTERS": "cactus_spec.core.drafters",
    "register_drafter": "cactus_spec.runtime.drafting",
    "DrafterParts": "cactus_spec.runtime.drafting",
    "load_model": "cactus_spec.loading.models",
    "LoadedModel": "cactus_spec.loading.models",
    "METHODS": "cactus_spec.core.methods",
    "build_rule": "cactus_spec.core.methods",
    "DecodeSpec": "cactus_spec.core.spec",
    "parse_spec": "cactus_spec.core.spec",
    "Request": "cactus_spec.runtime.generation",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cactus_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
