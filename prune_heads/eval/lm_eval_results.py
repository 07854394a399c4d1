"""Per-document results of lm-eval tasks (``eval.lm_eval_bridge``), paired between the unablated and the ablated
model on the same documents: what ``prune-heads eval --task lm-eval:NAME`` writes.

lm-eval computes every metric; a document's value is the one lm-eval logged for it, under lm-eval's name. A
perplexity metric (``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``) logs ``(log-likelihood, units)``
per document; it is paired as log-likelihood per unit (nats per word or byte: higher is better), since perplexity
itself is an aggregate over documents. A loglikelihood task's ``perplexity`` logs the target's log-likelihood per
document (lm-eval aggregates ``exp(-mean)``): it is paired as that log-likelihood, in nats.
"""
from __future__ import annotations

import math

import torch

from prune_heads.eval.results import PairedDelta


def document_value(sample: dict, metric: str) -> float:
    value = sample[metric]
    if isinstance(value, (tuple, list)):  # (log-likelihood, words or bytes)
        return float(value[0]) / max(float(value[1]), 1.0)
    return float(value)


LOGLIKELIHOOD_METRICS = ("perplexity",)  # per document: the target's log-likelihood (a loglikelihood task)


def paired_as(sample: dict, metric: str) -> tuple[str, str]:
    """(the unit ``metric``'s document values are paired in, what they are where that is not the metric itself)."""
    if isinstance(sample[metric], (tuple, list)):
        return "nats per unit", "log-likelihood per unit"
    if metric in LOGLIKELIHOOD_METRICS:
        return "nats", "the target's log-likelihood per document"
    return "", ""


def paired(base: list[dict], ablated: list[dict], metric: str) -> dict:
    """The ablated minus the unablated value of ``metric``, document by document, with a normal 95% interval: in
    points for a metric between 0 and 1 (accuracy, exact match), else in the metric's own unit (``paired_as``)."""
    a = torch.tensor([document_value(s, metric) for s in base], dtype=torch.float64)
    b = torch.tensor([document_value(s, metric) for s in ablated], dtype=torch.float64)
    unit = paired_as(base[0], metric)[0]
    share = not unit and bool(((a >= 0) & (a <= 1) & (b >= 0) & (b <= 1)).all())
    scale = 100.0 if share else 1.0
    d = (b - a) * scale
    n = d.numel()
    se = float(d.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("inf")
    delta = PairedDelta(float(d.mean()), float(d.mean()) - 1.96 * se, float(d.mean()) + 1.96 * se, n)
    return {"metric": metric, "unit": "points" if share else unit, "unablated": round(float(a.mean()), 6),
            "ablated": round(float(b.mean()), 6), "delta": round(delta.delta, 4),
            "ci95": [round(delta.ci_low, 4), round(delta.ci_high, 4)], "n": n}


def generation_summary(rows: list[dict]) -> dict:
    """The label-free measures of a generative task over its documents (``lm_eval_bridge.generation_agreement``)."""
    n = max(len(rows), 1)
    tokens = sum(r["tokens"] for r in rows)
    return {"same_generation": round(sum(r["same_generation"] for r in rows) / n, 6),
            "token_agreement": round(sum(r["token_agreement"] * r["tokens"] for r in rows) / max(tokens, 1), 6),
            "kl_per_token_nats": round(sum(r["kl_per_token"] * r["tokens"] for r in rows) / max(tokens, 1), 6),
            "documents": len(rows), "reference_tokens": tokens}


def _json_value(value):
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return value.item() if hasattr(value, "item") else value


def document_rows(task: str, metrics: list[str], base: list[dict], ablated: list[dict] | None,
                  agreement: list[dict] | None) -> list[dict]:
    """One record per document: lm-eval's ``doc_id``, each metric's value under lm-eval's name (unablated, and
    ablated with ``ablated_`` before it), the generated text of a generative task, and the label-free measures."""
    rows = []
    for i, s in enumerate(base):
        row = {"task": task, "doc_id": s["doc_id"], "target": _json_value(s.get("target")),
               **{m: _json_value(s[m]) for m in metrics if m in s}}
        if isinstance(s["resps"][0][0], str):
            row["generation"] = s["resps"][0][0]
        if ablated is not None:
            row.update({f"ablated_{m}": _json_value(ablated[i][m]) for m in metrics if m in ablated[i]})
            if isinstance(ablated[i]["resps"][0][0], str):
                row["ablated_generation"] = ablated[i]["resps"][0][0]
        if agreement is not None:
            row.update({k: v for k, v in agreement[i].items() if k != "doc_id"})
        rows.append(row)
    return rows
