"""cactus-spec: speculative sampling with constrained acceptance (Cactus) and exact auditing."""

from cactus_spec.audit import acceptance_prob, kl, step_law, tv
from cactus_spec.rules import TAS, Cactus, Interp, Rule, SpS, TopK
from cactus_spec.verify import VerifyResult, verify

__all__ = [
    "TAS",
    "Cactus",
    "Interp",
    "Rule",
    "SpS",
    "TopK",
    "VerifyResult",
    "acceptance_prob",
    "kl",
    "step_law",
    "tv",
    "verify",
]
__version__ = "0.1.0"
