"""The divergence meter in vLLM: per request, the drafts verified and kept and the exact KL spent.

For every verified position whose token the sampler emitted (the accepted drafts and the
one recovered at the first rejection; the bonus token is drawn from q and costs nothing)
the meter adds KL(law || q), the exact divergence of that step's emitted law from the q
the request samples from (after temperature, top-k, top-p and penalties). The engine's
meter computes it: each row's kind (``runtime.verifications``, a chain or a block here)
gives ``divergences`` for the positions of all rows of one rule at once, exact at any
vocabulary for one-hot drafts (greedy drafting, n-gram), on q's support for drafts with
probabilities (NaN, "not measured", where that exceeds ``audit.MAX_AUDIT_SUPPORT``), and
KL(t || q) for a block, which emits its rule's target t at every drafted position (the
sampler hands those over from judging the block, where t was solved).

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

from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.verifications import Verification

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
                Tally(chain.spec.method, dict(chain.spec.params), chain.kind.name),
            )
            tally.drafted += chain.drafted
            tally.accepted += min(chain.emitted - 1, chain.drafted)
            tally.positions += chain.positions
            if chain.positions and not chain.spec.lossless:
                by_rule[chain.spec.rule, chain.kind.emits_targets].append(chain)
        for (rule, targets), group in by_rule.items():
            if targets and block_kl is None:
                raise ValueError("block_kl must hold the divergences of the blocks judged")
            index = _positions(group)  # [P]
            if targets:
                per_position = block_kl[index]  # [P], solved where the blocks were judged
            else:
                rows_p = None if p is None else p[index].float()
                per_position = group[0].kind.divergences(
                    rule, q[index], q[index], draft_ids[index].long(), rows_p
                )
            for chain, value in zip(group, _sums(group, per_position), strict=True):
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
            line["kl_nats"] = None if not math.isfinite(tally.kl_nats) else tally.kl_nats
            line["kl_unbounded"] = math.isinf(tally.kl_nats)  # not NaN: not measured
            out_line = json.dumps(line, allow_nan=False)
            with open(path, "a", encoding="utf-8") as out:
                out.write(out_line + "\n")
        if self.export is not None:
            self.export(tally)
        return tally


@dataclass(frozen=True)
class Chain:
    """One request's verified drafts in a batch: at [start, start + drafted) of the flattened
    token axis, judged by its row's ``kind`` (``runtime.verifications``: a chain or a block),
    of which the sampler emitted ``emitted`` tokens."""

    request_id: str
    spec: DecodeSpec
    start: int
    drafted: int
    emitted: int
    kind: Verification

    @property
    def positions(self) -> int:
        """Verified positions that emitted a token (the bonus token is not one)."""
        return min(self.emitted, self.drafted)


def _positions(chains: list[Chain]) -> Tensor:
    """The flattened token axis's indices of the chains' emitted positions -> [P]."""
    return torch.cat([torch.arange(c.start, c.start + c.positions) for c in chains])


def _sums(chains: list[Chain], per_position: Tensor) -> list[float]:
    """``per_position`` [P] summed per chain (its ``positions`` consecutive entries)."""
    owner = torch.repeat_interleave(torch.tensor([c.positions for c in chains]))  # [P]
    per_position = per_position.double().cpu()
    sums = torch.zeros(len(chains), dtype=torch.float64).index_add_(0, owner, per_position)
    return sums.tolist()
