"""A run's summary as markdown (summary.md): the setting, then one table for speed,
acceptance and divergence, one for accuracy, one for answers' divergence budgets (when a
configuration has one), and one for acceptance by draft position."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from cactus_spec.core.spec import TREES
from cactus_spec.files import write_text_atomic

DASH = "-"


def format_number(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return DASH if value is None else f"{value:.{digits}f}{suffix}"


def _kl(config: dict, key: str, digits: int) -> str:
    """A divergence figure of ``config``: "unbounded" where an answer's was (``summary``)."""
    if config.get(key) is None and config.get("kl_unbounded"):
        return "unbounded"
    return format_number(config.get(key), digits)


def format_interval(values: Sequence[float] | None, digits: int = 2, suffix: str = "") -> str:
    """[estimate, low, high] -> "1.23x [1.01, 1.40]"."""
    if values is None:
        return DASH
    est, low, high = values
    return f"{est:.{digits}f}{suffix} [{low:.{digits}f}, {high:.{digits}f}]"


def _params(config: dict) -> str:
    """{"delta": 0.5, "exact": True} -> "delta=0.5, exact=true"."""
    text = ", ".join(f"{k}={json.dumps(v)}" for k, v in config["params"].items())
    return text or DASH


def _k(config: dict) -> str:
    if config["drafter"] is None:
        return DASH
    k = config["num_draft_tokens"]
    judged = config.get("verification", "chain")
    block = "" if judged == "chain" else f", {judged}"
    block += str(config["branches"]) if judged in TREES else ""
    drafter = config["drafter"] if config.get("draft") is None else Path(config["draft"]).name
    drafter += "" if config.get("draft_vocab") is None else f", vocab {config['draft_vocab']}"
    drafter += "" if config.get("draft_quant") is None else f", {config['draft_quant']} draft"
    return f"{'auto' if k is None else k} ({drafter}{block})"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


SPEED_HEADER = (
    "method",
    "params",
    "K",
    "verifier",
    "N",
    "tokens/s (median)",
    "speedup vs AR: median [min, max]",
    "mean accepted",
    "alpha",
    "c",
    "v",
    "i.i.d. bound",
    "measured / bound",
    "time other",
    "KL nats/token",
    "KL nats/sequence",
    "peak memory (GB)",
    "throughput tokens/s (batched)",
)


def _verifier(c: dict) -> str:
    """The verifier's weights: dense (as loaded), int8, or the GGUF (llama.cpp)."""
    if c["method"].startswith("llamacpp"):
        return "GGUF"
    return "dense" if c.get("verifier", "none") == "none" else c["verifier"]


def _speed_row(c: dict) -> list[str]:
    head = [c["method"], _params(c), _k(c), _verifier(c)]
    if not c["n"]:
        return [*head, "0"] + [DASH] * (len(SPEED_HEADER) - len(head) - 1)
    ratio = c.get("measured_over_bound")
    other = c["time_shares"]["other"] if "time_shares" in c else None
    return [
        *head,
        str(c["n"]),
        format_number(c["tokens_per_s"]),
        format_interval(c["speedup"], suffix="x"),
        format_number(c.get("mean_accepted")),
        format_number(c.get("alpha"), 3),
        format_number(c.get("c"), 3),
        format_number(c.get("v"), 3),
        format_number(c.get("bound"), suffix="x"),
        DASH if ratio is None else f"{ratio:.0%}",
        DASH if other is None else f"{other:.0%}",
        _kl(c, "kl_nats_per_token", 4),
        _kl(c, "kl_nats_per_sequence", 3),
        format_number(c["peak_memory_bytes"] / 1e9),
        format_number(c.get("throughput_tokens_per_s")),
    ]


def speed_table(configs: Sequence[dict]) -> list[str]:
    """Speed, acceptance, bound, divergence and memory, one row per configuration."""
    return markdown_table(SPEED_HEADER, [_speed_row(c) for c in configs])


