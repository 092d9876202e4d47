"""The decoding spec: the method that decodes (with its parameters), K and the drafter.

``DecodeSpec`` is the one description of how to decode that every interface builds: the
command line from its flags, the server from a request's ``speculative`` object, lm-eval from
its model args, and the bench from a grid entry. They all go through ``parse_spec``, so a
value is converted, checked and its error worded in one place:

- ``method``: a name in ``methods.METHODS``; ``ar`` decodes the verifier alone (it drafts
  nothing: K and the drafter do not apply to it).
- the method's parameters (``delta``, ``exact``, ...): the type of their registry default,
  in the rule's range.
- ``num_draft_tokens`` (K): the tokens drafted per iteration (a tree's depth), an integer
  >= 1, or None (given as ``"auto"``) where a policy picks K each iteration from the measured
  costs and, for a chain, stops drafting inside it when the draft is unsure
  (``runtime.policy``).
- ``drafter``: where drafts come from, a name in ``drafters.DRAFTERS`` (default ``model``).
- ``verification``: how drafts are judged, one of ``VERIFICATIONS``: ``chain``, token by
  token (every rule); ``block``, the chain as a whole (``core.block_verification``; rules with
  a target per position: sps, and cactus with its KL budget spent per position); ``tree``,
  a draft tree of up to ``branches`` nodes at each depth, given to the likeliest paths, all
  verified in one forward and judged top down (``core.tree_verification``; the same rules);
  or ``traversal``, the same tree judged leaf to root, each path as a whole, as blocks judge
  a chain (``core.traversal_verification``; with one branch it is ``block``).
- ``branches``: the tree's nodes per depth, an integer >= 1 (trees only).
- ``kl_budget``: Cactus only, a divergence budget in nats for the whole answer
  (``core.budget``): each drafted position's delta comes from what is left of it (``delta``
  caps each position), so KL(answer law || verifier's) <= kl_budget on every path. Every
  verification; None: no budget (each position within delta).
- ``allocation``: with ``kl_budget``, how each position's share is set from what is left,
  one of ``core.budget.ALLOCATIONS`` (default ``greedy``).

Values come typed (JSON, TOML, Python) or, with ``text=True``, as text from a command line
or lm-eval's model args ("0.5", "true").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import overload

from cactus_spec.core.budget import ALLOCATIONS, check_allocation, check_budget
from cactus_spec.core.checks import is_int
from cactus_spec.core.drafters import DEFAULT_DRAFTER, DRAFTERS, get_drafter, tree_drafters
from cactus_spec.core.methods import (
    DEFAULT_METHOD,
    DEFAULT_NUM_DRAFT_TOKENS,
    METHODS,
    ParamValue,
    build_rule,
    get_method,
    methods_taking,
)
from cactus_spec.core.rules import Rule

#: The K that leaves the draft length to a policy (``DecodeSpec.num_draft_tokens`` None).
AUTO_K = "auto"
#: How drafts are judged: a chain token by token, a chain as a block, or a draft tree top down
#: or leaf to root (all but the first for rules with a target per position).
VERIFICATIONS = ("chain", "block", "tree", "traversal")
#: The verifications that draft trees (and take ``branches``).
TREES = ("tree", "traversal")
#: A tree's nodes per depth when none is given.
DEFAULT_BRANCHES = 2
#: An answer's divergence budget and how it is spent (``BUDGET_METHODS`` only).
BUDGET_KEYS = ("kl_budget", "allocation")
#: The spec's own keys (the rest of SPEC_KEYS are method parameters).
_OWN_KEYS = ("method", "num_draft_tokens", "drafter", "verification", "branches", *BUDGET_KEYS)
#: Every key a spec mapping may hold: the spec's own and every method parameter.
SPEC_KEYS = (*_OWN_KEYS, *dict.fromkeys(p.name for m in METHODS.values() for p in m.params))
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")
#: The methods that take ``kl_budget``: those whose rule spends one.
BUDGET_METHODS = tuple(n for n, m in METHODS.items() if m.rule and m.rule.spends_budget)


@dataclass(frozen=True)
class DecodeSpec:
    """How to decode: ``method`` with every one of its ``params`` (sorted by name, defaults
    filled), ``num_draft_tokens`` (K; 0 for ``ar``; None: a serving policy picks it),
    ``drafter`` (None for ``ar``), ``verification`` (None for ``ar``) and ``branches`` (a
    tree's nodes per depth; 1 unless it drafts trees), ``kl_budget`` (the answer's
    divergence budget in nats, None: none) and ``allocation`` (how the budget is spent;
    None without one). Build one with ``parse_spec`` or
    ``DecodeSpec.of``."""

    method: str = DEFAULT_METHOD
    params: tuple[tuple[str, ParamValue], ...] = field(
        default_factory=lambda: tuple(sorted(METHODS[DEFAULT_METHOD].defaults.items()))
    )
    num_draft_tokens: int | None = DEFAULT_NUM_DRAFT_TOKENS
    drafter: str | None = DEFAULT_DRAFTER
    verification: str | None = "chain"
    branches: int = 1
    kl_budget: float | None = None
    allocation: str | None = None

    def __post_init__(self) -> None:
        names = sorted(get_method(self.method).defaults)
        if [name for name, _ in self.params] != names:
            raise ValueError(f"params of {self.method} must be {names} in order, got {self.params}")

    @classmethod
    def of(cls, method: str = DEFAULT_METHOD, **values: object) -> DecodeSpec:
        """``DecodeSpec.of("cactus", delta=0.5, num_draft_tokens=4)``, checked."""
        return parse_spec({"method": method, **values})

    @property
    def drafts(self) -> bool:
        """Whether anything is drafted (every method but ``ar``)."""
        return METHODS[self.method].drafts

    @property
    def trees(self) -> bool:
        """Whether it drafts trees (``verification`` tree or traversal)."""
        return self.verification in TREES

    @property
    def needs_draft_model(self) -> bool:
        """Whether decoding by it needs a draft model: it drafts, with a drafter that does
        (``drafters.DrafterKind.needs_draft_model``)."""
        return self.drafts and self.drafter is not None and DRAFTERS[self.drafter].needs_draft_model

    def check_trees(self, label: Callable[[str], str] = str) -> None:
        """ValueError when it drafts trees with a drafter that cannot
        (``drafters.DrafterKind.drafts_trees``); ``label`` names the keys."""
        if not self.trees or self.drafter is None or DRAFTERS[self.drafter].drafts_trees:
            return
        drafter = label("drafter")
        raise ValueError(
            f"{label('verification')} {self.verification} needs a draft model (a drafter of "
            f"trees: {drafter} {', '.join(tree_drafters())}), got {drafter} {self.drafter}; "
            "use chain or block"
        )

    @property
    def auto_k(self) -> bool:
        """Whether it drafts with K left to a policy (``num_draft_tokens`` None)."""
        return self.drafts and self.num_draft_tokens is None

    @cached_property
    def rule(self) -> Rule | None:
        """The acceptance rule; None for ``ar``."""
        return build_rule(self.method, dict(self.params))

    @property
    def lossless(self) -> bool:
        """Whether the output law is the verifier's (``ar`` and ``sps``)."""
        return self.rule is None or self.rule.lossless

    def with_num_draft_tokens(self, k: int | None) -> DecodeSpec:
        """This spec with K replaced (checked as ``parse_spec`` checks it)."""
        return parse_spec({"num_draft_tokens": k}, base=self) if k is not None else _no_k(self)

    def as_dict(self) -> dict:
        """JSON-ready: method, params, num_draft_tokens, drafter, verification (and branches,
        for trees, and kl_budget with its allocation, when set)."""
        tree = {"branches": self.branches} if self.trees else {}
        budget: dict[str, object] = {} if self.kl_budget is None else {"kl_budget": self.kl_budget}
        budget |= {} if self.kl_budget is None else {"allocation": self.allocation}
        return {
            "method": self.method,
            "params": dict(self.params),
            "num_draft_tokens": self.num_draft_tokens,
            "drafter": self.drafter,
            "verification": self.verification,
            **tree,
            **budget,
        }


