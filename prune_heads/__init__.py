"""prune-heads: find the attention heads a pretrained LLM does not use, verify they can go, and cut them out.

On a model you hold (``prune_heads.api``)::

    import prune_heads
    scores = prune_heads.score_heads(model, tokenizer)           # every score function, [layers, heads] each
    found = prune_heads.find_heads(model, tokenizer, "1%")       # search, confirmation, long-context guard
    with prune_heads.ablate(model, found): ...                   # the heads zeroed while the block runs
    prune_heads.prune(model, found).save_pretrained("pruned")    # cut out; from_pretrained loads it

The subpackages are the stages of one run, in the order it flows through them (docs/ARCHITECTURE.md); a stage
imports only earlier ones:

    io -> models (load_model: LoadedModel) -> data (tasks, MMLU, calibration) -> plan (Planner: PrunePlan)
       -> scoring (score_heads: ScoreTable) -> eval (encode_task, task_loglik: EvalResult; Work caches both)
       -> search (Verifier, search_budget, select_heads: Selection; confirm) -> report (report.json, plots, study)
       -> pipeline (Settings, Inputs, the stages, decide) -> api (the public functions)

``runtime`` holds what a per-layer export needs to load (torch and transformers only); importing the package
registers its configs with transformers' AutoConfig (at once if transformers is loaded, else as it loads), so such
exports load without remote code. The public names are imported on first use: ``import prune_heads`` itself imports
neither torch nor transformers.

The exporters (``exporters``) turn a selection into files; the command line (``prune_heads_cli``) chains both.
"""

__version__ = "0.1.0"

# The public API: each name and the module it lives in (imported when first used). A name here is a promise:
# tests/test_api.py fails when one disappears or its signature changes; CHANGELOG.md records every change.
_PUBLIC = {
    "score_heads": "prune_heads.api.scores",
    "HeadScores": "prune_heads.api.scores",
    "evaluate": "prune_heads.api.evaluation",
    "Evaluation": "prune_heads.api.evaluation",
    "find_heads": "prune_heads.api.find",
    "HeadSelection": "prune_heads.api.find",
    "ablate": "prune_heads.api.surgery",
    "prune": "prune_heads.api.surgery",
    "PruneHeadsError": "prune_heads.errors",
    "UserError": "prune_heads.errors",
    "UnsupportedModel": "prune_heads.errors",
    "AlreadyPruned": "prune_heads.errors",
    "HeadIndexError": "prune_heads.errors",
    "NotSliceable": "prune_heads.errors",
    "NonFinite": "prune_heads.errors",
    "DiskFull": "prune_heads.errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prune_heads' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


class _RegisterAfterTransformers:
    """A finder on ``sys.meta_path`` that lets transformers import as usual and then registers the per-layer configs
    with its AutoConfig (``runtime.register``), so ``import prune_heads`` imports neither torch nor transformers."""

    def find_spec(self, name, path=None, target=None):
        import sys

        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = next((s for f in sys.meta_path if hasattr(f, "find_spec") for s in [f.find_spec(name, path, target)]
                     if s is not None), None)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _register()

            spec.loader.exec_module = exec_module
        return spec


def _register() -> None:
    from prune_heads.runtime import register

    register()


def _register_with_transformers() -> None:
    """The per-layer configs join transformers' AutoConfig now if transformers is loaded, else as it loads."""
    import sys

    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTransformers())


_register_with_transformers()