def accuracy_table(configs: Sequence[dict]) -> list[str]:
    """Accuracy with its Wilson interval, the paired difference from the verifier, and, for
    gsm, the same figures from the last number of the output (the fallback reading)."""
    fallback = any("accuracy_fallback" in c for c in configs)
    header = [
        "method",
        "params",
        "K",
        "verifier",
        "correct / N",
        "accuracy [95% Wilson]",
        "difference vs AR [95% paired Newcombe]",
    ]
    if fallback:
        header += ["last number: accuracy [95% Wilson]", "last number: difference vs AR"]
    rows = []
    for c in (c for c in configs if c["n"]):
        row = [c["method"], _params(c), _k(c), _verifier(c), f"{c['correct']} / {c['n']}"]
        row += [format_interval(c["accuracy"], 3), format_interval(c["difference_vs_ar"], 3)]
        if fallback:
            row += [
                format_interval(c.get("accuracy_fallback"), 3),
                format_interval(c.get("difference_vs_ar_fallback"), 3),
            ]
        rows.append(row)
    return markdown_table(header, rows)


def claim_table(summary: dict) -> list[str]:
    """The paper's claim, method by method: accepted length over SpS's, and whether the
    accuracy stays inside the verifier's 95% interval."""
    labels = {c["id"]: c["label"] for c in summary["configs"]}
    header = ["configuration", "mean accepted / SpS's", "largest possible (K / SpS's)"]
    header += ["accuracy", "verifier's 95% interval", "inside", ">= 40% more and inside"]
    rows = [
        [
            labels[x["id"]],
            f"{x['gain_over_sps']:.2f}x",
            DASH if x["ceiling"] is None else f"{x['ceiling']:.2f}x",
            f"{x['accuracy']:.3f}",
            f"[{x['verifier_interval'][0]:.3f}, {x['verifier_interval'][1]:.3f}]",
            "yes" if x["inside"] else "no",
            "yes" if x["holds"] else "no",
        ]
        for x in summary["claim"]
    ]
    return markdown_table(header, rows)


def position_table(configs: Sequence[dict]) -> list[str]:
    """Acceptance rate at each draft position (given the chain reached it)."""
    drafting = [c for c in configs if c.get("acceptance_by_position")]
    width = max((len(c["acceptance_by_position"]) for c in drafting), default=0)
    header = ["method", "params", "K", "verifier", *(str(j + 1) for j in range(width))]
    rows = [
        [c["method"], _params(c), _k(c), _verifier(c)]
        + [format_number(a) for a in c["acceptance_by_position"]]
        + [DASH] * (width - len(c["acceptance_by_position"]))
        for c in drafting
    ]
    return markdown_table(header, rows)


def _setting(summary: dict) -> list[str]:
    run, env = summary["run"], summary["environment"]
    models = run["models"]
    lines = [f"- Task: `{run['task']['name']}`, N = {summary['n_items']} items."]
    named = [("Target", models.get("target")), ("Draft", models.get("draft"))]
    named += [(f"Draft `{n}`", m) for n, m in models.get("other_drafts", {}).items()]
    for role, model in named:
        if model:
            sha = f" (sha256 `{model['sha256']}`)" if model["sha256"] else ""
            lines.append(f"- {role}: `{model['path']}`{sha}.")
    s = run["sampling"]
    lines += [
        f"- Sampling: temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}; "
        f"max new tokens {run['max_new_tokens']}; seed {run['seed']} (+ item index).",
        f"- Machine: {env['cpu']}"
        + (f", {env['accelerator']}" if env["accelerator"] else "")
        + f"; device {env['device']}, {env['dtype']}, {env['threads']} threads; "
        f"torch {env['torch']}, transformers {env['transformers']}, "
        f"cactus-spec {env['cactus_spec']}, Python {env['python']}.",
    ]
    for quant, d in summary.get("verifier_divergence", {}).items():
        if d is None:
            lines.append(f"- {quant} verifier: its divergence from bfloat16 was not measured.")
            continue
        lines.append(
            f"- {quant} verifier vs its {d['reference']} original, KL({quant} || "
            f"{d['reference']}) on {d['tokens']} tokens of real code: {d['kl_one_row']:.4f} "
            f"nats/token one token per forward, {d['kl_block']:.4f} in blocks of {d['block']} "
            f"(argmax agreement {d['agreement_one_row']:.1%}, {d['agreement_block']:.1%}). "
            "Every method on this verifier follows its law, so read this beside a method's KL."
        )
    return lines


