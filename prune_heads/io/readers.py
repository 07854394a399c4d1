"""One validating reader per kind of input file: recipes, head sets, text files (calibration, held-out and healing
text), task rows, export manifests, LoRA adapter configs.

Each reader bounds the file's size, decodes UTF-8 naming the line of a bad byte, parses with a safe parser (YAML
without aliases or tags, JSON without NaN), and checks the declared schema (pydantic, strict types: a string is never
turned into a number, a float or a boolean never into a head index). Every failure is one ``UserError`` line that
names the file, the place and the fix.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from prune_heads.errors import UserError

MiB = 1 << 20
LIMITS = {"recipe": 1 * MiB, "heads": 16 * MiB, "text": 1024 * MiB, "rows": 4096 * MiB, "json": 64 * MiB}


# -- bytes and text ---------------------------------------------------------------------------------------------------


def read_bytes(path: str | Path, what: str, kind: str) -> bytes:
    """The file's bytes; a UserError if it is missing, not a regular file, unreadable or larger than the kind allows."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p} does not exist; check the path")
    if not p.is_file():
        raise UserError(f"{what} {p} is not a regular file; pass a file")
    size = p.stat().st_size
    if size > LIMITS[kind]:
        raise UserError(f"{what} {p} is {size / MiB:.0f} MiB, more than the {LIMITS[kind] // MiB} MiB such a file may "
                        "have; pass a smaller file")
    try:
        return p.read_bytes()
    except OSError as e:
        raise UserError(f"{what} {p} cannot be read ({e.strerror}); check its permissions") from None


def decode_utf8(data: bytes, path: str | Path, what: str) -> str:
    """``data`` as text; a UserError naming the line and column of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(f"{what} {path}, line {line}, column {column}, is not UTF-8 (byte 0x{data[e.start]:02x}); "
                        "save the file as UTF-8") from None


def read_text(path: str | Path, what: str, kind: str = "text") -> str:
    return decode_utf8(read_bytes(path, what, kind), path, what)


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are all different: ``{"0": [1], "0": [2]}`` means one of two things, and json keeps
    the last without a word."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def parse_json(text: str, path: str | Path, what: str, line: int | None = None) -> Any:
    """Strict JSON (no NaN or Infinity, no key twice in an object); a UserError naming the line."""
    try:
        return json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        where = f", line {line}," if line is not None else ""
        raise UserError(f"{what} {path}{where} is ambiguous: {e}; keep one") from None
    except (json.JSONDecodeError, ValueError) as e:
        where = f", line {line}," if line is not None else (f", line {e.lineno}," if hasattr(e, "lineno") else "")
        raise UserError(f"{what} {path}{where} is not valid JSON ({str(e).split(':')[0]}); fix the file") from None


def read_json(path: str | Path, what: str, kind: str = "json") -> Any:
    return parse_json(read_text(path, what, kind), path, what)


class _NoAliasLoader(yaml.SafeLoader):
    """Safe YAML without anchors and aliases: a recipe needs neither, and aliases are how a few hundred bytes expand
    to gigabytes ("billion laughs")."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases (*{event.anchor}) are not allowed, line {event.start_mark.line + 1}")
        node = super().compose_node(parent, index)
        if getattr(node, "anchor", None) is not None:
            raise yaml.YAMLError(f"anchors (&{node.anchor}) are not allowed")
        return node

    def construct_mapping(self, node, deep=False):
        """A mapping whose keys are all different (YAML, like JSON, would keep the last of two without a word)."""
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue
            if key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.YAMLError(f"the key {key!r} appears twice in one mapping, line {line}")
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path, what: str, kind: str = "recipe") -> Any:
    text = read_text(path, what, kind)
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{what} {path} is not valid YAML for prune-heads ({first}); fix the file") from None


# -- schemas ----------------------------------------------------------------------------------------------------------


