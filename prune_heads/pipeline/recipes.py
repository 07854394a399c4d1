"""Recipes: YAML files of defaults per model family (``recipes/`` at the top of the repository, shipped in
the wheel as ``prune_heads.recipe_files``). Precedence: a flag on the command line, then the recipe, and a recipe
that leaves a key out falls back to ``default.yaml``."""
from __future__ import annotations

import copy
import functools
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictStr, create_model

from prune_heads.errors import UserError
from prune_heads.io.readers import STRICT, Match, Number, checked, read_yaml
from prune_heads.pipeline.settings import Recipe, declarations
from prune_heads.search.budget import METRIC_CHOICES

# Recipe keys that are not a setting of their own: the recipe's name, which models it matches, the unit the budget is
# read in (the `metric` flag), the budget on generations, and the study's defaults. Every other key is declared with
# its setting (pipeline/settings.py).
RECIPE_ONLY = {
    "name": (StrictStr | None, "The recipe's name (default: the file's)."),
    "match": (Match | None, "Which models take this recipe by default: `name_patterns` (substrings of the model's "
                            "name) and `model_types` (config model types)."),
    "metric": (Literal[METRIC_CHOICES] | None, "What the budget limits, as `--metric` (accuracy, kl, kl-text, ...)."),
    "generation_budget": (StrictStr | Annotated[Number, Field(ge=0)] | None,
                          "For a model near chance: the next-token-KL budget on generations when `kl_text` names an "
                          "lm-eval task and neither a budget nor a metric is given."),
    "study": (dict[StrictStr, Any] | None, "Defaults of `prune-heads study`."),
}


@functools.cache
def recipe_schema() -> type[BaseModel]:
    """What a recipe may say, derived from the declared settings' recipe keys (a dotted key is a key of a block) and
    the recipe's own keys; strict: an unknown key or a value of the wrong type is refused."""
    top, blocks = {key: (kind, None) for key, (kind, _) in RECIPE_ONLY.items()}, defaultdict(dict)
    for d in declarations().values():
        if d.recipe and "." in d.recipe:
            block, key = d.recipe.split(".", 1)
            blocks[block][key] = (d.recipe_type, None)
        elif d.recipe:
            top[d.recipe] = (d.recipe_type, None)
    for block, keys in blocks.items():
        top[block] = (create_model(f"{block}_block", __config__=STRICT, **keys) | None, None)
    return create_model("Recipe", __config__=STRICT, **top)


def _recipe_dir() -> Path:
    local = Path(__file__).resolve().parents[2] / "recipes"
    if local.is_dir():
        return local
    return Path(str(resources.files("prune_heads.recipe_files")))


def read_recipe(path: str | Path) -> dict:
    """A recipe file's settings, checked against the schema derived from the declared settings (``recipe_schema``):
    a bad file fails in one line naming the key and what it expected."""
    data = read_yaml(path, "recipe")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a YAML mapping of settings, not a {type(data).__name__}")
    schema = recipe_schema()
    unknown = set(map(str, data)) - set(schema.model_fields)
    if unknown:
        raise UserError(f"recipe {path} has unknown keys {sorted(unknown)}; allowed: {sorted(schema.model_fields)}")
    return checked(data, schema, path, "recipe", "a YAML mapping of settings with the types of recipes/default.yaml")


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(_recipe_dir().glob("*.yaml"))}


def load_recipe(name_or_path: str) -> Recipe:
    builtin = builtin_recipes()
    path = Path(name_or_path)
    if not path.is_file():
        if name_or_path not in builtin:
            raise UserError(f"recipe {name_or_path!r} is neither a file nor a built-in recipe ({', '.join(builtin)})")
        path = builtin[name_or_path]
    values = copy.deepcopy(read_recipe(builtin["default"]))
    own = read_recipe(path)
    values.update(own)
    return Recipe(str(own.get("name", path.stem)), str(path), values)


def recipe_for(model_spec: str, model_type: str, preferred: str | None = None) -> Recipe:
    """``preferred`` (an embedded model's recipe) wins; then a name pattern; then the model type; then default."""
    if preferred:
        return load_recipe(preferred)
    lowered = model_spec.lower()
    recipes = {name: read_recipe(p) for name, p in builtin_recipes().items() if name != "default"}
    for name, data in recipes.items():
        if any(pat in lowered for pat in (data.get("match") or {}).get("name_patterns", [])):
            return load_recipe(name)
    for name, data in recipes.items():
        if model_type in (data.get("match") or {}).get("model_types", []):
            return load_recipe(name)
    return load_recipe("default")
