"""cactus-spec: speculative sampling with constrained acceptance (Cactus) and exact auditing.

The public API, imported lazily (``import cactus_spec`` does not load torch until a name
below is used)::

    from cactus_spec import SpeculativeDecoder, Cactus
    decoder = SpeculativeDecoder("qwen-coder-1.5b", "qwen-coder-0.5b", Cactus(delta=1.0))
    decoder.generate("Write quicksort in Python").text
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cactus-spec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

#: Public name -> the module that defines it.
_EXPORTS = {
    "SpeculativeDecoder": "cactus_spec.engine",
    "GenerationResult": "cactus_spec.generation",
    "GenerationStats": "cactus_spec.generation",
    "SamplingConfig": "cactus_spec.sampling",
    "Rule": "cactus_spec.rules",
    "SpS": "cactus_spec.rules",
    "Cactus": "cactus_spec.rules",
    "TAS": "cactus_spec.rules",
    "Interp": "cactus_spec.rules",
    "TopK": "cactus_spec.rules",
    "verify": "cactus_spec.verification",
    "VerifyResult": "cactus_spec.verification",
    "step_law": "cactus_spec.audit",
    "acceptance_prob": "cactus_spec.audit",
    "step_divergences": "cactus_spec.audit",
    "kl": "cactus_spec.audit",
    "tv": "cactus_spec.audit",
    "Drafter": "cactus_spec.drafters",
    "Draft": "cactus_spec.drafters",
    "ModelDrafter": "cactus_spec.drafters",
    "NGramDrafter": "cactus_spec.drafters",
    "load_model": "cactus_spec.models",
    "LoadedModel": "cactus_spec.models",
    "METHODS": "cactus_spec.methods",
    "build_rule": "cactus_spec.methods",
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
