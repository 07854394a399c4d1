"""Compare attention behaviour of two models on the same texts (``prune-heads compare A B``).

Per score function: the two empirical distributions of per-head scores (overlaid CDFs), their two-sample
Kolmogorov-Smirnov and Wasserstein-1 distances, and where the head grids match (a base model and its finetune),
the Spearman rank correlation of heads and the overlap (IoU) of the heads each would remove at 10%.
"""
from __future__ import annotations

import math

import torch

from prune_heads.heads import SCORE_KEYS, ScoreTable, score_direction
from prune_heads.report.markdown import plain


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """sup_x |F_a(x) - F_b(x)| of the two empirical CDFs."""
    a, b = a.double().flatten().sort().values, b.double().flatten().sort().values
    xs = torch.cat([a, b]).unique()
    fa = torch.searchsorted(a, xs, right=True).double() / a.numel()
    fb = torch.searchsorted(b, xs, right=True).double() / b.numel()
    return float((fa - fb).abs().max())


def wasserstein_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Integral of |F_a - F_b| (earth mover's distance between the empirical distributions)."""
    a, b = a.double().flatten().sort().values, b.double().flatten().sort().values
    xs = torch.cat([a, b]).unique()
    if xs.numel() < 2:
        return 0.0
    fa = torch.searchsorted(a, xs[:-1], right=True).double() / a.numel()
    fb = torch.searchsorted(b, xs[:-1], right=True).double() / b.numel()
    return float(((fa - fb).abs() * (xs[1:] - xs[:-1])).sum())


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank), as Spearman's rho needs."""
    x = x.double().flatten()
    order = x.argsort()
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    for v in x.unique():
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denom) if denom else float("nan")


def selected(scores: torch.Tensor, key: str, fraction: float) -> set[int]:
    """Flat indices of the ``fraction`` most dormant heads by ``key``."""
    k = max(1, round(fraction * scores.numel()))
    flat = scores.flatten()
    order = flat.argsort(descending=score_direction(key) == "high", stable=True)
    return set(order[:k].tolist())


def compare_tables(a: ScoreTable, b: ScoreTable, fraction: float = 0.10) -> dict:
    same_grid = a.shape == b.shape
    out = {"same_head_grid": same_grid, "shape_a": list(a.shape), "shape_b": list(b.shape), "functions": {}}
    for key in SCORE_KEYS:
        ma, mb = a.mean(key), b.mean(key)
        row = {"ks": round(ks_distance(ma, mb), 6), "wasserstein": round(wasserstein_distance(ma, mb), 6),
               "mean_a": round(float(ma.mean()), 6), "mean_b": round(float(mb.mean()), 6)}
        if same_grid:
            sa, sb = selected(ma, key, fraction), selected(mb, key, fraction)
            row["spearman_heads"] = round(spearman(ma, mb), 6)
            row[f"iou_at_{int(100 * fraction)}pct"] = round(len(sa & sb) / len(sa | sb), 6)
        out["functions"][key] = row
    return out


def study_ranking_correlation(study_a: dict, study_b: dict) -> dict:
    """Per ablation mode, Spearman's rho between the two studies' ranks of the score functions both studied."""
    out = {}
    for mode in sorted(set(study_a.get("ranking", {})) & set(study_b.get("ranking", {})) - {"random"}):
        ra, rb = study_a["ranking"][mode], study_b["ranking"][mode]
        common = [f for f in ra if f in rb]
        if len(common) < 2:
            continue
        rank_a = torch.tensor([ra.index(f) for f in common], dtype=torch.float64)
        rank_b = torch.tensor([rb.index(f) for f in common], dtype=torch.float64)
        out[mode] = {"spearman": round(spearman(rank_a, rank_b), 6), "functions": len(common),
                     "best_a": ra[0], "best_b": rb[0]}
    return out


def markdown(result: dict, name_a: str, name_b: str) -> str:
    iou = next((k for k in next(iter(result["functions"].values())) if k.startswith("iou_at_")), None)
    head = "| function | KS | Wasserstein | mean A | mean B |" + (" Spearman (heads) | IoU @10% |" if iou else "")
    sep = "|---|---|---|---|---|" + ("---|---|" if iou else "")
    lines = [f"# Attention behaviour: {plain(name_a)} vs {plain(name_b)}", "",
             f"Head grids: A {result['shape_a']}, B {result['shape_b']}"
             + ("" if iou else " (different: per-head correlation and overlap are not defined)"), "", head, sep]
    for key, r in result["functions"].items():
        line = f"| `{key}` | {r['ks']:.3f} | {r['wasserstein']:.4g} | {r['mean_a']:.4g} | {r['mean_b']:.4g} |"
        if iou:
            line += f" {r['spearman_heads']:.3f} | {r[iou]:.3f} |"
        lines.append(line)
    for mode, r in (result.get("study_rankings") or {}).items():
        lines += ["", f"Function rankings from the two studies ({mode} ablation, {r['functions']} functions): Spearman "
                      f"{r['spearman']:.3f}; best: `{r['best_a']}` (A), `{r['best_b']}` (B)."]
    return "\n".join(lines) + "\n"