def _no_k(spec: DecodeSpec) -> DecodeSpec:
    if not spec.drafts:
        return spec
    return DecodeSpec(
        spec.method,
        spec.params,
        None,
        spec.drafter,
        spec.verification,
        spec.branches,
        spec.kl_budget,
        spec.allocation,
    )


def parse_spec(
    values: Mapping[str, object],
    *,
    base: DecodeSpec | None = None,
    text: bool = False,
    label: Callable[[str], str] = str,
) -> DecodeSpec:
    """The spec ``values`` describes, over ``base`` (default: ``DecodeSpec()``).

    Keys are ``SPEC_KEYS``; a None value counts as not given. Without ``method`` the base's
    method is kept, and then no method parameter may be given (a parameter is read only
    against the method it is given with). A parameter the method does not take, K or the
    drafter given to ``ar``, a value of the wrong type or out of range: ValueError naming
    the key and what it allows. ``text``: values may be text to convert ("0.5", "true").
    ``label`` names a key in messages (the command line: ``--num-draft-tokens``).
    """
    base = DecodeSpec() if base is None else base
    given = {k: v for k, v in values.items() if v is not None}
    unknown = [k for k in given if k not in SPEC_KEYS]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; the spec takes {', '.join(SPEC_KEYS)}")
    params = {k: v for k, v in given.items() if k not in _OWN_KEYS}
    if "method" not in given and params:
        names = ", ".join(label(name) for name in params)
        raise ValueError(f"{label('method')} is required with method parameters ({names})")
    method = _convert(label("method"), given.get("method", base.method), "", text)
    spec = get_method(method)
    where = f"{label('method')} {method}"
    for name in params:
        if name not in spec.defaults:
            takers = ", ".join(methods_taking(name)) or "no method"
            raise ValueError(f"{label(name)} does not apply to {where} (it applies to {takers})")
    if not spec.drafts:
        for name in _OWN_KEYS[1:]:
            if name in given:
                raise ValueError(f"{label(name)} does not apply to {where} (it drafts nothing)")
        return DecodeSpec(method, (), 0, None, None)
    defaults = spec.defaults if "method" in given else dict(base.params)
    typed = {
        name: _convert(label(name), params[name], default, text) if name in params else default
        for name, default in sorted(defaults.items())
    }
    build_rule(method, typed)  # the rule checks its ranges
    k = given.get("num_draft_tokens")
    drafter = given.get("drafter")
    verification = _verification(given.get("verification"), method, typed, label, base)
    k = _num_draft_tokens(k, text, label) if k is not None else _base_k(base)
    budget, allocation = given.get("kl_budget"), given.get("allocation")
    if budget is None and "method" not in given:
        budget, allocation = base.kl_budget, allocation or base.allocation
    return DecodeSpec(
        method,
        tuple(typed.items()),
        k,
        _drafter(drafter, text, label) if drafter is not None else base.drafter or DEFAULT_DRAFTER,
        verification,
        _branches(given.get("branches"), verification, text, label, base),
        None if budget is None else _kl_budget(budget, method, text, label),
        _allocation(allocation, budget, text, label),
    )


