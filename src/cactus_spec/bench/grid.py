"""Configurations to compare: method × its parameters × K (num_draft_tokens) × drafter ×
verification.

Methods are the engine's (the registry in ``methods``: ar, sps, cactus, tas, interp, topk) and
peers: Hugging Face's ``hf`` (plain ``generate`` on the verifier) and ``hf_assisted``
(``generate(assistant_model=draft)``, or prompt lookup with the n-gram drafter), and
llama.cpp's ``llamacpp`` (plain decoding of the verifier's GGUF) and ``llamacpp_lookup``
(its prompt-lookup decoding, parameter ``num_pred_tokens``).

On the command line a method entry reads ``NAME[:KEY=V1,V2...]...``, for instance
``cactus:delta=0.5,1:exact=false,true``; a file (TOML or JSON) holds the same entries::

    num_draft_tokens = [6]          # optional: default for every entry
    drafter = "model"               # optional: a name of core.drafters.DRAFTERS, or a list
    [[methods]]
    method = "cactus"
    delta = [0.5, 1.0]
    exact = [false, true]

Each entry expands to the product of its value lists; KEY may also be ``num_draft_tokens``,
``drafter``, ``verification`` (``chain``, ``block``, ``tree`` or ``traversal``:
``sps:verification=chain,block``) or ``branches`` (a tree's nodes per depth:
``sps:verification=tree:branches=2,4``), overriding the defaults for that entry (K ``auto``
leaves the draft length to the engine's policy: per iteration, and stopped inside it by the
draft's confidence), ``draft`` (a draft model other than the run's ``--draft``, by name or
path, for the engine's methods: one with another tokenizer drafts across vocabularies,
``sps:draft=smollm2-135m``), ``draft_vocab`` (the draft's LM head cut to its N most frequent
tokens, of the entry's draft model or else the run's: ``sps:draft_vocab=32768``; default:
``--draft-vocab``), ``draft_quant`` (the draft's weights, ``none``, ``int8`` or ``int4``, of
the entry's draft model or else the run's: ``cactus:draft_quant=int8,int4`` times both formats
item by item in one run; default: ``--draft-quant``), or ``verifier`` (the verifier's
weights, ``none``, ``int8`` or ``int4``; default: ``--verifier-quant``) for every method but
llama.cpp's, which runs the GGUF itself: ``cactus:delta=1:verifier=none,int8`` compares both
in one run. Cactus entries also take
``kl_budget`` and ``allocation`` (an answer's divergence budget, ``core.budget``):
``cactus:kl_budget=0.1,0.5:allocation=greedy,paced``.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cactus_spec.backends.quant import QUANTS
from cactus_spec.core.checks import check_int
from cactus_spec.core.drafters import DEFAULT_DRAFTER, DRAFTERS, drafts_without_a_model
from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS, METHODS
from cactus_spec.core.spec import (
    AUTO_K,
    BUDGET_KEYS,
    BUDGET_METHODS,
    TREES,
    DecodeSpec,
    parse_spec,
)

HF_METHODS = ("hf", "hf_assisted")
LLAMACPP_METHODS = ("llamacpp", "llamacpp_lookup")
#: The peers a grid may name beside the engine's methods (``core.methods.METHODS``), with
#: their parameters' defaults.
PEERS: dict[str, dict[str, int]] = {
    "hf": {},
    "hf_assisted": {},
    "llamacpp": {},
    "llamacpp_lookup": {"num_pred_tokens": 10},  # llama-cpp-python's default
}
#: Every method a grid may name: the engine's, then the peers.
NAMES = (*METHODS, *PEERS)
#: The drafters of a peer that drafts: Hugging Face's assistant model, or its prompt lookup.
PEER_DRAFTERS = ("model", "ngram")
#: Methods that take no K and no drafter (they draft nothing, or draft their own way).
NO_DRAFT = (*(name for name, m in METHODS.items() if not m.drafts), "hf", *LLAMACPP_METHODS)
_DRAFT_KEYS = (
    "num_draft_tokens", "drafter", "verification", "branches", "draft", "draft_vocab",
    "draft_quant",
)  # fmt: skip

Entry = tuple[str, dict[str, list]]


@dataclass(frozen=True)
class Config:
    """One configuration: ``method``, an engine method or a peer, and ``decoding``, how it
    decodes, read once by ``parse_spec``: an engine method's spec (its parameters, an
    answer's budget, K, drafter, verification, branches; K None: left to the policy), or a
    peer's K and drafter as SpS's spec (AR's for a peer that drafts nothing), the peer's own
    parameters in ``peer_params``. ``verifier``: the verifier's weights (llama.cpp runs the
    GGUF's own); ``draft``: another draft model (name or path; None: the run's ``--draft``);
    ``draft_vocab``: its head cut to the N most frequent tokens (None: the run's);
    ``draft_quant``: its weights (None: the run's)."""

    method: str
    decoding: DecodeSpec
    peer_params: tuple[tuple[str, object], ...] = ()
    verifier: str = "none"
    draft: str | None = None
    draft_vocab: int | None = None
    draft_quant: str | None = None

    @property
    def params(self) -> tuple[tuple[str, object], ...]:
        """Every parameter of the method, defaults filled, sorted by name."""
        if not self.engine:
            return self.peer_params
        return tuple(sorted((dict(self.decoding.params) | _budget(self.decoding)).items()))

    @property
    def num_draft_tokens(self) -> int | None:
        """K: 0 for a method that drafts nothing, None when the policy picks it."""
        return self.decoding.num_draft_tokens if self.drafts else 0

    @property
    def drafter(self) -> str | None:
        """None for a method that drafts nothing."""
        return self.decoding.drafter if self.drafts else None

    @property
    def prompt_lookup(self) -> bool:
        """Whether it is Hugging Face's prompt lookup: ``hf_assisted`` with a drafter that
        needs no draft model."""
        return self.method == "hf_assisted" and drafts_without_a_model(self.drafter)

    @property
    def verification(self) -> str:
        """How the engine judges its drafts (``core.spec.VERIFICATIONS``; chain for peers)."""
        return (self.decoding.verification or "chain") if self.engine else "chain"

    @property
    def branches(self) -> int:
        """A tree's nodes per depth (1 unless a tree)."""
        return self.decoding.branches if self.engine else 1

    @property
    def draft_key(self) -> str | None:
        """Which loaded draft it drafts with: None for the run's (``--draft`` with
        ``--draft-vocab`` and ``--draft-quant``), else the model's name, with `` vocab=N`` for
        a cut head and `` quant=Q`` for other weights (``--draft vocab=N``: the run's draft
        model)."""
        if self.draft_vocab is None and self.draft_quant is None:
            return self.draft
        words = [self.draft or "--draft"]
        words += [] if self.draft_vocab is None else [f"vocab={self.draft_vocab}"]
        words += [] if self.draft_quant is None else [f"quant={self.draft_quant}"]
        return " ".join(words)

    @property
    def drafts(self) -> bool:
        return self.method not in NO_DRAFT

    @property
    def engine(self) -> bool:
        """Whether our engine runs it (else a peer: Hugging Face or llama.cpp)."""
        return self.method in METHODS

    @property
    def spec(self) -> DecodeSpec:
        """The decoding spec of an engine method (ValueError for a peer)."""
        if not self.engine:
            raise ValueError(f"{self.method} is a peer, not a method of the engine")
        return self.decoding

    @property
    def id(self) -> str:
        """A stable key, e.g. ``cactus(delta=0.5,exact=false)/K6/model`` (``=NAME`` after the
        drafter for another draft model, ``/vocabN`` after it for a draft head cut to N tokens,
        ``/block`` appended for block verification,
        ``/draft-int4`` after that for a draft in int4 weights, ``/block`` appended for block
        verification, ``/tree2`` for trees of two nodes per depth judged top down,
        ``/traversal2`` leaf to root, ``@int8`` for an int8 verifier)."""
        body = ",".join(f"{k}={_format(v)}" for k, v in self.params)
        head = f"{self.method}({body})" if body else self.method
        head = f"{head}/K{_k_text(self.num_draft_tokens)}/{self.drafter}" if self.drafts else head
        head = head if self.draft is None else f"{head}={self.draft}"
        head = head if self.draft_vocab is None else f"{head}/vocab{self.draft_vocab}"
        head = head if self.draft_quant is None else f"{head}/draft-{self.draft_quant}"
        head = f"{head}/{self._judged}" if self.verification != "chain" else head
        return head if self.verifier == "none" else f"{head}@{self.verifier}"

    @property
    def label(self) -> str:
        """A short name for tables and plots, e.g. ``cactus d=0.5 exact K6``."""
        words = [self.method]
        for name, value in self.params:
            if isinstance(value, bool):
                words += [name] if value else []
            else:
                words.append(f"{'d' if name == 'delta' else name}={_format(value)}")
        if self.drafts:
            words.append(f"K{_k_text(self.num_draft_tokens)}")
            words += [] if self.drafter == DEFAULT_DRAFTER else [str(self.drafter)]
            words += [] if self.draft is None else [f"draft={Path(self.draft).name}"]
            words += [] if self.draft_vocab is None else [f"vocab={self.draft_vocab}"]
            words += [] if self.draft_quant is None else [f"draft-{self.draft_quant}"]
            words += [self._judged] if self.verification != "chain" else []
        words += [] if self.verifier == "none" else [f"{self.verifier}-verifier"]
        return " ".join(words)

    @property
    def _judged(self) -> str:
        """``block``, ``tree2`` (two nodes per depth), ``traversal2``, ... or ``chain``."""
        tree = self.verification in TREES
        return f"{self.verification}{self.branches}" if tree else self.verification

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "label": self.label,
            "method": self.method,
            "params": dict(self.params),
            "num_draft_tokens": self.num_draft_tokens,
            "drafter": self.drafter,
            "verifier": self.verifier,
            "verification": self.verification,
            **({"draft": self.draft} if self.draft is not None else {}),  # as recorded before
            **({"draft_vocab": self.draft_vocab} if self.draft_vocab is not None else {}),
            **({"draft_quant": self.draft_quant} if self.draft_quant is not None else {}),
            **({"branches": self.branches} if self.verification in TREES else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        """The configuration ``as_dict`` describes (as a run directory records it), read
        again by ``make_config``."""
        method = data["method"]
        drafting = method not in NO_DRAFT
        k = data["num_draft_tokens"]
        judged = method in METHODS and drafting
        return make_config(
            method,
            data["params"],
            (AUTO_K if k is None else k) if drafting else None,
            data["drafter"] if drafting else None,
            data["verifier"],
            data.get("verification") if judged else None,  # runs before blocks: chain
            data.get("draft"),  # runs recorded before other draft models
            data.get("branches") if judged else None,
            data.get("draft_vocab"),  # runs recorded before cut draft heads
            data.get("draft_quant"),  # and before a grid's draft weights
        )


def _k_text(k: int | None) -> str:
    return "auto" if k is None else str(k)


def _format(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def make_config(
    method: str,
    params: Mapping[str, object],
    k: object = None,
    drafter: object = None,
    verifier: str = "none",
    verification: object = None,
    draft: object = None,
    branches: object = None,
    draft_vocab: object = None,
    draft_quant: object = None,
) -> Config:
    """A validated configuration; values may be text (the command line). An engine method's
    parameters, K, drafter and verification are read by ``core.spec.parse_spec``, a peer's K
    and drafter by the same rules (a peer verifies its own way: verification and draft are
    refused); unknown methods, parameters or values raise ValueError."""
    if method not in NAMES:
        raise ValueError(f"method must be one of {', '.join(NAMES)}, got {method!r}")
    allowed: Mapping[str, object] = METHODS[method].defaults if method in METHODS else PEERS[method]
    allowed = {**allowed, **dict.fromkeys(BUDGET_KEYS)} if method in BUDGET_METHODS else allowed
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        keys = [*allowed, *(_DRAFT_KEYS if method not in NO_DRAFT else ())]
        keys += [] if method in LLAMACPP_METHODS else ["verifier"]
        raise ValueError(
            f"{method} does not take {', '.join(unknown)} (it takes {', '.join(keys)})"
        )
    if verifier not in QUANTS:
        raise ValueError(f"{method}: verifier must be one of {', '.join(QUANTS)}, got {verifier!r}")
    verifier = "none" if method in LLAMACPP_METHODS else verifier  # it runs the GGUF
    auto = isinstance(k, str) and k.strip() == AUTO_K
    if auto and method not in METHODS:
        raise ValueError(f"{method} is a peer: num_draft_tokens {AUTO_K} does not apply")
    k = None if auto else k
    drafting = {"num_draft_tokens": k, "drafter": drafter} if method not in NO_DRAFT else {}
    for name, value in (("verification", verification), ("branches", branches)):
        if value is not None and method not in METHODS:
            raise ValueError(f"{method} is a peer: {name} does not apply")
    _check_peer_drafter(method, drafter)
    draft = _draft_model(method, draft, drafter)
    draft_vocab = _draft_vocab(method, draft_vocab, drafter)
    draft_quant = _draft_quant(method, draft_quant, drafter)
    try:
        if method in METHODS:
            judged = {"verification": verification, "branches": branches}
            judged = judged if method not in NO_DRAFT else {}
            spec = parse_spec({"method": method, **params, **drafting, **judged}, text=True)
            peer: dict[str, object] = {}
        else:  # a peer's K and drafter, read as SpS's
            base = {"method": "sps", **drafting} if method not in NO_DRAFT else {"method": "ar"}
            spec = parse_spec(base, text=True)
            peer = {name: _peer_int(name, params.get(name, d)) for name, d in allowed.items()}
    except ValueError as err:
        raise ValueError(f"{method}: {err}") from None
    spec = spec.with_num_draft_tokens(None) if auto and method not in NO_DRAFT else spec
    peer_params = tuple(sorted(peer.items()))
    return Config(method, spec, peer_params, verifier, draft, draft_vocab, draft_quant)


def _budget(spec: DecodeSpec) -> dict[str, object]:
    """An answer's budget and its allocation as a configuration's parameters, when set."""
    if spec.kl_budget is None:
        return {}
    return {"kl_budget": spec.kl_budget, "allocation": spec.allocation}


def _draft_model(method: str, draft: object, drafter: object) -> str | None:
    """A draft model named for an engine method that drafts with the model drafter."""
    if draft is None:
        return None
    _model_drafter_only(method, "draft", drafter, " (it drafts with --draft)")
    if not isinstance(draft, str) or not draft.strip():
        raise ValueError(f"{method}: draft must be a model name or path, got {draft!r}")
    return draft.strip()


def _draft_vocab(method: str, size: object, drafter: object) -> int | None:
    """The head size named for an engine method that drafts with the model drafter."""
    if size is None:
        return None
    _model_drafter_only(method, "draft_vocab", drafter)
    try:
        return check_int("draft_vocab", _peer_int("draft_vocab", size))
    except ValueError as err:
        raise ValueError(f"{method}: {err}") from None


def _draft_quant(method: str, quant: object, drafter: object) -> str | None:
    """The draft weights named for an engine method that drafts with the model drafter."""
    if quant is None:
        return None
    _model_drafter_only(method, "draft_quant", drafter)
    if _text(quant) not in QUANTS:
        raise ValueError(f"{method}: draft_quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    return _text(quant)


def _model_drafter_only(method: str, key: str, drafter: object, peer_note: str = "") -> None:
    """ValueError unless ``method`` is the engine's and drafts with a drafter that needs a
    draft model (the default one when ``drafter`` is None; an unknown name is left to
    ``parse_spec``)."""
    if method not in METHODS:
        raise ValueError(f"{method} is a peer: {key} does not apply{peer_note}")
    kind = DRAFTERS.get(_text(drafter)) if drafter is not None else None
    if kind is not None and not kind.needs_draft_model:
        takers = " or ".join(d.name for d in DRAFTERS.values() if d.needs_draft_model)
        raise ValueError(f"{method}: {key} applies to the {takers} drafter, not {drafter}")


def _check_peer_drafter(method: str, drafter: object) -> None:
    """ValueError unless a peer that drafts drafts its own way (``PEER_DRAFTERS``)."""
    drafts = method in PEERS and method not in NO_DRAFT and drafter is not None
    if drafts and _text(drafter) not in PEER_DRAFTERS:
        allowed = ", ".join(PEER_DRAFTERS)
        raise ValueError(f"{method}: drafter must be one of {allowed}, got {drafter!r}")


def _peer_int(name: str, value: object) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)  # type: ignore[call-overload]  # any other type: TypeError, caught
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def expand(
    entries: Iterable[Entry],
    ks: Sequence[int | str] | None = None,
    drafters: Sequence[str] = (DEFAULT_DRAFTER,),
    verifiers: Sequence[str] = ("none",),
    verifications: Sequence[str | None] = (None,),
    drafts: Sequence[str | None] = (None,),
    branches: Sequence[int | None] = (None,),
    draft_vocabs: Sequence[int | None] = (None,),
    draft_quants: Sequence[str | None] = (None,),
) -> tuple[Config, ...]:
    """Every configuration of every entry, in order, without duplicates. ``verifiers``: the
    verifier formats of entries that name none (llama.cpp's always run the GGUF);
    ``verifications``: how the engine's drafting entries that name none judge drafts
    (None: chain); ``drafts``: their draft models (None: the run's); ``branches``: their
    trees' nodes per depth (None: the default, for trees); ``draft_vocabs``: their draft heads
    (None: the draft's own); ``draft_quants``: their draft weights (None: the run's)."""
    ks = list(ks or [DEFAULT_NUM_DRAFT_TOKENS])
    configs: dict[str, Config] = {}
    for method, lists in entries:
        if method in NO_DRAFT and set(lists) & set(_DRAFT_KEYS):
            raise ValueError(f"{method} drafts nothing: {', '.join(_DRAFT_KEYS)} do not apply")
        if method in LLAMACPP_METHODS and "verifier" in lists:
            raise ValueError(f"{method} runs the verifier's GGUF itself: verifier does not apply")
        k_values = lists.get("num_draft_tokens", ks)
        drafter_values = lists.get("drafter", drafters)
        verifier_values = [_text(v) for v in lists.get("verifier", verifiers)]
        judged = lists.get("verification", verifications if method in METHODS else [None])
        draft_values = lists.get("draft", drafts if method in METHODS else [None])
        widths = lists.get("branches", branches if method in METHODS else [None])
        heads = lists.get("draft_vocab", draft_vocabs if method in METHODS else [None])
        formats = lists.get("draft_quant", draft_quants if method in METHODS else [None])
        if "branches" in lists and not set(TREES) & {_text(v) for v in judged}:
            raise ValueError(
                f"{method}: branches applies to verification {' or '.join(TREES)} only"
            )
        names = [name for name in lists if name not in (*_DRAFT_KEYS, "verifier")]
        axes = (*(lists[name] for name in names), k_values, drafter_values, verifier_values)
        for combo in itertools.product(*axes, judged, draft_values, widths, heads, formats):
            *values, k, drafter, verifier, verification, draft, width, head, quant = combo
            params = dict(zip(names, values, strict=True))
            config = make_config(
                method,
                params,
                k,
                drafter,
                verifier,
                verification,
                draft,
                _tree_only(width, verification),
                head,
                quant,
            )
            configs.setdefault(config.id, config)
    if not configs:
        raise ValueError("the grid holds no configuration")
    return tuple(configs.values())


def _tree_only(width: object, verification: object) -> object:
    """A width applies to the trees of an entry's product (``verification = ["chain",
    "tree"]`` with ``branches = [2, 4]``: chains, trees of 2 and of 4), not its chains."""
    return width if verification is not None and _text(verification) in TREES else None


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) else str(value)


def parse_entry(spec: str) -> Entry:
    """``cactus:delta=0.5,1:exact=true`` -> ("cactus", {"delta": ["0.5", "1"], "exact": ...})."""
    method, *pairs = spec.strip().split(":")
    lists: dict[str, list] = {}
    for pair in pairs:
        name, sep, values = pair.partition("=")
        if not sep or not name.strip() or not values.strip():
            raise ValueError(f"method entry {spec!r}: expected KEY=V1,V2 after ':', got {pair!r}")
        lists[name.strip()] = [v for v in values.split(",") if v.strip()]
    return method.strip(), lists


def parse_list(text: str) -> list[str]:
    """A comma-separated command-line list: "4,6" -> ["4", "6"]."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return values


def load_grid_file(path: str | Path, verifier: str = "none") -> tuple[Config, ...]:
    """Configurations from a TOML or JSON grid file; ``verifier``: the verifier format of a
    file that names none (``--verifier-quant``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"grid file {path} does not exist")
    raw = _read_structured(path)
    unknown = sorted(set(raw) - {"methods", "verifier", *_DRAFT_KEYS})
    if unknown:
        raise ValueError(f"grid file {path}: unknown keys {', '.join(unknown)}")
    methods = raw.get("methods")
    if not isinstance(methods, list) or not methods:
        raise ValueError(f"grid file {path}: needs a non-empty list of [[methods]] entries")
    entries = [_file_entry(entry, path) for entry in methods]
    ks = _listed(raw.get("num_draft_tokens", [DEFAULT_NUM_DRAFT_TOKENS]))
    drafters = _listed(raw.get("drafter", [DEFAULT_DRAFTER]))
    verifiers = _listed(raw.get("verifier", [verifier]))
    verifications = _listed(raw.get("verification", [None]))
    drafts = _listed(raw.get("draft", [None]))
    widths = _listed(raw.get("branches", [None]))
    heads = _listed(raw.get("draft_vocab", [None]))
    quants = _listed(raw.get("draft_quant", [None]))
    return expand(entries, ks, drafters, verifiers, verifications, drafts, widths, heads, quants)


def _read_structured(path: Path) -> dict:
    text = path.read_text()
    try:
        if path.suffix == ".json":
            return json.loads(text)
        if path.suffix == ".toml":
            return _toml().loads(text)
    except ValueError as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"grid file {path}: {err}") from None
    raise ValueError(f"grid file {path}: expected a .toml or .json file")


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib
    return tomllib


def _file_entry(entry: object, path: Path) -> Entry:
    if not isinstance(entry, dict) or not isinstance(entry.get("method"), str):
        raise ValueError(f'grid file {path}: every [[methods]] entry needs method = "NAME"')
    lists = {name: _listed(value) for name, value in entry.items() if name != "method"}
    return entry["method"], lists


def _listed(value: object) -> list:
    return list(value) if isinstance(value, list) else [value]


DEFAULT_ENTRIES: list[Entry] = [
    ("ar", {}),
    ("hf", {}),
    ("hf_assisted", {}),
    ("llamacpp", {}),
    ("llamacpp_lookup", {}),
    ("sps", {}),
    ("tas", {"epsilon": [0.03, 0.09, 0.3]}),
    ("interp", {}),
    ("topk", {}),
    ("cactus", {"delta": [0.25, 0.5, 0.75, 1.0, 2.0], "exact": [False, True]}),
]
QUICK_ENTRIES: list[Entry] = [
    ("ar", {}),
    ("hf", {}),
    ("hf_assisted", {}),
    ("sps", {}),
    ("tas", {}),
    ("cactus", {"delta": [1.0], "exact": [False, True]}),
]
