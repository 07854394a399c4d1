"""prune-heads: find the attention heads a pretrained LLM does not use, verify they can go, and cut them out.

The subpackages are the stages of one run, in the order it flows through them (docs/ARCHITECTURE.md); a stage
imports only earlier ones:

    io -> models (load_model: LoadedModel) -> data (tasks, MMLU, calibration) -> plan (Planner: PrunePlan)
       -> scoring (score_heads: ScoreTable) -> eval (encode_task, task_loglik: EvalResult; Work caches both)
       -> search (Verifier, search_budget, select_heads: Selection; confirm) -> report (report.json, plots, study)
       -> pipeline (Settings, Inputs, and the stages open_run, score, verifier_for, select, confirmed)

``runtime`` holds what a per-layer export needs to load (torch and transformers only); importing the package
registers its configs with transformers' AutoConfig, so such exports load without remote code.

The exporters (``exporters``) turn a Selection into files; the command line (``prune_heads_cli``) chains both.
"""

__version__ = "0.1.0"

from prune_heads.runtime import register as _register  # noqa: E402

_register()