def _base_k(base: DecodeSpec) -> int | None:
    """K when none is given: the base's, or the default over a base that drafts nothing."""
    return base.num_draft_tokens if base.drafts else DEFAULT_NUM_DRAFT_TOKENS


def _num_draft_tokens(value: object, text: bool, label: Callable[[str], str]) -> int | None:
    if isinstance(value, str) and value.strip() == AUTO_K:
        return None  # a policy picks K
    try:
        k = _convert(label("num_draft_tokens"), value, 0, text)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(
            f"{label('num_draft_tokens')} must be an integer >= 1 or {AUTO_K}, got {value!r}"
        )
    return k


def _drafter(value: object, text: bool, label: Callable[[str], str]) -> str:
    return get_drafter(_convert(label("drafter"), value, "", text), label("drafter")).name


def _verification(
    value: object, method: str, params: dict, label: Callable[[str], str], base: DecodeSpec
) -> str:
    """The verification given (checked), else the base's where it applies, else chain."""
    rule = build_rule(method, params)
    assert rule is not None  # a method that drafts
    blocks = rule.verifies_blocks
    if value is None:
        kept = base.verification or VERIFICATIONS[0]
        return kept if blocks else VERIFICATIONS[0]
    chosen = _convert(label("verification"), value, "", False)
    if chosen not in VERIFICATIONS:
        allowed = ", ".join(VERIFICATIONS)
        raise ValueError(f"{label('verification')} must be one of {allowed}, got {value!r}")
    if chosen != "chain" and not blocks:
        takers = ", ".join(n for n, m in METHODS.items() if m.rule and m.rule.verifies_blocks)
        raise ValueError(
            f"{label('verification')} {chosen} takes a method with a target per position "
            f"({takers}), not {method}; {method} verifies chains"
        )
    return chosen


