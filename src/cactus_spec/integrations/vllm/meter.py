"""The divergence meter in vLLM: per request, the drafts verified and kept and the exact KL spent.

For every verified position whose token the sampler emitted (the accepted drafts and the
one recovered at the first rejection; the bonus token is drawn from q and costs nothing)
the meter adds KL(law || q), the exact divergence of that step's emitted law from the q
the request samples from (after temperature, top-k, top-p and penalties):

- one-hot drafts (greedy drafting, n-gram): ``audit.one_hot_divergences``, exact at any
  vocabulary;
- drafts with probabilities: ``audit.step_divergences``, exact on each position's verifier
  support, NaN ("not measured") when that exceeds ``audit.MAX_AUDIT_SUPPORT`` tokens (no
  top-k or top-p);
- blocks (``verification = block``): the block emits its rule's target t at every drafted
  position, so the law is t and the meter adds KL(t || q), exact at any vocabulary (the
  sampler hands it over from judging the block, where t was solved).

When a request finishes (the worker learns it at its next step), the worker logs one line,
appends one JSON line (request id, method, params, verification, drafted, accepted,
emitted positions, kl_nats) to the file ``CACTUS_SPEC_VLLM_METER`` names, if any, and hands
the tally to ``export`` (the plugin's Prometheus counters).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from cactus_spec.core.audit import one_hot_divergences, step_divergences
from cactus_spec.core.rules import Rule
from cactus_spec.core.spec import DecodeSpec

METER_FILE_ENV = "CACTUS_SPEC_VLLM_METER"
logger = logging.getLogger("vllm.cactus_spec")  # under vLLM's logger: its handlers and level


@dataclass
class Tally:
    """One request's counts so far."""

    method: str
    params: dict
    verification: str  # chain or block
    drafted: int = 0
    accepted: int = 0
    positions: int = 0  # verified positions that emitted a token
    kl_nats: float = 0.0  # NaN once a position could not be measured


class Meter:
    """Tallies by request id, filled by the sampler and closed when a request finishes;
    ``export`` receives each closed tally (the plugin's Prometheus counters)."""

    def __init__(self, export: Callable[[Tally], None] | None = None) -> None:
        self.tallies: dict[str, Tally] = {}
        self.export = export
        self.active = True  # False on a worker whose requests another worker meters

    def record(
        self,
        chains: list[Chain],
        q: Tensor,  # [T, V] the batch's processed verifier rows
        draft_ids: Tensor,  # [T]
        p: Tensor | None,  # [T, V], None for one-hot drafts
        block_kl: Tensor | None = None,  # [T] KL(t || q) per drafted position of each block
    ) -> None:
        """Add one verified chain (or block) per request; lossy rules' chain divergences in one
        call per rule, blocks' read from ``block_kl``. Nothing when not ``active``."""
        if not self.active:
            return
        by_rule: dict[tuple[object, bool], list[Chain]] = defaultdict(list)
        for chain in chains:
            tally = self.tallies.setdefault(
                chain.request_id,
                Tally(chain.spec.method, dict(chain.spec.params), chain.kind),
            )
            tally.drafted += chain.drafted
            tally.accepted += min(chain.emitted - 1, chain.drafted)
            tally.positions += chain.positions
            if chain.positions and not chain.spec.lossless:
                by_rule[chain.spec.rule, chain.block].append(chain)
        for (rule, block), group in by_rule.items():
            if block and block_kl is None:
                raise ValueError("block_kl must hold the divergences of the blocks judged")
            nats = (
                _sums(group, block_kl[_positions(group)])
                if block
                else _divergences(rule, group, q, draft_ids, p)
            )
            for chain, value in zip(group, nats, strict=True):
                self.tallies[chain.request_id].kl_nats += value

    def finish(self, request_id: str) -> Tally | None:
        """Close a request: log its line, append its JSON line, forget it."""
        tally = self.tallies.pop(request_id, None)
        if tally is None:
            return None
        kl = "not measured (no top-k)" if math.isnan(tally.kl_nats) else f"{tally.kl_nats:.4f}"
        logger.info(
            "cactus-spec request %s: %s on %ss, accepted %d of %d drafts, KL %s nats over %d "
            "positions",
            request_id,
            tally.method,
            tally.verification,
            tally.accepted,
            tally.drafted,
            kl,
            tally.positions,
        )
        path = os.environ.get(METER_FILE_ENV)
        if path:
            line = {"request_id": request_id, **asdict(tally)}
            line["kl_nats"] = None if math.isnan(tally.kl_nats) else tally.kl_nats
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")
        if self.export is not None:
            self.export(tally)
        return tally


@dataclass(frozen=True)
class Chain:
    """One request's verified drafts in a batch: at [start, start + drafted) of the flattened
    token axis, judged as a block or as a chain, of which the sampler emitted ``emitted``
    tokens."""

    request_id: str
    spec: DecodeSpec
    start: int
    drafted: int
    emitted: int
    block: bool

    @property
    def kind(self) -> str:
        return "block" if self.block else "chain"

    @property
    def positions(self) -> int:
        """Verified positions that emitted a token (the bonus token is not one)."""
        return min(self.emitted, self.drafted)


def _divergences(
    rule: Rule, chains: list[Chain], q: Tensor, ids: Tensor, p: Tensor | None
) -> list[float]:
    """Each chain's KL(law || q) summed over its emitted positions; q [T, V], ids [T].

    One audit call for the whole group; a position it cannot measure (its verifier support
    is too large) is NaN, and so is its chain's sum, the others are measured."""
    index = _positions(chains)  # [P]
    if p is None:
        per_position = one_hot_divergences(q[index], ids[index].long(), rule)  # [P]
    else:
        per_position = step_divergences(p[index].float(), q[index], rule)  # [P]
    return _sums(chains, per_position)


def _positions(chains: list[Chain]) -> Tensor:
    """The flattened token axis's indices of the chains' emitted positions -> [P]."""
    return torch.cat([torch.arange(c.start, c.start + c.positions) for c in chains])


def _sums(chains: list[Chain], per_position: Tensor) -> list[float]:
    """``per_position`` [P] summed per chain (its ``positions`` consecutive entries)."""
    owner = torch.repeat_interleave(torch.tensor([c.positions for c in chains]))  # [P]
    per_position = per_position.double().cpu()
    sums = torch.zeros(len(chains), dtype=torch.float64).index_add_(0, owner, per_position)
    return sums.tolist()
