"""The Python API: a model and tokenizer the user already holds (a transformers ``PreTrainedModel`` of a supported
family, any dtype, any device, ``device_map``-dispatched included; a peft ``PeftModel`` where it makes sense), and
the same stages the command line runs on them. Importable from ``prune_heads`` itself (``prune_heads.score_heads``);
the names are listed in ``prune_heads.__all__``.

    held        a model in memory as the core reads it; keyword arguments as settings
    scores      score_heads -> HeadScores
    evaluation  evaluate -> Evaluation
    find        find_heads -> HeadSelection (pipeline.decision.decide, as the main command)
    surgery     ablate (a context manager), prune (in place, the export's plan)
"""
