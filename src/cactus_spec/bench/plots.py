"""The three figures of a run, as PNG files beside its summary.

1. ``accuracy_vs_acceptance.png``: accuracy (Wilson interval) against mean accepted drafts
   per iteration, one point per configuration, the verifier's interval as a band.
2. ``cactus_delta.png``: speedup and divergence (KL nats/token) against delta for Cactus,
   closed form and exact, with SpS and TAS as reference lines.
3. ``acceptance_by_position.png``: acceptance rate per draft position for SpS, TAS, Cactus.

A figure whose data the run lacks (no answers, no Cactus) says so instead of plotting.
Drawn on matplotlib ``Figure`` objects (no pyplot state, no display needed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from cactus_spec.core.drafters import DEFAULT_DRAFTER, drafts_without_a_model
from cactus_spec.files import atomic_path

COLORS = {
    "sps": "black",
    "cactus": "tab:blue",
    "tas": "tab:red",
    "interp": "tab:green",
    "topk": "tab:purple",
    "hf_assisted": "tab:orange",
}


def _style(config: dict) -> dict:
    """Colour by method (Cactus: darker blue for larger delta); exact Cactus with squares
    and dashes; a drafter without a draft model (n-gram) with triangles; a quantised verifier
    with diamonds."""
    params = config["params"]
    color = COLORS.get(config["method"], "gray")
    if config["method"] == "cactus":
        color = colormaps["Blues"](0.4 + 0.6 * min(params["delta"], 2.0) / 2.0)
    modelless = drafts_without_a_model(config["drafter"])
    marker = "^" if modelless else "s" if params.get("exact") else "o"
    marker = "D" if config.get("verifier", "none") != "none" else marker
    return {"color": color, "marker": marker, "linestyle": "--" if params.get("exact") else "-"}


def _legend_outside(ax: Axes) -> None:
    """The legend to the right of the axes, clear of the data."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_axis_off()


def accuracy_figure(summary: dict) -> Figure:
    """Figure 1: accuracy vs mean accepted length, the verifier's interval as a band."""
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    points = [c for c in summary["configs"] if c.get("accuracy") and "mean_accepted" in c]
    if not summary["scored"] or not points:
        _empty(ax, "no accuracy: the task has no reference answers or nothing drafted")
        return fig
    ar = next((c for c in summary["configs"] if c["id"] == summary["reference"]), None)
    if ar and ar.get("accuracy"):
        est, low, high = ar["accuracy"]
        ax.axhspan(low, high, color="gray", alpha=0.2, label="verifier alone (95% CI)")
        ax.axhline(est, color="gray", linewidth=1)
    for c in points:
        est, low, high = c["accuracy"]
        style = _style(c)
        ax.errorbar(
            c["mean_accepted"],
            est,
            yerr=[[est - low], [high - est]],
            capsize=3,
            color=style["color"],
            marker=style["marker"],
            linestyle="none",
            label=c["label"],
        )
    ax.set_xlabel("mean accepted drafts per iteration")
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_title(f"Accuracy vs acceptance, N = {summary['n_items']}")
    _legend_outside(ax)
    return fig


def _reference_lines(
    ax: Axes, configs: Sequence[dict], value: Callable[[dict], float | None]
) -> None:
    """SpS and TAS as horizontal lines (dotted; dash-dotted with a drafter without a draft
    model)."""
    for c in configs:
        y = value(c) if c["method"] in ("sps", "tas") else None
        if y is not None:
            style = "-." if drafts_without_a_model(c["drafter"]) else ":"
            ax.axhline(y, color=COLORS[c["method"]], linestyle=style, label=c["label"])


def delta_figure(summary: dict) -> Figure:
    """Figure 2: speedup and divergence vs delta for Cactus, SpS and TAS as references."""
    fig = Figure(figsize=(13, 4.5))
    speed_ax, kl_ax = fig.subplots(1, 2)
    configs = [c for c in summary["configs"] if c["n"]]
    cactus = [c for c in configs if c["method"] == "cactus" and "kl_budget" not in c["params"]]
    if not cactus:
        _empty(speed_ax, "no Cactus configuration in this run")
        _empty(kl_ax, "no Cactus configuration in this run")
        return fig
    panels = [
        (speed_ax, lambda c: c["speedup"][0] if c.get("speedup") else None, "speedup (1 = AR)"),
        (kl_ax, lambda c: c.get("kl_nats_per_token"), "KL nats/token"),
    ]
    for ax, value, name in panels:
        for line in _cactus_lines(cactus):
            points = [(c["params"]["delta"], value(c)) for c in line if value(c) is not None]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                style = {**_style(line[0]), "color": COLORS["cactus"]}
                ax.plot(xs, ys, label=_line_label(line[0]), **style)
        _reference_lines(ax, configs, value)
        ax.set_xlabel("delta (KL budget, nats)")
        ax.set_ylabel(name)
    _legend_outside(kl_ax)
    speed_ax.axhline(1.0, color="gray", linewidth=1, label="verifier alone")
    speed_ax.set_title("Speedup (median over items)")
    kl_ax.set_title("Divergence meter")
    return fig


def _line_label(config: dict) -> str:
    """ "cactus exact K6", "cactus closed form K4 ngram"."""
    form = "exact" if config["params"]["exact"] else "closed form"
    drafter = "" if config["drafter"] == DEFAULT_DRAFTER else f" {config['drafter']}"
    k = config["num_draft_tokens"]
    return f"cactus {form} K{'auto' if k is None else k}{drafter}"


def _cactus_lines(cactus: Sequence[dict]) -> list[list[dict]]:
    """Cactus configurations grouped by (exact, K, drafter): one line each over delta."""
    groups: dict[tuple, list[dict]] = {}
    for c in cactus:
        key = (c["params"]["exact"], c["num_draft_tokens"], c["drafter"])
        groups.setdefault(key, []).append(c)
    return list(groups.values())


def position_figure(summary: dict) -> Figure:
    """Figure 3: acceptance rate per draft position for SpS, TAS and Cactus."""
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    lines = [
        c
        for c in summary["configs"]
        if c["method"] in ("sps", "tas", "cactus") and c.get("acceptance_by_position")
    ]
    if not lines:
        _empty(ax, "no SpS, TAS or Cactus configuration drafted in this run")
        return fig
    for c in lines:
        rates = c["acceptance_by_position"]
        xs = [j + 1 for j, r in enumerate(rates) if r is not None]
        ax.plot(xs, [r for r in rates if r is not None], label=c["label"], **_style(c))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given the chain reached it)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    _legend_outside(ax)
    return fig


FIGURES: dict[str, Callable[[dict], Figure]] = {
    "accuracy_vs_acceptance.png": accuracy_figure,
    "cactus_delta.png": delta_figure,
    "acceptance_by_position.png": position_figure,
}


def write_plots(directory: Path, summary: dict) -> list[Path]:
    """Draw every figure into ``directory`` (each file replaced atomically)."""
    paths = []
    for name, draw in FIGURES.items():
        fig = draw(summary)
        fig.tight_layout()
        with atomic_path(directory / name) as tmp:
            fig.savefig(tmp, format="png", dpi=120)
        paths.append(directory / name)
    return paths
