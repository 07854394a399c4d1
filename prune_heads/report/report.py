"""What a run leaves behind: report.json (everything needed to audit it), heads.json, mmlu.jsonl."""
from __future__ import annotations

import platform
import sys
from pathlib import Path

from prune_heads import __version__
from prune_heads.data.lm_eval_index import is_lm_eval
from prune_heads.data.tasks import results_file
from prune_heads.eval.results import EvalResult, accuracy_summary
from prune_heads.eval.textkl import text_measures
from prune_heads.io.files import write_json, write_jsonl
from prune_heads.models.loading import LoadedModel
from prune_heads.search.budget import REGISTRY
from prune_heads.search.selection import Selection

# report.json's layout. 2: one meaning per name: the budget's `limit` with its `unit` (was `points`, nats under a KL
# metric), the search's `search_points` each with its `phase` (were `points` and `stage`), the confirmation's `tried`
# and the guard's `judged` points (were `points`).
REPORT_SCHEMA_VERSION = 2


def versions() -> dict:
    import torch
    import transformers

    return {
        "prune_heads": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def write_eval_outputs(out: Path, result: EvalResult, extra: dict, task: str = "mmlu") -> None:
    write_jsonl(out / results_file(task), result.rows() if not is_lm_eval(task) else lm_eval_rows(result))
    write_json(out / "summary.json", {**extra, "accuracy": accuracy_summary(result), task: accuracy_summary(result)})


def lm_eval_rows(result: EvalResult) -> list[dict]:
    """Per document of an lm-eval multiple-choice task, under lm-eval's names: the task, ``doc_id``, the target and
    predicted choice indices, ``acc`` (or ``acc_norm``: the prediction divides by each choice's characters) and the
    log-likelihood of every choice."""
    metric = "acc_norm" if result.questions and result.questions[0].norm_lengths is not None else "acc"
    return [{"task": q.subject, "doc_id": q.index, "target": q.gold, "pred": int(p), metric: float(c),
             "loglik": [round(float(x), 6) for x in ll[: len(q.choices)]]}
            for q, p, c, ll in zip(result.questions, result.pred, result.correct, result.loglik)]


def _over_budget(point: dict, confirmation: dict) -> str:
    if "texts" in confirmation:  # a next-token-KL budget confirmed on further texts
        return (f"over budget on {confirmation['texts']} unseen texts (next-token KL {point['kl_text_nats']:.4f} "
                "nat)")
    return (f"over budget on {confirmation['questions']} unseen questions (delta {point['delta_points']:+.2f} pt, "
            f"answer KL {point['kl_answer_nats']:.4f} nat)")


def mark_refusals(points: list[dict], confirmation: dict, guard: dict) -> list[dict]:
    """The search's points with ``refused``: ``{"by": "guard" | "confirmation", "reason": ...}`` on each one the
    long-context guard or the confirmation on unseen questions turned down (matched by head count), so the plots and
    readers of report.json tell a refused point from an ordinary passing one."""
    refused = {}
    for p in (confirmation or {}).get("tried", []):
        if not p.get("within_budget", True):
            refused[p["num_heads"]] = {"by": "confirmation", "reason": _over_budget(p, confirmation)}
    for p in (guard or {}).get("judged", []):
        if not p.get("within_tolerance", True):
            refused[p["num_heads"]] = {"by": "guard", "reason": p.get("reason", "a long-context probe")}
    return [dict(p, refused=refused[p["num_heads"]]) if p.get("num_heads") in refused and p.get("within_budget")
            else p for p in points]


METRIC_NAMES = {name: m.title for name, m in REGISTRY.items() if m.title}  # what a plot's title calls it


def budget_definition(budget, task: str) -> str:
    return budget.spec.definition.format(task=task)


def scores_payload(table, calibration: str) -> dict:
    from prune_heads.heads import score_direction

    return {
        "scores": table.to_json(),
        "directions": {k: score_direction(k) for k in table.keys},
        "calibration": {
            "source": calibration,
            "inputs": len(table.token_counts),
            "tokens": sum(table.token_counts),
            "tokens_per_input": {"min": min(table.token_counts), "max": max(table.token_counts)},
        },
    }


def architecture_summary(lm: LoadedModel) -> dict:
    geos = lm.arch.geometries(lm.model)
    return {"model_type": lm.config.model_type, "adapter": lm.arch.name, "layers": len(geos),
            "heads_per_layer": [g.num_heads for g in geos], "kv_heads_per_layer": [g.num_kv_heads for g in geos],
            "head_dim": geos[0].head_dim}


def final_summary(selection: Selection, baseline: EvalResult, gqa: str) -> dict:
    from prune_heads.eval.results import agreement, answer_kl

    result, heads = selection.result, selection.heads
    kl_text = text_measures(result.meta)
    return {**accuracy_summary(result), **selection.delta.to_json(),
            "kl_answer_nats": round(float(answer_kl(result, baseline).mean()), 6), **kl_text,
            "agreement": round(agreement(result, baseline), 6), "num_heads_removed": len(heads),
            "fraction_removed": round(len(heads) / selection.total, 6), "gqa": gqa,
            **({"shipped": selection.savings} if selection.savings else {})}
