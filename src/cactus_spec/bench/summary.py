"""Per-configuration figures from the rows of a run.

Speed: tokens/s per item, and the speedup as the per-item ratio to the verifier alone
(``ar``) on the same item: median [min, max]. Acceptance and divergence are pooled over
items: alpha = accepted / reached, mean accepted = accepted / iterations, KL per token =
sum of KL / sum of new tokens, KL per sequence = mean (and max) over items; an answer's
budget adds its Pinsker bound sqrt(B/2) and the share of per-position Cactus's gain in mean
accepted length over SpS it keeps, and drafting configurations their per-item tokens/s over
chain SpS with the same drafting. Accuracy: Wilson
interval, and the paired difference from ``ar`` on the items both ran (``stats``), when
rows carry ``correct`` (and the same for ``correct_fallback``, gsm's last-number reading).
Batched runs add each configuration's throughput: its tokens over the wall time of its
batches (batches.jsonl), counting only batches whose items are all current.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from cactus_spec.bench.bound import measured_bound
from cactus_spec.bench.grid import Config
from cactus_spec.bench.stats import Interval, median_spread, paired_difference, wilson
from cactus_spec.bench.tasks import Item
from cactus_spec.core.audit import reported_kl
from cactus_spec.core.budget import pinsker_bound
from cactus_spec.core.spec import BUDGET_KEYS

_SUMMED = ("iterations", "drafted", "accepted", "new_tokens")
_SUMMED_TIMES = ("time_draft_s", "time_verify_s", "time_total_s")

Rows = dict[str, dict]  # item id -> row


def _totals(rows: Rows) -> dict:
    """Sums over items of the engine's counters, timers and per-position counts."""
    totals = {key: sum(r[key] for r in rows.values()) for key in _SUMMED + _SUMMED_TIMES}
    width = max(len(r["reached_by_position"]) for r in rows.values())
    for key in ("reached_by_position", "accepted_by_position"):
        totals[key] = [sum(_at(r[key], j) for r in rows.values()) for j in range(width)]
    totals["reached"] = sum(totals["reached_by_position"])
    return totals


def _at(values: list[int], j: int) -> int:
    return values[j] if j < len(values) else 0


def _shares(totals: dict) -> dict[str, float]:
    """Fractions of the wall time spent in draft forwards, verifier forwards and the rest
    (sampling, verification, the divergence meter, Python)."""
    total = totals["time_total_s"] or 1.0
    draft, verify = totals["time_draft_s"] / total, totals["time_verify_s"] / total
    return {"draft": draft, "verify": verify, "other": max(0.0, 1 - draft - verify)}


def _speed(rows: Rows, ar: Rows | None) -> dict:
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows.values()),
        "new_tokens_mean": statistics.mean(r["new_tokens"] for r in rows.values()),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows.values()),
        "speedup": None,
    }
    ratio = speed_ratio(rows, ar)
    if ratio is not None:
        out["speedup"] = ratio.as_list()
    return out


def speed_ratio(rows: Rows, reference: Rows | None) -> Interval | None:
    """Per-item tokens/s of ``rows`` over ``reference`` (both keyed by item), on the items
    both hold: median [min, max]; None when they share no item."""
    if not reference:
        return None
    shared = [i for i in rows if i in reference and reference[i]["tokens_per_s"] > 0]
    if not shared:
        return None
    return median_spread([rows[i]["tokens_per_s"] / reference[i]["tokens_per_s"] for i in shared])


def _divergence(rows: Rows, new_tokens: int) -> dict:
    """The meter per token, per answer and its largest answer; None for each, with
    ``kl_unbounded`` true, where an answer's divergence was unbounded (its row's
    ``kl_nats`` None, or inf in a run written before ``kl_unbounded``)."""
    spent = [math.inf if r["kl_nats"] is None else r["kl_nats"] for r in rows.values()]
    figures = {
        "kl_nats_per_token": sum(spent) / max(1, new_tokens),
        "kl_nats_per_sequence": statistics.mean(spent),
        "kl_nats_per_sequence_max": max(spent),
    }
    finite = {name: reported_kl(value)["kl_nats"] for name, value in figures.items()}
    return {**finite, "kl_unbounded": not math.isfinite(sum(spent))}


