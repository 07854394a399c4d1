"""The figures and the manifest of an export: the bytes it will write (checked against the free space before), the
parameters, heads and KV cache before and after as the written files hold them, ``prune_heads.json`` (written last,
with every file's sha256 and ``verified: true``) and the reader that refuses anything else."""
from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

from exporters.gguf.writer import GGUF_BYTES_PER_VALUE
from exporters.logits import bytes_per_value
from prune_heads import __version__
from prune_heads.errors import UserError
from prune_heads.heads import HeadSet
from prune_heads.io.files import json_safe, sha256_file
from prune_heads.io.readers import check_manifest, read_json
from prune_heads.models.counting import is_tied, model_parameters
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.planner import LayoutChoice, shapes_summary

MANIFEST = "prune_heads.json"


def export_bytes(lm: LoadedModel, choice: LayoutChoice, formats: tuple[str, ...], gguf_type: str, files=None,
                 prompts: int = 4 * 96) -> int:
    """The bytes the export writes at its peak: the pruned weights in the export's dtype (a tied LM head once, unless
    the streamed source stores it too), the reference logits spilled until the reload is checked (float32, full
    vocabulary, ``prompts`` token positions), and the GGUF when asked. Tokenizer, config and card: the margin."""
    hidden, geometries = lm.config.hidden_size, lm.arch.geometries(lm.model)
    attention = sum(hidden * g.head_dim * (2 * g.num_heads + 2 * g.num_kv_heads) for g in geometries)
    kept = attention if choice.layout == "masked" else choice.plan.attention_params(hidden)
    weights = model_parameters(lm.model) - (attention - kept)
    if files is not None and is_tied(lm.config) and "lm_head.weight" in files:
        weights += lm.config.vocab_size * hidden
    total = 0
    if "safetensors" in formats:
        total += weights * bytes_per_value(lm.dtype) + prompts * lm.config.vocab_size * 4
    if "gguf" in formats:
        total += int(weights * GGUF_BYTES_PER_VALUE[gguf_type])
    return total


def export_stats(lm: LoadedModel, parameters: int, choice: LayoutChoice, heads: HeadSet,
                 source_parameters: int | None = None) -> dict:
    """Parameters, heads and KV cache before and after as the files hold them (``parameters``: the export's, a
    tied LM head counted once), what the weights lose, and whether the export was padded back to the original shape
    (masked, or uniform padding every layer back): then the heads are silenced, not removed."""
    geometries = lm.arch.geometries(lm.model)
    head_dim = lm.arch.head_dim(lm.config)
    shapes = [(g.num_heads, g.num_kv_heads) for g in geometries]
    width = bytes_per_value(lm.dtype)
    before = {"parameters": source_parameters or model_parameters(lm.model), **shapes_summary(shapes, head_dim, width)}
    after = {"parameters": parameters,
             **shapes_summary(shapes if choice.layout == "masked" else choice.plan.shapes, head_dim, width)}
    removed = {"query_heads": before["query_heads"] - after["query_heads"],
               "kv_heads": before["kv_heads"] - after["kv_heads"],
               "parameters": before["parameters"] - after["parameters"]}
    return {"before": before, "after": after, "removed": removed, "heads_silenced": len(heads),
            "padded_to_original_shape": bool(heads) and removed["parameters"] == 0,
            "tied_embeddings": is_tied(lm.config)}


def files_digest(out: Path) -> str:
    weights = sorted(p for p in out.iterdir() if p.suffix in (".safetensors", ".json", ".gguf") and p.name != MANIFEST)
    return hashlib.sha256("".join(sha256_file(p) for p in weights).encode()).hexdigest()


def build_manifest(lm: LoadedModel, heads: HeadSet, choice: LayoutChoice, found: dict, info: dict, enc) -> dict:
    """prune_heads.json: what was removed and why, how it ships, and what the export's checks ``found`` (stats,
    verification, task_eval, healing)."""
    return {
        "format": "prune-heads/2",
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "prune_heads_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source_model": lm.source.published(),
        "removed_heads": heads.to_json(),
        "heads_removed": len(heads),
        "heads_file": info.get("heads_file"),  # prune-heads export: the given heads' file (name, sha256)
        "scorer": info.get("scorer"),
        "budget": info.get("budget"),
        "budget_definition": info.get("budget_definition"),
        "task": info.get("task") or (enc.task if enc is not None else None),
        "layout": choice.layout,
        "layout_reason": choice.reason,
        "layout_options": choice.options,
        "plan": choice.plan.to_json(),
        "stats": found.get("stats"),
        "verification": found.get("verification"),
        "task_eval": found.get("task_eval"),
        "healing": found.get("healing"),
        "warnings": info.get("warnings", []),
        "confirmation": info.get("confirmation"),
        "long_context": info.get("long_context"),  # the long-context guard: probes original vs pruned, per length
        "dtype": str(lm.dtype).replace("torch.", ""),
    }


# prune_heads.json's layout. 2: the confirmation's `tried` points (were `points`); 1 (no schema_version): older
# exports, still read by push, adapt and export --heads (none of them reads a renamed key).
MANIFEST_SCHEMA_VERSION = 2
SEALED = "manifest_sha256"  # the manifest's own digest: a hand-edited manifest no longer matches it


def manifest_digest(meta: dict) -> str:
    """sha256 of the manifest's content without its own digest, as JSON with sorted keys (what it reads back as)."""
    body = {k: v for k, v in json_safe(meta).items() if k != SEALED}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def sealed(meta: dict) -> dict:
    """``meta`` with its digest, written last into prune_heads.json beside the files' digests."""
    return {**meta, SEALED: manifest_digest(meta)}


def source_name(meta: dict) -> str:
    """The source model's name in a manifest (an older manifest's ``spec``)."""
    src = meta.get("source_model") or {}
    return str(src.get("name") or src.get("hub_id") or src.get("spec") or "unknown")


def read_manifest(directory: Path) -> dict:
    """The manifest of a complete, verified export, or a UserError saying what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory} is not a prune-heads export (no {MANIFEST}); export one with prune-heads or "
                        "prune-heads export")
    meta = check_manifest(read_json(path, "manifest"), path)
    if meta.get("schema_version", 1) > MANIFEST_SCHEMA_VERSION:
        raise UserError(f"{directory} was exported by a newer prune-heads ({MANIFEST} schema "
                        f"{meta['schema_version']}, this one reads up to {MANIFEST_SCHEMA_VERSION}); upgrade "
                        "prune-heads")
    if not meta.get("verified"):
        raise UserError(f"{directory} was not verified; export it again")
    if SEALED in meta and meta[SEALED] != manifest_digest(meta):
        raise UserError(f"{directory} was modified after export: {MANIFEST} does not match its recorded sha256 "
                        "(what it says of the heads, the source or the checks was edited); export again")
    for name, digest in (meta.get("files") or {}).items():
        f = Path(directory) / name
        if not f.is_file():
            raise UserError(f"{directory} is incomplete: {name} is missing; export the model again")
        if sha256_file(f) != digest:
            raise UserError(f"{directory} was modified after export: {name} does not match its recorded sha256; "
                            "export again")
    return meta
