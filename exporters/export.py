"""Export a head set: physically prune, write a safetensors checkpoint that stock ``from_pretrained`` loads,
reload it in the same run and check it computes what was verified.

Files: ``model*.safetensors`` (+ index when sharded), ``config.json``, ``generation_config.json``, tokenizer
files, ``prune_heads.json`` (what was removed and why, written last with a ``verified`` flag and every file's
sha256), ``README.md`` (model card) and, for the per-layer layout, ``modeling_pruned.py``.

The stages of ``export_pruned``, in order: plan -> prune (and heal) -> write -> reload and compare logits ->
evaluate the task on the reloaded model -> card and manifest.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from exporters.card import model_card
from exporters.gguf.export import export_gguf
from exporters.logits import (
    SpilledLogits,
    bytes_per_value,
    check_logits,
    compare_models,
    reference_logits,
    sample_prompts,
)
from exporters.speed import measure_speed as measure
from exporters.stream import stream_export, streamable
from prune_heads import __version__
from prune_heads.errors import UserError
from prune_heads.eval.passes import EncodedTask, EvalResult, agreement, answer_kl, evaluate, paired_delta
from prune_heads.heads import HeadSet
from prune_heads.io.diskspace import GGUF_BYTES_PER_VALUE, check_space, disk_full_reported
from prune_heads.io.files import sha256_file, write_json, write_text
from prune_heads.io.readers import check_manifest, read_json
from prune_heads.models.adapters import adapter_for
from prune_heads.models.counting import checkpoint_parameters, is_tied, model_parameters
from prune_heads.models.loading import LoadedModel, dense_logits_input
from prune_heads.models.placement import input_device, release_weights
from prune_heads.plan.ablation import ablate
from prune_heads.plan.planner import LayoutChoice, Planner, planner_for
from prune_heads.plan.slicing import pruned_copy
from prune_heads_cli.memory import trim_heap

MANIFEST = "prune_heads.json"
REFERENCE_DIR = ".reference-logits"  # hidden: not part of the model, gone once the reload is checked
TEMPLATE = Path(__file__).parent / "templates" / "modeling_pruned.py"


@dataclass(frozen=True)
class ExportCheck:
    """What the reloaded export is evaluated on, beyond the logit check: the task, the unablated model's and the
    verified ablation's results on it, and an evaluator that caches by the written files (default: evaluate)."""

    enc: EncodedTask
    baseline: EvalResult | None = None
    ablated: EvalResult | None = None
    evaluate_exported: Callable[[LoadedModel, str], EvalResult] | None = None
    batch_size: int = 8


@dataclass
class ExportResult:
    choice: LayoutChoice
    stats: dict
    verification: dict
    task_eval: dict | None
    manifest: dict = field(default_factory=dict)
    speed: dict | None = None  # prefill/decode tokens/s of the export against the original (prune_heads.speed)
    gguf: dict | None = None  # the GGUF written and its check in llama.cpp (gguf_export.py)


def model_stats(parameters: int, shapes: list[tuple[int, int]], head_dim: int, dtype) -> dict:
    return {
        "parameters": parameters,
        "query_heads": sum(h for h, _ in shapes),
        "kv_heads": sum(k for _, k in shapes),
        "kv_cache_bytes_per_token": sum(2 * k for _, k in shapes) * head_dim * bytes_per_value(dtype),
    }


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