def _engine(config: Config, rows: Rows, ar: Rows | None) -> dict:
    """Acceptance, time shares, divergence and the i.i.d. bound of an engine method."""
    totals = _totals(rows)
    out = {
        "iterations": totals["iterations"],
        "tokens_per_iteration": totals["new_tokens"] / max(1, totals["iterations"]),
        "time_shares": _shares(totals),
        **_divergence(rows, totals["new_tokens"]),
    }
    budget = dict(config.params).get("kl_budget")  # a float (check_budget) when set
    out |= {} if budget is None else {"kl_budget": budget, "tv_bound": pinsker_bound(budget)}  # type: ignore[arg-type]
    if not config.drafts:
        return out
    reached, accepted = totals["reached_by_position"], totals["accepted_by_position"]
    out |= {
        "mean_accepted": totals["accepted"] / max(1, totals["iterations"]),
        "acceptance_by_position": [
            a / r if r else None for a, r in zip(accepted, reached, strict=True)
        ],
        "alpha": totals["accepted"] / max(1, totals["reached"]),
    }
    ar_rows = [ar[i] for i in rows if ar and i in ar]
    if ar_rows:
        ar_step_s = sum(r["time_verify_s"] for r in ar_rows) / sum(r["iterations"] for r in ar_rows)
        bound = measured_bound(totals, ar_step_s)
        out |= {"k_effective": bound.k, "c": bound.c, "v": bound.v, "bound": bound.speedup}
    return out


def _accuracy(config: Config, rows: Rows, ar: Rows | None, key: str = "correct") -> dict:
    """Wilson interval of ``key`` and the paired difference from ``ar`` (figures named
    after ``key``'s suffix: ``accuracy``, ``accuracy_fallback``)."""
    suffix = key.removeprefix("correct")
    outcomes = [bool(r.get(key)) for r in rows.values()]
    out = {
        f"correct{suffix}": sum(outcomes),
        f"accuracy{suffix}": wilson(sum(outcomes), len(outcomes)).as_list(),
        f"difference_vs_ar{suffix}": None,
    }
    shared = [i for i in rows if ar and i in ar]
    if shared and rows is not ar:  # every configuration but the reference itself
        assert ar is not None  # the shared items are its
        mine = [bool(rows[i].get(key)) for i in shared]
        theirs = [bool(ar[i].get(key)) for i in shared]
        out[f"difference_vs_ar{suffix}"] = paired_difference(mine, theirs).as_list()
    return out


def _throughput(config: Config, batches: Sequence[dict], wanted: set[str]) -> dict:
    """Tokens per second of the configuration's batches (batched runs only)."""
    mine = [b for b in batches if b["config"] == config.id and wanted.issuperset(b["items"])]
    wall = sum(b["wall_s"] for b in mine)
    if not wall:
        return {}
    return {"throughput_tokens_per_s": sum(b["new_tokens"] for b in mine) / wall}


def summarise_config(config: Config, rows: Rows, ar: Rows | None, scored: bool) -> dict:
    """Every figure of one configuration; ``ar``: the verifier-alone rows by item."""
    out = {**config.as_dict(), "n": len(rows)}
    if not rows:
        return out
    out |= _speed(rows, ar)
    if config.engine:
        out |= _engine(config, rows, ar)
    if scored:
        out |= _accuracy(config, rows, ar)
        if any("correct_fallback" in r for r in rows.values()):
            out |= _accuracy(config, rows, ar, "correct_fallback")
    if out.get("bound") and out["speedup"]:
        out["measured_over_bound"] = out["speedup"][0] / out["bound"]
    return out


