"""prune-heads: find the attention heads a pretrained LLM does not use, verify they can go, and cut them out.

One run, as data flows through the code (see each module's docstring):

    cli -> models.load_model -> data.mmlu / data.calibration -> scoring.score_heads (ScoreTable)
        -> search.search_budget (evaluation.evaluate under ablation.ablate) -> HeadSet -> report / plots
"""

__version__ = "0.1.0"