def export_pruned(lm: LoadedModel, heads: HeadSet, out: Path, layout: str = "auto", max_shard_size: str = "2GB", *,
                  check: ExportCheck | None = None, info: dict | None = None, progress: bool = True, log=print,
                  heal=None, planner: Planner | None = None, measure_speed: bool = True,
                  formats: tuple[str, ...] = ("safetensors",), gguf_type: str = "f16",
                  release_source: bool = False, placement: dict | None = None) -> ExportResult:
    """Write the pruned model into ``out`` (an existing, empty staging directory) in ``formats`` (safetensors,
    gguf) and verify it there.

    ``heal(pruned_model, plan) -> (healed_model, record)`` (LoRA healing) runs on the physically pruned model once
    it is checked against the ablated original; the export then ships, and is verified against, the healed model.
    ``release_source``: the caller is done with ``lm``; its weights are released once the reference logits are
    taken, so the reloaded export is never resident beside it. ``placement``: from_pretrained's device_map,
    max_memory and offload_folder for the reload (as the user would load it)."""
    geometries = lm.arch.geometries(lm.model)
    heads.validate(len(geometries), [g.num_heads for g in geometries])
    choice = (planner or planner_for(lm)).choose(heads, layout)
    log(f"layout {choice.layout}: {choice.reason}")
    enc = check.enc if check is not None else None
    files = streamable(lm) if "safetensors" in formats and heal is None else None
    offloaded = any(p.device.type == "meta" for p in lm.model.parameters())
    _refuse_offloaded(offloaded, files, formats)
    needed = export_bytes(lm, choice, formats, gguf_type, files)
    check_space(out, needed, f"the {choice.layout} export")
    with disk_full_reported(out, f"the {choice.layout} export", needed):  # from any library, any file
        pruned, healing = (None, None) if offloaded else _pruned_model(lm, choice, enc, heal)
        gguf = (export_gguf(lm, pruned, choice, out, gguf_type, sample_prompts(lm, enc), log, measure_speed,
                            healed=healing is not None) if "gguf" in formats else None)
        if "safetensors" in formats:
            trim_heap()  # what the search left free goes back before the reference logits and the shards
            shipped = _write_safetensors(lm, pruned, healing, choice, out, max_shard_size, enc, files,
                                         measure_speed and pruned is not None, log)
            del pruned  # the last reference to the pruned copy (it shares the original's weights)
            released = release_source and not getattr(lm.model, "hf_device_map", None)
            if released:
                release_weights(lm.model)  # the caller is done with the original: free its weights before the reload
            _check_reload(lm, choice, out, shipped, released, placement)
        else:  # GGUF alone: the pruned model in memory is what the GGUF was written from
            shipped = _ShippedModel(verify_in_memory(lm, choice, pruned, enc, healed=healing is not None),
                                    _speed(lm, pruned, log) if measure_speed else None, model_parameters(pruned))
            del pruned
        stats = export_stats(lm, shipped.parameters, choice, heads, shipped.source_parameters)
        verification = shipped.verification
        log(f"{'reloaded ' + out.name if 'safetensors' in formats else 'pruned model'}: max |logit diff| "
            f"{verification['max_abs_logit_diff']:.3g} (compared in {verification['compared_in']}, tolerance "
            f"{verification['tolerance']:g})")
        reloaded = verification.pop("_model")
        trim_heap()  # the logit check's float32 upcasts, before the task passes reuse the heap
        task_eval = _evaluate_export(reloaded, out, check, healing, progress, log) if check is not None else None
        del reloaded
        meta = _manifest(lm, heads, choice, stats, verification, task_eval, healing, info or {}, enc)
        meta.update(speed=shipped.speed, formats=list(formats), gguf=gguf)
        write_text(out / "README.md", model_card(meta))
        # Hidden files (the staging lock) and subdirectories (the result cache) are not part of the model.
        meta["files"] = {p.name: sha256_file(p) for p in sorted(out.iterdir())
                         if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
        meta["verified"] = True
        write_json(out / MANIFEST, meta)  # last: its presence with verified=true marks a complete export
        return ExportResult(choice, stats, verification, task_eval, meta, shipped.speed, gguf)


@dataclass
class _ShippedModel:
    verification: dict  # with "_model": the model the task is evaluated on
    speed: dict | None
    parameters: int  # the pruned model's
    source_parameters: int | None = None  # counted in the source files when streamed (an offloaded model's own
    # parameters() do not all show)
    reference: dict | None = None  # the reference logits the reload is checked against, until it is


def _refuse_offloaded(offloaded: bool, files, formats) -> None:
    """A model partly offloaded to disk exports only by streaming from its safetensors files."""
    if not offloaded:
        return
    if "gguf" in formats:
        raise UserError("part of the model is offloaded to disk (--device-map); a GGUF is written from the model in "
                        "memory: use --format safetensors here, or export the GGUF where the model fits")
    if files is None:
        raise UserError("part of the model is offloaded to disk (--device-map), and it is not a plain safetensors "
                        "checkpoint the export could be streamed from; run prune-heads export --heads OUT/heads.json "
                        "where the model fits in memory")


def _write_safetensors(lm: LoadedModel, pruned, healing, choice: LayoutChoice, out: Path, max_shard_size: str, enc,
                       files, with_speed: bool, log) -> _ShippedModel:
    """The files first (streamed from the source's safetensors when it can be), then the reference logits (the
    ablated original, or the healed model: full-vocabulary float32 logits, 0.24x of a 0.5B bf16 model's weights,
    so not held beside a shard being written), then the pruned model timed against the original while they share
    weights. The reload and its check come after the caller has let go of what it no longer needs."""
    written = _write(lm, pruned, choice, out, max_shard_size, files)
    ids = sample_prompts(lm, enc).to(lm.device)
    spilled = SpilledLogits(out / REFERENCE_DIR)  # on disk until the reload is checked (removed then)
    if healing is not None:
        expected, precision = reference_logits(pruned, ids, lm.dtype, into=spilled)
    else:
        expected, precision = reference_logits(lm.model, ids, lm.dtype, lambda: ablate(lm, choice.plan), into=spilled)
    if written["streamed"]:
        log(f"written from {len(set(files.values()))} source safetensors file(s) tensor by tensor: "
            f"{len(written['files'])} shard(s)")
    speed = _speed(lm, pruned, log) if with_speed else None
    # What the files hold, counted as the loaded model has it (a tied LM head once): the one count of the card,
    # the manifest and the report.
    parameters = checkpoint_parameters(sorted(out.glob("*.safetensors")), lm.config)
    source = checkpoint_parameters(sorted(set(files.values())), lm.config) if files is not None else None
    return _ShippedModel({}, speed, parameters, source,
                         {"ids": ids, "expected": expected, "precision": precision, "streamed": written["streamed"]})


def _check_reload(lm: LoadedModel, choice: LayoutChoice, out: Path, shipped: _ShippedModel, released: bool,
                  placement: dict | None) -> None:
    """Load the written files as a user would and check their logits against the reference taken before."""
    reference = shipped.reference
    reloaded = _reload(lm, choice, out, placement)
    ids = reference["ids"]
    result = check_logits(reloaded, ids.to(input_device(reloaded)), reference["expected"], lm.dtype,
                          reference["precision"], f"the exported model in {out}")
    shutil.rmtree(out / REFERENCE_DIR)
    result.update(prompts=int(ids.shape[0]), tokens_per_prompt=int(ids.shape[1]),
                  dtype=str(lm.dtype).replace("torch.", ""), streamed=reference["streamed"], source_released=released)
    result["_model"] = LoadedModel(reloaded, lm.tokenizer, adapter_for(reloaded.config.model_type), lm.source,
                                   lm.dtype, input_device(reloaded))
    shipped.verification, shipped.reference = result, None


def _reload(lm: LoadedModel, choice: LayoutChoice, out: Path, placement: dict | None):
    """The written export, loaded as a user loads it (our modelling file for the per-layer layout)."""
    from transformers import AutoModelForCausalLM

    trust = choice.layout == "per-layer"  # our own modelling file, written a moment ago
    model = AutoModelForCausalLM.from_pretrained(out, dtype=lm.dtype, trust_remote_code=trust, **(placement or {}))
    if not (placement or {}).get("device_map"):
        model.to(lm.device)
    dense_logits_input(model)
    return model.eval().requires_grad_(False)


def _pruned_model(lm: LoadedModel, choice: LayoutChoice, enc: EncodedTask | None, heal):
    """A physically pruned copy (healed if asked, after checking the unhealed copy against the ablation). Without
    healing it shares every unsliced weight with the original."""
    pruned = pruned_copy(lm.model, lm.arch, choice.plan, share=heal is None)
    if heal is None:
        return pruned, None
    ids = sample_prompts(lm, enc).to(lm.device)
    before = compare_models(lm.model, pruned, ids, lm.dtype, "the pruned model before healing",
                            lambda: ablate(lm, choice.plan))
    pruned, healing = heal(pruned, choice.plan)
    healing["pruned_before_healing_max_abs_logit_diff"] = before["max_abs_logit_diff"]
    return pruned, healing


def _export_config(lm: LoadedModel, choice: LayoutChoice):
    """The pruned model's config: the plan's head counts (the original ones for the masked layout)."""
    geometries = lm.arch.geometries(lm.model)
    shapes = ([(g.num_heads, g.num_kv_heads) for g in geometries] if choice.layout == "masked"
              else choice.plan.shapes)
    config = lm.arch.export_config(lm.config, shapes)
    if config is None:
        raise UserError(f"the {lm.config.model_type} config cannot describe the head counts {sorted(set(shapes))}; "
                        "use --layout masked")
    config.dtype = lm.dtype
    return config


def _write(lm: LoadedModel, pruned, choice: LayoutChoice, out: Path, max_shard_size: str, files=None) -> dict:
    """Weights, tokenizer and config.json: streamed from the source's safetensors ``files`` when given, else saved
    from the pruned model. A full disk mid-write removes what was written: no partial export."""
    config = _export_config(lm, choice)
    before_files = set(out.iterdir())
    written = {"streamed": files is not None}
    try:
        if files is not None:
            from transformers.utils.hub import convert_file_size_to_int

            written.update(stream_export(lm, choice.plan, files, out, convert_file_size_to_int(max_shard_size),
                                         lm.dtype))
            config.save_pretrained(out)
            if getattr(lm.model, "generation_config", None) is not None:
                lm.model.generation_config.save_pretrained(out)
        else:
            pruned.config = config
            pruned.save_pretrained(out, max_shard_size=max_shard_size)
        lm.tokenizer.save_pretrained(out)
    except BaseException:  # no partial weights stay behind (a full disk is reported by export_pruned)
        for f in set(out.iterdir()) - before_files:
            if f.is_file():
                f.unlink()
        raise
    _finish_config(lm, config, choice, out)
    return written


def _finish_config(lm: LoadedModel, config, choice: LayoutChoice, out: Path) -> None:
    """config.json as stock from_pretrained reads it (our modelling file for the per-layer layout)."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    base_class = lm.arch.causal_lm_class_name(config)
    cfg["architectures"] = [base_class]
    if choice.layout == "per-layer":
        write_text(out / "modeling_pruned.py", TEMPLATE.read_text().replace("{{BASE_ARCHITECTURE}}", base_class))
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_pruned.PrunedForCausalLM"}
        cfg["architectures"] = ["PrunedForCausalLM"]
    cfg.pop("quantization_config", None)
    write_json(cfg_path, cfg)


@torch.no_grad()
def verify_in_memory(lm: LoadedModel, choice: LayoutChoice, pruned, enc: EncodedTask | None,
                     healed: bool = False) -> dict:
    """Without a safetensors export: the pruned model in memory against the ablated original (a healed model was
    checked before healing)."""
    ids = sample_prompts(lm, enc).to(lm.device)
    if healed:
        result = {"max_abs_logit_diff": 0.0, "tolerance": 0.0, "compared_in": "checked before healing"}
    else:
        result = compare_models(lm.model, pruned, ids, lm.dtype, "the pruned model", lambda: ablate(lm, choice.plan))
    result.update(prompts=int(ids.shape[0]), tokens_per_prompt=int(ids.shape[1]),
                  dtype=str(lm.dtype).replace("torch.", ""), reloaded=False)
    result["_model"] = LoadedModel(pruned, lm.tokenizer, lm.arch, lm.source, lm.dtype, lm.device)
    return result


def _speed(lm: LoadedModel, pruned, log) -> dict:
    """The pruned model (the export's weights and shapes, sharing the rest with the original) timed against the
    original in this run (a few seconds); a failure is recorded, not fatal."""
    try:
        speed = measure(lm.model, pruned, lm.arch, lm.config.vocab_size, lm.device)
    except Exception as e:  # noqa: BLE001  (timing must never lose a verified export)
        return {"skipped": f"{type(e).__name__}: {str(e)[:120]}"}
    log(f"speed of the export against the original ({speed['dtype']}, {speed['device']}, batch {speed['batch']}): "
        f"prefill x{speed['prefill_speedup']:.2f} (FLOPs predict x{speed['flops_predicted_prefill_speedup']:.2f}), "
        f"decode x{speed['decode_speedup']:.2f}")
    return speed


def _files_digest(out: Path) -> str:
    weights = sorted(p for p in out.iterdir() if p.suffix in (".safetensors", ".json", ".gguf") and p.name != MANIFEST)
    return hashlib.sha256("".join(sha256_file(p) for p in weights).encode()).hexdigest()


def _evaluate_export(reloaded: LoadedModel, out: Path, check: ExportCheck, healing, progress: bool, log) -> dict:
    """The task on the reloaded export: accuracy, paired delta and KL against the unablated model, agreement with
    the verified ablation (and the before/after of healing)."""
    if check.evaluate_exported is not None:  # cached by the written files' content
        result = check.evaluate_exported(reloaded, _files_digest(out))
    else:
        result = evaluate(reloaded, check.enc, None, check.batch_size, progress, label="exported model")
    summary = {"n": len(result.questions), "pruned_accuracy": round(result.accuracy, 6)}
    baseline, ablated = check.baseline, check.ablated
    if baseline is not None:
        d = paired_delta(result, baseline)
        summary.update(baseline_accuracy=round(baseline.accuracy, 6), delta_points=round(d.delta, 4),
                       ci95_points=[round(d.ci_low, 4), round(d.ci_high, 4)],
                       kl_answer_nats=round(float(answer_kl(result, baseline).mean()), 6),
                       agreement_with_unablated=round(agreement(result, baseline), 6))
    if ablated is not None:
        summary["agreement_with_verified"] = round(float((result.pred == ablated.pred).double().mean()), 6)
        if healing is not None and baseline is not None:  # what was verified before healing, for before/after
            d = paired_delta(ablated, baseline)
            summary["before_healing"] = {"accuracy": round(ablated.accuracy, 6), "delta_points": round(d.delta, 4),
                                         "kl_answer_nats": round(float(answer_kl(ablated, baseline).mean()), 6)}
        elif healing is not None:
            summary["before_healing"] = {"accuracy": round(ablated.accuracy, 6)}
    log(f"exported model: {check.enc.task} {100 * result.accuracy:.2f}% on {summary['n']} questions")
    return summary


def export_stats(lm: LoadedModel, parameters: int, choice: LayoutChoice, heads: HeadSet,
                 source_parameters: int | None = None) -> dict:
    """Parameters, heads and KV cache before and after as the files hold them (``parameters``: the export's, a
    tied LM head counted once), what the weights lose, and whether the export was padded back to the original shape
    (masked, or uniform padding every layer back): then the heads are silenced, not removed."""
    geometries = lm.arch.geometries(lm.model)
    head_dim = lm.arch.head_dim(lm.config)
    shapes = [(g.num_heads, g.num_kv_heads) for g in geometries]
    before = model_stats(source_parameters or model_parameters(lm.model), shapes, head_dim, lm.dtype)
    after = model_stats(parameters, shapes if choice.layout == "masked" else choice.plan.shapes, head_dim, lm.dtype)
    removed = {"query_heads": before["query_heads"] - after["query_heads"],
               "kv_heads": before["kv_heads"] - after["kv_heads"],
               "parameters": before["parameters"] - after["parameters"]}
    return {"before": before, "after": after, "removed": removed, "heads_silenced": len(heads),
            "padded_to_original_shape": bool(heads) and removed["parameters"] == 0,
            "tied_embeddings": is_tied(lm.config)}


def _manifest(lm, heads, choice, stats, verification, task_eval, healing, info: dict, enc) -> dict:
    return {
        "format": "prune-heads/2",
        "prune_heads_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source_model": {**lm.source.to_json(), **({"hub_id": lm.source.spec} if lm.source.kind == "hub" else {})},
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
        "stats": stats,
        "verification": verification,
        "task_eval": task_eval,
        "healing": healing,
        "warnings": info.get("warnings", []),
        "confirmation": info.get("confirmation"),
        "dtype": str(lm.dtype).replace("torch.", ""),
    }


def read_manifest(directory: Path) -> dict:
    """The manifest of a complete, verified export, or a UserError saying what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory} is not a prune-heads export (no {MANIFEST}); export one with prune-heads or "
                        "prune-heads export")
    meta = check_manifest(read_json(path, "manifest"), path)
    if not meta.get("verified"):
        raise UserError(f"{directory} was not verified; export it again")
    for name, digest in (meta.get("files") or {}).items():
        f = Path(directory) / name
        if not f.is_file():
            raise UserError(f"{directory} is incomplete: {name} is missing; export the model again")
        if sha256_file(f) != digest:
            raise UserError(f"{directory} was modified after export: {name} does not match its recorded sha256; "
                            "export again")
    return meta