def schema_error(error: ValidationError, path: str | Path, what: str, expected: str) -> UserError:
    """The first schema violation as one line: where, what is wrong, what was expected."""
    first = error.errors()[0]
    types = {"int", "str", "float", "bool", "list", "dict", "none", "constrained-int", "constrained-float"}
    parts = [str(x) for x in first["loc"] if isinstance(x, int) or not (str(x) in types or "[" in str(x) and
                                                                         str(x) != "[key]")]
    if parts[:1] == ["layers"]:  # the heads file's top level
        parts = parts[1:]
    where = ".".join(p for p in parts if p != "[key]") or "top level"
    value = repr(first.get("input"))
    value = value if len(value) <= 40 else value[:37] + "..."
    message = f"{what} {path}: {where} = {value}: {first['msg'].lower()}; expected {expected}"
    return UserError(" ".join(message.split("\n")).replace("\r", " "))


# Recipe files, heads files: checked strictly (no key they do not know, no value of another type). The recipe's
# schema is derived from the declared settings (prune_heads/pipeline/recipes.py).
STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Strict(BaseModel):
    model_config = STRICT


PositiveInt = Annotated[StrictInt, Field(gt=0)]
Number = StrictInt | StrictFloat


class Match(_Strict):
    """A recipe's ``match`` block: which models take it by default."""

    name_patterns: list[StrictStr] = []
    model_types: list[StrictStr] = []


def checked(data: Any, schema: type[BaseModel], path: str | Path, what: str, expected: str) -> dict:
    """``data``, a mapping that satisfies ``schema``; else a one-line UserError saying what was expected."""
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} holds a {type(data).__name__}, not a mapping; expected {expected}")
    try:
        schema.model_validate(data)
    except ValidationError as e:
        raise schema_error(e, path, what, expected) from None
    return data


HeadIndex = Annotated[StrictInt, Field(ge=0, le=1 << 20)]


class HeadsFileSchema(_Strict):
    layers: dict[Annotated[StrictStr, Field(pattern=r"^(0|[1-9][0-9]{0,6})$")],
                 Annotated[list[HeadIndex], Field(max_length=1 << 16)]]


def read_heads(path: str | Path) -> dict[int, list[int]]:
    """A heads.json ``{"layer": [head, ...]}``: layers as decimal strings, heads as non-negative integers."""
    data = read_json(path, "head set file", "heads")
    if not isinstance(data, dict):
        raise UserError(f'head set file {path} is a JSON {type(data).__name__}; expected {{"layer": [head, ...]}}')
    try:
        HeadsFileSchema.model_validate({"layers": data})
    except ValidationError as e:
        raise schema_error(e, path, "head set file", '{"layer": [head, ...]} with integer heads') from None
    return {int(k): list(v) for k, v in data.items()}


class ManifestSchema(BaseModel):
    """The parts of prune_heads.json that are read back (push, adapt); other keys are informational."""

    model_config = ConfigDict(extra="allow", strict=True)
    verified: StrictBool
    files: dict[StrictStr, Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]]
    heads_removed: Annotated[StrictInt, Field(ge=0)]
    layout: Literal["uniform", "per-layer", "masked"]
    plan: dict[StrictStr, Any]
    source_model: dict[StrictStr, Any]
    schema_version: Annotated[StrictInt, Field(ge=1)] = 1  # absent in exports before schema 2


def check_manifest(meta: Any, path: str | Path) -> dict:
    checked(meta, ManifestSchema, path, "manifest", "a manifest written by prune-heads (export the model again)")
    for name in meta["files"]:
        if Path(name).name != name or name.startswith("."):
            raise UserError(f"manifest {path} lists the file {name!r}, which is not a plain file name; export again")
    return meta


class AdapterConfigSchema(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    peft_type: StrictStr
    r: PositiveInt | None = None
    target_modules: list[StrictStr] | StrictStr | None = None
    base_model_name_or_path: StrictStr | None = None


def check_adapter_config(config: Any, path: str | Path) -> dict:
    return checked(config, AdapterConfigSchema, path, "adapter config", "a peft adapter_config.json")
