"""Recipes: YAML files of defaults per model family (``recipes/`` at the top of the repository, shipped in
the wheel as ``prune_heads.recipe_files``). Precedence: a flag on the command line, then the recipe, and a recipe
that leaves a key out falls back to ``default.yaml``."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from prune_heads.errors import UserError
from prune_heads.io.readers import read_recipe, read_yaml

KEYS = {
    "name",
    "match",
    "scorer",
    "budget",
    "metric",
    "generation_budget",
    "task",
    "task_limit",
    "kl_text_size",
    "dtype",
    "calibration_size",
    "max_length",
    "mmlu_per_subject",
    "mmlu_subjects",
    "batch_size",
    "search",
    "study",
    "heal",
    "guard",
}
PER_DEVICE_KEYS = ("mmlu_per_subject", "mmlu_subjects", "task_limit", "batch_size")


def for_device(value: Any, device_type: str, default: Any = None) -> Any:
    """A recipe value that may be given per kind of device (``{cpu: ..., gpu: ...}``), for ``device_type`` (a torch
    device type: "cuda" reads ``gpu``, anything else ``cpu``); ``default`` where it says nothing for this device."""
    if isinstance(value, dict) and set(value) <= {"cpu", "gpu"}:
        value = value.get("gpu" if device_type == "cuda" else "cpu")
    return default if value is None else value


@dataclass
class Recipe:
    name: str
    path: str
    values: dict[str, Any]

    def get(self, key: str, device_type: str = "cpu") -> Any:
        value = self.values.get(key)
        return for_device(value, device_type) if key in PER_DEVICE_KEYS else value

    def to_json(self) -> dict:
        return {"name": self.name, "path": self.path, "values": self.values}


def _recipe_dir() -> Path:
    local = Path(__file__).resolve().parents[2] / "recipes"
    if local.is_dir():
        return local
    return Path(str(resources.files("prune_heads.recipe_files")))


def _read(path: Path) -> dict:
    data = read_yaml(path, "recipe")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a YAML mapping of settings, not a {type(data).__name__}")
    unknown = set(map(str, data)) - KEYS
    if unknown:
        raise UserError(f"recipe {path} has unknown keys {sorted(unknown)}; allowed: {sorted(KEYS)}")
    return read_recipe(path)


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(_recipe_dir().glob("*.yaml"))}


def load_recipe(name_or_path: str) -> Recipe:
    builtin = builtin_recipes()
    path = Path(name_or_path)
    if not path.is_file():
        if name_or_path not in builtin:
            raise UserError(f"recipe {name_or_path!r} is neither a file nor a built-in recipe ({', '.join(builtin)})")
        path = builtin[name_or_path]
    values = copy.deepcopy(_read(builtin["default"]))
    own = _read(path)
    values.update(own)
    return Recipe(str(own.get("name", path.stem)), str(path), values)


def recipe_for(model_spec: str, model_type: str, preferred: str | None = None) -> Recipe:
    """``preferred`` (an embedded model's recipe) wins; then a name pattern; then the model type; then default."""
    if preferred:
        return load_recipe(preferred)
    lowered = model_spec.lower()
    recipes = {name: _read(p) for name, p in builtin_recipes().items() if name != "default"}
    for name, data in recipes.items():
        if any(pat in lowered for pat in (data.get("match") or {}).get("name_patterns", [])):
            return load_recipe(name)
    for name, data in recipes.items():
        if model_type in (data.get("match") or {}).get("model_types", []):
            return load_recipe(name)
    return load_recipe("default")
