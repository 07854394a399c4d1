"""Figures people would rather look at than read: where the dormant heads are, and what removing them costs."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import matplotlib

if not os.environ.get("MPLBACKEND") and "matplotlib.pyplot" not in sys.modules:  # a notebook's backend stays its own
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from prune_heads.heads import HeadSet, score_direction
from prune_heads.io.files import atomic_path


def _literal(plot):
    """Every text of the figure as written: task names, model paths and labels are the user's text, and matplotlib
    would read ``$...$`` in them as mathtext (an unbalanced ``$`` fails the drawing)."""
    @functools.wraps(plot)
    def drawn(*args, **kwargs):
        with plt.rc_context({"text.parse_math": False, "text.usetex": False}):
            return plot(*args, **kwargs)
    return drawn


def _write(fig, path: Path) -> None:
    """The figure as PNG at ``path``, written atomically."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")


def _save(fig, path: Path) -> Path:
    _write(fig, path)
    plt.close(fig)
    return path


@_literal
def score_heatmap(scores: torch.Tensor, key: str, chosen: HeadSet, path: Path, title: str = "") -> Path:
    """Layer x head heatmap of one score, written to ``path``; removed heads are outlined."""
    return _save(score_figure(scores, key, chosen, title=title), path)


@_literal
def score_figure(scores: torch.Tensor, key: str, chosen: HeadSet, path: Path | None = None, title: str = ""):
    """Layer x head heatmap of one score (removed heads outlined), as a figure (also written to ``path``)."""
    layers, heads = scores.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * heads + 2), max(3.0, 0.22 * layers + 1.5)))
    cmap = "viridis_r" if score_direction(key) == "high" else "viridis"
    im = ax.imshow(scores.float().numpy(), aspect="auto", cmap=cmap, interpolation="nearest")
    for layer, h in chosen.pairs():
        ax.add_patch(plt.Rectangle((h - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.6))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(heads))
    step = max(1, layers // 16)
    ax.set_yticks(range(0, layers, step))
    dormant = "high" if score_direction(key) == "high" else "low"
    ax.set_title(title or f"{key} per head ({dormant} = dormant); red: removed ({len(chosen)} heads)", fontsize=9)
    fig.colorbar(im, ax=ax, label=key)
    if path is not None:
        _write(fig, path)
    return fig


@_literal
def search_curve(points: list[dict], baseline_accuracy: float, budget, path: Path, title: str = "") -> Path:
    """Task accuracy vs % of heads ablated, with the per-point 95% CI of the paired difference; under a budget on
    anything else (answer KL, a measure on held-out text), what the budget limits beside the accuracy."""
    pts = sorted(points, key=lambda p: p["fraction"])
    budget_points = budget.limit
    if budget.metric != "accuracy":
        return _measure_curve(pts, budget, path, title, 100 * baseline_accuracy)
    x = [100 * p["fraction"] for p in pts]
    base = 100 * baseline_accuracy
    # Paired: unablated accuracy + the paired difference (a point stopped early covers only part of the questions).
    y = [base + p["delta_points"] for p in pts]
    lo = [base + p["ci95_points"][0] for p in pts]
    hi = [base + p["ci95_points"][1] for p in pts]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.fill_between(x, lo, hi, color="tab:blue", alpha=0.15, label="95% CI of paired difference")
    ax.plot(x, y, "o-", color="tab:blue", label="ablated accuracy")
    ax.axhline(base, color="gray", linestyle="--", linewidth=1, label=f"unablated {base:.1f}%")
    ax.axhline(
        base - budget_points, color="tab:red", linestyle=":", linewidth=1.2, label=f"budget ({budget_points:g} pt)"
    )
    over = [p for p in pts if not p.get("within_budget", True)]
    if over:
        ax.plot(
            [100 * p["fraction"] for p in over],
            [base + p["delta_points"] for p in over],
            "x",
            color="tab:red",
            markersize=9,
            mew=2,
            label="over budget",
        )
    _mark_refused(ax, pts, lambda p: base + p["delta_points"])
    chosen = [p for p in pts if p.get("chosen")]
    if chosen:
        ax.plot(
            [100 * chosen[0]["fraction"]],
            [base + chosen[0]["delta_points"]],
            "*",
            color="tab:red",
            markersize=14,
            label="chosen",
        )
    ax.set_xlabel("% of heads ablated (dormant first)")
    ax.set_ylabel("MMLU 5-shot accuracy (%)")
    ax.set_title(title or "accuracy vs heads removed", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return _save(fig, path)


REFUSED_MARKERS = {"guard": ("D", "tab:orange", "refused by the long-context guard"),
                   "confirmation": ("s", "tab:brown", "refused by confirmation on unseen questions")}


def _mark_refused(ax, pts: list[dict], y, x=lambda p: 100 * p["fraction"]) -> None:
    """Points the guard or the confirmation refused, each kind with its own marker and its reason in the legend (the
    first point's reason; report.json has every one)."""
    for by, (marker, color, label) in REFUSED_MARKERS.items():
        refused = [p for p in pts if (p.get("refused") or {}).get("by") == by]
        if refused:
            reason = refused[0]["refused"]["reason"]
            reason = reason if len(reason) <= 40 else reason[:37] + "..."
            ax.plot([x(p) for p in refused], [y(p) for p in refused], marker, color=color,
                    markersize=9, fillstyle="none", mew=2, linestyle="none", label=f"{label}: {reason}")


def _measure_curve(pts: list[dict], budget, path: Path, title: str, base: float) -> Path:
    x = [100 * p["fraction"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
    ax1.plot(x, [budget.reads(p) for p in pts], "o-", color="tab:purple", label=budget.axis_label)
    ax1.axhline(budget.limit, color="tab:red", linestyle=":", label=f"budget ({budget})")
    _mark_refused(ax1, pts, budget.reads)
    ax1.set_xlabel("% of heads ablated (dormant first)")
    ax1.set_ylabel(budget.axis_label)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(x, [base + p["delta_points"] for p in pts], "o-", color="tab:blue", label="accuracy (paired)")
    ax2.plot(x, [100 * p["agreement"] for p in pts], "s--", color="tab:green", label="agreement with unablated")
    ax2.set_xlabel("% of heads ablated (dormant first)")
    ax2.set_ylabel("%")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    chosen = [p for p in pts if p.get("chosen")]
    if chosen:
        ax1.plot([100 * chosen[0]["fraction"]], [budget.reads(chosen[0])], "*", color="tab:red", markersize=14)
    fig.suptitle(title or f"{budget.axis_label} vs heads removed", fontsize=10)
    return _save(fig, path)


@_literal
def score_cdfs(means_a: dict, means_b: dict, name_a: str, name_b: str, keys: list[str], path: Path) -> Path:
    """Overlaid empirical CDFs of the per-head scores of two models, one panel per score function."""
    cols = 5
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for values, name, color in ((means_a[key], name_a, "tab:blue"), (means_b[key], name_b, "tab:orange")):
            v = values.double().flatten().sort().values.numpy()
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", color=color, label=name)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("per-head score distributions (empirical CDF)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


@_literal
def study_curves(study: dict, path: Path, title: str = "") -> Path:
    """Accuracy vs % of heads zeroed for every score function, one panel per ablation mode, random heads dashed."""
    modes = [m for m in ("dynamic", "static") if m in study["ranking"]] or ["random"]
    rows = study["curves"]
    functions = sorted({r["function"] for r in rows if r["mode"] != "random"})
    cmap = plt.get_cmap("tab10" if len(functions) <= 10 else "tab20")
    colors = {f: cmap(i % cmap.N) for i, f in enumerate(functions)}
    base = 100 * study["baseline_accuracy"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.6), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes):
        for r in rows:
            if r["mode"] != mode:
                continue
            xs = [p["zeroed_percent"] for p in r["points"]]
            ys = [100 * p["accuracy"] for p in r["points"]]
            style = "-" if not r["function"].endswith("_ln") else "--"
            ax.plot(
                xs,
                ys,
                style,
                marker="o",
                markersize=3,
                color=colors[r["function"]],
                linewidth=1.2,
                label=f"{r['function']} ({r['max_percent_within_budget']:.1f}%)",
            )
        for r in rows:
            if r["mode"] == "random":
                ax.plot(
                    [p["zeroed_percent"] for p in r["points"]],
                    [100 * p["accuracy"] for p in r["points"]],
                    ":",
                    color="black",
                    linewidth=1.6,
                    label=f"random heads ({r['max_percent_within_budget']:.1f}%)",
                )
        ax.axhline(base, color="gray", linestyle="--", linewidth=0.8)
        ax.axhline(
            base - study["budget_points"],
            color="tab:red",
            linestyle=":",
            linewidth=1.2,
            label=f"budget ({study['budget_points']:g} pt)",
        )
        ax.set_title(f"{mode} ablation", fontsize=10)
        ax.set_xlabel("% of heads zeroed (mean over inputs)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    axes[0][0].set_ylabel(f"{study.get('measure', 'accuracy')} (%)")
    fig.suptitle(title or "accuracy vs heads zeroed, per score function (legend: max % within budget)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


@_literal
def study_ranking(study: dict, path: Path, title: str = "") -> Path:
    """Largest % of heads zeroed within budget per score function (best first), one bar per ablation mode."""
    modes = [m for m in ("dynamic", "static") if m in study["ranking"]]
    rows = {(r["function"], r["mode"]): r for r in study["curves"]}
    order = study["ranking"][modes[0]] if modes else []
    fig, ax = plt.subplots(figsize=(7.0, max(2.5, 0.32 * len(order) + 1.2)))
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        ys = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(order))]
        vals = [rows[(f, mode)]["max_percent_within_budget"] if (f, mode) in rows else 0 for f in order]
        ax.barh(ys, vals, height=width, label=mode, color=("tab:blue", "tab:orange")[j % 2])
    if ("random", "random") in rows:
        ax.axvline(
            rows[("random", "random")]["max_percent_within_budget"], color="black", linestyle=":", label="random heads"
        )
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(order, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"max % of heads zeroed within {study['budget_points']:g} pt")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title or "score functions ranked", fontsize=10)
    return _save(fig, path)


@_literal
def shipped_curve(points: list[dict], budget, path: Path, title: str = "") -> Path:
    """What the budget limits (accuracy drop, answer KL or text KL) against the saving of the model that ships: %
    of attention parameters removed (left) and % of KV cache removed (right), chosen point starred."""
    pts = sorted((p for p in points if p.get("shipped")), key=lambda p: p["shipped"]["attention_params_removed"])
    if not pts:
        return path
    y = [budget.reads(p) for p in pts]
    total = pts[0]["shipped"]["attention_params"] + pts[0]["shipped"]["attention_params_removed"]
    kv_total = pts[0]["shipped"]["kv_cache_bytes_per_token"] + pts[0]["shipped"]["kv_cache_removed"]
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), sharey=True)
    for ax, field, denominator, label in ((axes[0], "attention_params_removed", total, "attention parameters"),
                                          (axes[1], "kv_cache_removed", kv_total, "KV cache per token")):
        x = [100 * p["shipped"][field] / denominator for p in pts]
        ax.plot(x, y, "o", color="tab:blue", label="evaluated point")
        over = [(xi, yi) for xi, yi, p in zip(x, y, pts) if not p.get("within_budget", True)]
        if over:
            ax.plot(*zip(*over), "x", color="tab:red", markersize=9, mew=2, label="over budget")
        _mark_refused(ax, pts, budget.reads, lambda p, f=field, d=denominator: 100 * p["shipped"][f] / d)
        chosen = [(xi, yi) for xi, yi, p in zip(x, y, pts) if p.get("chosen")]
        if chosen:
            ax.plot(*zip(*chosen), "*", color="tab:red", markersize=14, label="chosen")
        ax.axhline(budget.limit, color="tab:red", linestyle=":", linewidth=1.2, label=f"budget ({budget})")
        ax.set_xlabel(f"% of {label} removed in the export")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(budget.axis_label)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title or "budget vs shipped saving", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
