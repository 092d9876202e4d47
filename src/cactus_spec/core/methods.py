"""The registry of decoding methods: name -> rule class, its parameters, defaults and ranges.

A new rule is one class in ``rules`` plus one ``Method`` line in ``METHODS``: the command
line builds its flags from this registry and bench grids parse their entries against it.
The rule classes enforce their own ranges (the library checks them too); ``Param.allowed``
states the range for help texts. ``ar`` is the verifier alone (no rule, no drafting).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cactus_spec.core.rules import TAS, Cactus, Interp, Rule, SpS, TopK

#: Drafted tokens per iteration when K is fixed: the quality and speed runs' K
#: (``docs/RESULTS.md``).
DEFAULT_NUM_DRAFT_TOKENS = 10
DEFAULT_METHOD = "cactus"

ParamValue = bool | int | float


@dataclass(frozen=True)
class Param:
    """One parameter of a method; its type is the type of its default."""

    name: str
    default: ParamValue
    allowed: str  # the range in words, for help texts, e.g. "[0, 1]"
    help: str


@dataclass(frozen=True)
class Method:
    """A decoding method: ``rule`` builds its acceptance rule from its ``params``."""

    name: str
    rule: type[Rule] | None  # None: autoregressive decoding, nothing drafted
    params: tuple[Param, ...]
    help: str

    @property
    def defaults(self) -> dict[str, ParamValue]:
        return {p.name: p.default for p in self.params}

    @property
    def drafts(self) -> bool:
        return self.rule is not None


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", None, (), "the verifier alone, one token per forward (the baseline)"),
        Method("sps", SpS, (), "exact speculative sampling (lossless)"),
        Method(
            "cactus",
            Cactus,
            (
                Param("delta", 1.0, ">= 0", "Cactus KL budget in nats"),
                Param("exact", False, "true/false", "Cactus: exact KL bound (bisection)"),
            ),
            "constrained acceptance: KL(h || q) within delta",
        ),
        Method(
            "tas",
            TAS,
            (
                Param("epsilon", 0.09, "[0, 1]", "TAS threshold cap"),
                Param("alpha", 0.3, "[0, 1]", "TAS entropy factor"),
            ),
            "typical acceptance (Medusa), unbounded divergence",
        ),
        Method(
            "interp",
            Interp,
            (Param("alpha", 0.5, "[0, 1]", "Interp weight of the draft"),),
            "h = alpha p + (1 - alpha) q, unbounded divergence",
        ),
        Method(
            "topk",
            TopK,
            (Param("k", 5, ">= 1", "TopK: accept drafts in the verifier's top k"),),
            "accept drafts in the verifier's top k, unbounded divergence",
        ),
    )
}


def get_method(name: str) -> Method:
    """The registered method called ``name``; ValueError listing the names otherwise."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {name!r}")
    return METHODS[name]


def methods_taking(param: str) -> list[str]:
    """Names of the methods that take a parameter called ``param``."""
    return [m.name for m in METHODS.values() if param in m.defaults]


def build_rule(method: str, given: Mapping[str, ParamValue | None]) -> Rule | None:
    """The rule of ``method`` with the parameters given (None = not given: the default).

    A parameter the method does not take raises ValueError naming the methods that do;
    a value out of range raises the rule's own ValueError. ``ar`` gives None.
    """
    spec = get_method(method)
    for name, value in given.items():
        if value is not None and name not in spec.defaults:
            takers = ", ".join(methods_taking(name)) or "no method"
            raise ValueError(f"{name} does not apply to method {method} (it applies to {takers})")
    if spec.rule is None:
        return None
    values = {n: given[n] if given.get(n) is not None else d for n, d in spec.defaults.items()}
    return spec.rule(**values)
