"""report.json of the main job, assembled from what the run's stages produced (pipeline/stages.py: the opened
``Run``, its ``Scored`` heads, the ``Verifier`` and the ``Selection``). The figures each part is made of come from
report/report.py; this module only puts them where report.json has them."""
from __future__ import annotations

from prune_heads.data.tasks import task_format
from prune_heads.eval.results import accuracy_summary
from prune_heads.eval.textkl import HeldOutText
from prune_heads.pipeline.stages import Run, Scored
from prune_heads.report.report import (
    REPORT_SCHEMA_VERSION,
    architecture_summary,
    budget_definition,
    final_summary,
    scores_payload,
    versions,
)
from prune_heads.search.selection import Selection
from prune_heads.search.verifier import Verifier


def prune_report(run: Run, scored: Scored, verifier: Verifier, selection: Selection, gqa_options: dict,
                 warnings: list[str]) -> dict:
    """report.json of the main job (the command adds confirmation, resolution, export): everything needed to audit
    the run."""
    s, budget = run.settings, run.settings.budget
    return {
        "model": run.lm.source.to_json(),
        "dtype": run.lm.extra.get("dtype_choice"),
        "architecture": architecture_summary(run.lm),
        "recipe": s.recipe.to_json(),
        "settings": s.to_json(),
        "versions": versions(),
        "task": task_summary(run, verifier.kl_text),
        "schema_version": REPORT_SCHEMA_VERSION,
        "budget": {"text": budget.text, "metric": budget.metric, "limit": budget.limit,
                   "unit": "nats" if budget.in_nats else "points",
                   "decision": budget.rule, "definition": budget_definition(budget, s.task)},
        "scorer": s.scorer,
        "search": {"units": s.units, "objective": s.objective, "layout": verifier.layout},
        **scores_payload(scored.table, scored.calibration),
        "baseline": accuracy_summary(verifier.baseline),
        "final": final_summary(selection, verifier.baseline, s.gqa),
        "search_points": selection.points(),
        "heads": selection.heads.to_json(),
        "gqa_options": gqa_options,
        "warnings": warnings,
    }


def task_summary(run: Run, held_out: HeldOutText | None) -> dict:
    """The task the run verified on, and the held-out texts of the next-token KL."""
    data, enc = run.inputs.questions, run.enc
    kl_text = None if held_out is None else {"source": held_out.source, "texts": len(held_out.sequences),
                                             "tokens": sum(len(x) for x in held_out.sequences)}
    return {"name": run.settings.task, "metric": task_format(run.settings.task).metric, "source": data.source,
            "questions": len(enc), "subjects": len(enc.subjects), "skipped_rows": data.skipped_rows,
            "exemplars": data.exemplar_source, "fast_path_questions": sum(it.fast for it in enc.items),
            "kl_text": kl_text}