def _kl_budget(value: object, method: str, text: bool, label: Callable[[str], str]) -> float:
    """The answer's budget (checked): ``BUDGET_METHODS`` only."""
    name = label("kl_budget")
    if method not in BUDGET_METHODS:
        raise ValueError(f"{name} applies to method {', '.join(BUDGET_METHODS)}, not {method}")
    if text and isinstance(value, str):
        value = _from_text(value.strip(), float)  # check_budget names what does not read
    return check_budget(value, name)


def _allocation(
    value: object, budget: object, text: bool, label: Callable[[str], str]
) -> str | None:
    """How the budget is spent (checked): None without a budget, else the value or greedy."""
    if budget is None:
        if value is not None:
            raise ValueError(f"{label('allocation')} applies with {label('kl_budget')} only")
        return None
    value = ALLOCATIONS[0] if value is None else value
    return check_allocation(
        value.strip() if text and isinstance(value, str) else value, label("allocation")
    )


def _branches(
    value: object, verification: str, text: bool, label: Callable[[str], str], base: DecodeSpec
) -> int:
    """A tree's nodes per depth: the value given (checked), else the base's
    tree's, else ``DEFAULT_BRANCHES``; 1 for chains and blocks, which take no value."""
    if verification not in TREES:
        if value is not None:
            raise ValueError(
                f"{label('branches')} applies to {label('verification')} {' or '.join(TREES)} only"
            )
        return 1
    if value is None:
        return base.branches if base.trees else DEFAULT_BRANCHES
    try:
        branches = _convert(label("branches"), value, 0, text)
    except ValueError:
        branches = 0
    if branches < 1:
        raise ValueError(f"{label('branches')} must be an integer >= 1, got {value!r}")
    return branches


@overload
def _convert(name: str, value: object, like: str, text: bool) -> str: ...
@overload
def _convert(name: str, value: object, like: bool, text: bool) -> bool: ...
@overload
def _convert(name: str, value: object, like: int, text: bool) -> int: ...
@overload
def _convert(name: str, value: object, like: float, text: bool) -> float: ...
def _convert(name: str, value: object, like: ParamValue | str, text: bool) -> ParamValue | str:
    """``value`` in the type of ``like`` (bool, int, float or str): exactly that type, an
    int for a float, or with ``text`` its text form; ValueError naming ``name`` otherwise."""
    kind = type(like)
    if text and isinstance(value, str) and kind is not str:
        value = _from_text(value.strip(), kind)
    if kind is str:
        if isinstance(value, str):
            return value
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if is_int(value) or (text and isinstance(value, float) and value.is_integer()):
            return int(value)
    elif (is_int(value) or isinstance(value, float)) and math.isfinite(value):
        return float(value)
    raise ValueError(f"{name} must be {_KINDS[kind]}, got {value!r}")


def _from_text(text: str, kind: type) -> object:
    """Text as ``kind``; the text itself when it does not read as one (the caller refuses)."""
    if kind is bool:
        lowered = text.lower()
        return lowered in _TRUE if lowered in _TRUE + _FALSE else text
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        return text


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