def summarise(
    rows: Sequence[dict],
    grid: Sequence[Config],
    items: Sequence[Item],
    meta: dict,
    batches: Sequence[dict] = (),
) -> dict:
    """The summary of a run: ``meta`` (identity, environment) and one entry per configuration.

    Only rows of the grid's configurations on the current items count; ``batches``: the
    batch records of a batched run.
    """
    wanted = {item.id for item in items}
    by_config: dict[str, Rows] = {c.id: {} for c in grid}
    for row in rows:
        if row["config"] in by_config and row["item"] in wanted:
            by_config[row["config"]][row["item"]] = row
    reference = next((c.id for c in grid if c.method == "ar"), None)
    ar = by_config[reference] if reference else None
    scored = any("correct" in row for rows in by_config.values() for row in rows.values())
    configs = [
        summarise_config(c, by_config[c.id], ar, scored)
        | _throughput(c, batches, wanted)
        | _versus_sps(c, grid, by_config)
        for c in grid
    ]
    configs = [c | _gain_kept(c, configs) | _gain_per_nat(c, configs) for c in configs]
    return {
        **meta,
        "n_items": len(items),
        "scored": scored,
        "reference": reference,
        "configs": configs,
        "claim": claim_check(configs, reference) if scored else [],
        "notes": _notes(grid, reference, meta),
    }


def _versus_sps(config: Config, grid: Sequence[Config], by_config: dict[str, Rows]) -> dict:
    """A drafting configuration's per-item tokens/s over chain SpS's with the same drafting
    (K, drafter, draft model and head, verifier), when the run holds one: median [min, max]."""
    same = ("num_draft_tokens", "drafter", "draft", "draft_vocab", "draft_quant", "verifier")
    sps = next(
        (
            c
            for c in grid
            if c.method == "sps"
            and c.verification == "chain"
            and all(getattr(c, key) == getattr(config, key) for key in same)
        ),
        None,
    )
    if not config.drafts or sps is None or sps.id == config.id:
        return {}
    ratio = speed_ratio(by_config[config.id], by_config[sps.id])
    return {} if ratio is None else {"speedup_vs_sps": ratio.as_list()}


def _gain_kept(config: dict, configs: Sequence[dict]) -> dict:
    """For an answer's budget: the share of per-position Cactus's gain in mean accepted
    length over SpS that it keeps, (budgeted - SpS) / (Cactus at its cap - SpS), against the
    chain SpS and the unbudgeted Cactus (same delta, exact and verification) of its drafting."""
    if "kl_budget" not in config or config.get("mean_accepted") is None:
        return {}
    same = _drafting(config)
    cap = {k: v for k, v in config["params"].items() if k not in BUDGET_KEYS}
    sps = _chain_sps(configs).get(same)
    free = [
        c
        for c in configs
        if c["method"] == "cactus"
        and c["params"] == cap
        and c["verification"] == config["verification"]
        and _drafting(c) == same
    ]
    if sps is None or not free or free[0].get("mean_accepted") is None:
        return {}
    gain = free[0]["mean_accepted"] - sps["mean_accepted"]
    kept = config["mean_accepted"] - sps["mean_accepted"]
    return {"gain_kept": kept / gain} if gain else {}


def _gain_per_nat(config: dict, configs: Sequence[dict]) -> dict:
    """For a lossy configuration that spent divergence: the mean accepted length it gained
    over the chain SpS of its drafting, per nat of KL an answer spent on average. It ranks
    ways of spending divergence at any total (a budget, its allocation, a per-position
    delta): the comparison at equal KL that a budget table asks for."""
    sps = _chain_sps(configs).get(_drafting(config))
    spent = config.get("kl_nats_per_sequence")  # 0 for AR and SpS
    if sps is None or not spent or spent <= 0 or config.get("mean_accepted") is None:
        return {}
    return {"gain_per_nat": (config["mean_accepted"] - sps["mean_accepted"]) / spent}


#: The paper's claim: this much more accepted per iteration than SpS, at the verifier's quality.
CLAIM_GAIN = 1.4