BUDGET_HEADER = (
    "method",
    "params",
    "K",
    "N",
    "mean accepted",
    "gain kept",
    "accepted gained per nat",
    "tokens/s vs SpS: median [min, max]",
    "KL nats/answer: mean",
    "max",
    "budget (nats)",
    "TV bound sqrt(B/2)",
    "difference vs AR [95% paired Newcombe]",
)


def budget_table(configs: Sequence[dict]) -> list[str]:
    """SpS, Cactus and budgeted Cactus side by side: acceptance (the share of Cactus's gain
    over SpS a budget keeps, and the gain per nat an answer spent), speed over SpS, the KL
    each answer spent, and the bound a budget gives on any event's probability."""
    rows = []
    for c in configs:
        if c["method"] not in ("sps", "cactus") or not c["n"]:
            continue
        rows.append(
            [
                c["method"],
                _params(c),
                _k(c),
                str(c["n"]),
                format_number(c.get("mean_accepted")),
                DASH if c.get("gain_kept") is None else f"{c['gain_kept']:.0%}",
                format_number(c.get("gain_per_nat"), 2),
                format_interval(c.get("speedup_vs_sps"), suffix="x"),
                _kl(c, "kl_nats_per_sequence", 3),
                _kl(c, "kl_nats_per_sequence_max", 3),
                format_number(c.get("kl_budget"), 2),
                format_number(c.get("tv_bound"), 3),
                format_interval(c.get("difference_vs_ar"), 3),
            ]
        )
    return markdown_table(BUDGET_HEADER, rows)


def render(summary: dict) -> str:
    """The whole summary.md."""
    configs = summary["configs"]
    lines = [f"# cactus-spec bench: {summary['run']['task']['name']}", "", *_setting(summary)]
    lines += ["", "## Speed, acceptance and divergence", "", *speed_table(configs)]
    if summary["scored"]:
        lines += ["", "## Accuracy", "", *accuracy_table(configs)]
    if summary.get("claim"):
        lines += ["", "## More accepted, same quality?", "", *claim_table(summary)]
    if any("kl_budget" in c for c in configs):
        lines += ["", "## An answer's divergence budget", "", *budget_table(configs)]
    lines += ["", "## Acceptance rate by draft position", "", *position_table(configs)]
    lines += ["", "## Notes", ""] + [f"- {note}" for note in summary["notes"] + _legend()]
    return "\n".join(lines) + "\n"


def _legend() -> list[str]:
    return [
        "Speedup: per-item tokens/s over the verifier alone (ar) on the same item; "
        "configurations alternate item by item.",
        "alpha: accepted / reached drafts, pooled; c, v: draft time per drafted token and "
        "verifier time per iteration, in verifier AR steps; i.i.d. bound "
        "(1 - alpha^(K+1)) / ((1 - alpha)(K c + v)) with K the mean drafts per iteration.",
        "Time other: the share of wall time outside model forwards (sampling, verification, "
        "the divergence meter, Python); the main reason a measured speedup trails its bound.",
        "KL: the divergence meter, an unbiased estimate of KL(method || verifier).",
        "Peak memory: on CPU, the process's peak resident set (models included) while the "
        "configuration ran; on CUDA, peak allocated device memory.",
    ]


def write_markdown(path: Path, summary: dict) -> None:
    """Write summary.md atomically."""
    write_text_atomic(path, render(summary))