def claim_check(configs: Sequence[dict], reference: str | None) -> list[dict]:
    """For each lossy method and each block-verified one on the dense verifier: its mean
    accepted length over chain SpS's (same K, drafter and draft model), and whether its
    accuracy lies inside the verifier's 95% Wilson interval;
    ``holds``: both at once (at least ``CLAIM_GAIN`` times SpS, and inside). ``ceiling``:
    the largest gain K drafts allow (K over SpS's mean accepted length)."""
    ar = next((c for c in configs if c["id"] == reference and c.get("accuracy")), None)
    if ar is None:
        return []
    sps = _chain_sps(configs)
    found = []
    for c in configs:
        base = sps.get(_drafting(c))
        compared = c["method"] not in ("ar", "sps") or not _chain(c)
        measured = c.get("mean_accepted") and c.get("accuracy")
        if not (compared and measured and base and base["mean_accepted"]):
            continue
        if c["verifier"] != ar["verifier"]:
            continue
        gain = c["mean_accepted"] / base["mean_accepted"]
        k = c["num_draft_tokens"]  # None: the policy's (no fixed ceiling)
        inside = ar["accuracy"][1] <= c["accuracy"][0] <= ar["accuracy"][2]
        found.append(
            {
                "id": c["id"],
                "gain_over_sps": gain,
                "ceiling": None if k is None else k / base["mean_accepted"],
                "accuracy": c["accuracy"][0],
                "verifier_interval": ar["accuracy"][1:],
                "inside": inside,
                "holds": gain >= CLAIM_GAIN and inside,
            }
        )
    return found


def _chain_sps(configs: Sequence[dict]) -> dict[tuple, dict]:
    """Chain SpS with a measured mean accepted length, by what it drafts with
    (``_drafting``): the baseline of a configuration's gain."""
    return {
        _drafting(c): c
        for c in configs
        if c["method"] == "sps" and _chain(c) and c.get("mean_accepted") is not None
    }


def _drafting(config: dict) -> tuple:
    """What a configuration drafts with: K, the drafter, the draft model and its head, and
    the verifier."""
    keys = ("num_draft_tokens", "drafter", "draft", "draft_vocab", "draft_quant", "verifier")
    return tuple(config.get(key) for key in keys)


def _chain(config: dict) -> bool:
    """Whether a configuration verifies chains (runs recorded before blocks all did)."""
    return config.get("verification", "chain") == "chain"


def _notes(grid: Sequence[Config], reference: str | None, meta: dict | None = None) -> list[str]:
    notes = []
    batch = (meta or {}).get("run", {}).get("setup", {}).get("max_batch", 1)
    if batch > 1:
        notes.append(
            f"Batched run: our engine decoded up to {batch} items at once, so tokens/s and "
            "speedups are per stream; throughput is every token over the batches' wall time."
        )
    if reference is None:
        notes.append("No `ar` configuration in the grid: speedups and bounds are not available.")
    if any(c.prompt_lookup for c in grid):
        notes.append(
            "hf_assisted with the n-gram drafter is Hugging Face's prompt lookup decoding "
            "(prompt_lookup_num_tokens = K)."
        )
    if any(c.method in ("hf", "hf_assisted") for c in grid):
        notes.append(
            "Hugging Face rows report speed (and accuracy) only: generate() does not expose "
            "acceptance counts or forward-pass timings."
        )
        if _packed(meta or {}):
            notes.append(
                "Hugging Face rows run the same model objects as the engine, whose bfloat16 "
                "linear layers the lean backend repacked for oneDNN (bit-identical products "
                "for blocks of up to 32 rows): they are faster than stock transformers on the "
                "same machine."
            )
    return notes


def _packed(meta: dict) -> bool:
    """Whether the run's bfloat16 CPU models were repacked by the lean backend."""
    env, setup = meta.get("environment", {}), meta.get("run", {}).get("setup", {})
    cpu_bf16 = env.get("device") == "cpu" and env.get("dtype") == "bfloat16"
    return cpu_bf16 and setup.get("backend", "auto") != "hf"
