"""Export a head set: physically prune, write a safetensors checkpoint that stock ``from_pretrained`` loads,
reload it in the same run and check it computes what was verified.

Files: ``model*.safetensors`` (+ index when sharded), ``config.json``, ``generation_config.json``, tokenizer
files, ``prune_heads.json`` (what was removed and why, written last with a ``verified`` flag and every file's
sha256), ``README.md`` (model card) and, for the per-layer layout, ``modeling_pruned.py``.

The stages of ``export_pruned``, in order: plan -> prune (and heal) -> write -> reload and compare logits -> run in
vLLM (when one is found) -> evaluate the task on the reloaded model -> card and manifest.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exporters.card import model_card
from exporters.checkpoint import reload_export, write_checkpoint
from exporters.gguf.export import export_gguf
from exporters.logits import SpilledLogits, check_logits, compare_models, reference_logits, sample_prompts
from exporters.manifest import MANIFEST, build_manifest, export_bytes, export_stats, files_digest, sealed
from exporters.runtimes.vllm_check import VllmCheck, not_verified, prepare_vllm
from exporters.speed import measure_speed as measure
from exporters.speed import speedup_text
from exporters.stream import streamable
from prune_heads import memory
from prune_heads.console import say
from prune_heads.errors import UserError
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.encoding import EncodedTask
from prune_heads.eval.passes import task_loglik
from prune_heads.eval.results import EvalResult, agreement, answer_kl, paired_delta
from prune_heads.heads import HeadSet
from prune_heads.io.diskspace import check_space, disk_full_reported
from prune_heads.io.files import sha256_file, write_json, write_text
from prune_heads.models.adapters import adapter_for
from prune_heads.models.counting import checkpoint_parameters, model_parameters
from prune_heads.models.loading import LoadedModel
from prune_heads.models.placement import input_device, release_weights
from prune_heads.plan.ablation import ablate
from prune_heads.plan.healing import Healer
from prune_heads.plan.planner import LayoutChoice, Planner, planner_for
from prune_heads.plan.slicing import pruned_copy
from prune_heads.timings import stage

REFERENCE_DIR = ".reference-logits"  # hidden: not part of the model, gone once the reload is checked


@dataclass(frozen=True)
class ExportOptions:
    """How an export is written: the layout (auto, uniform, per-layer, masked), the largest safetensors shard, the
    formats (safetensors, gguf) and the GGUF's tensor type, progress bars, whether to time the export against the
    original, whether the caller is done with the source model (its weights are released once the reference logits
    are taken, so the reload is never resident beside it), from_pretrained's placement of the reload
    (device_map, max_memory, offload_folder: as the user would load it), and the Python that runs the export in vLLM
    (``vllm_python``; else $PRUNE_HEADS_VLLM_PYTHON, else this one if it has vLLM; none: not verified in vLLM)."""

    layout: str = "auto"
    max_shard_size: str = "2GB"
    formats: tuple[str, ...] = ("safetensors",)
    gguf_type: str = "f16"
    progress: bool = True
    measure_speed: bool = True
    release_source: bool = False
    placement: dict | None = None
    vllm_python: str | None = None


@dataclass(frozen=True)
class ExportCheck:
    """What the reloaded export is evaluated on, beyond the logit check: the task, the unablated model's and the
    verified ablation's results on it, and the run's cached work (the export's evaluation is then cached by the
    written files' content; without it the task is evaluated plainly)."""

    enc: EncodedTask
    baseline: EvalResult | None = None
    ablated: EvalResult | None = None
    work: Work | None = None
    batch_size: int = 8


@dataclass
class ExportResult:
    choice: LayoutChoice
    stats: dict
    verification: dict
    task_eval: dict | None
    manifest: dict = field(default_factory=dict)
    speed: dict | None = None  # prefill/decode tokens/s of the export against the original (exporters/speed.py)
    gguf: dict | None = None  # the GGUF written and its check in llama.cpp (exporters/gguf/export.py)
    vllm: dict | None = None  # the export run in vLLM (exporters/runtimes/vllm_check.py)


def export_pruned(lm: LoadedModel, heads: HeadSet, out: Path, options: ExportOptions = ExportOptions(), *,
                  check: ExportCheck | None = None, info: dict | None = None, healer: Healer | None = None,
                  planner: Planner | None = None) -> ExportResult:
    """Write the pruned model into ``out`` (an existing, empty staging directory) in ``options.formats`` and verify
    it there.

    ``healer`` (LoRA healing) heals the physically pruned model once it is checked against the ablated original;
    the export then ships, and is verified against, the healed model. ``info``: what the manifest and the card say
    of where the heads came from (scorer, budget, heads file, warnings, confirmation)."""
    geometries = lm.arch.geometries(lm.model)
    heads.validate(len(geometries), [g.num_heads for g in geometries])
    choice = (planner or planner_for(lm)).choose(heads, options.layout)
    say(f"layout {choice.layout}: {choice.reason}")
    formats = options.formats
    files = streamable(lm) if "safetensors" in formats and healer is None else None
    offloaded = any(p.device.type == "meta" for p in lm.model.parameters())
    _refuse_offloaded(offloaded, files, formats)
    needed = export_bytes(lm, choice, formats, options.gguf_type, files)
    check_space(out, needed, f"the {choice.layout} export")
    with disk_full_reported(out, f"the {choice.layout} export", needed):  # from any library, any file
        enc = check.enc if check is not None else None
        shipped, gguf, healing = _write_and_check(lm, choice, out, options, enc, files, healer, offloaded)
        stats = export_stats(lm, shipped.parameters, choice, heads, shipped.source_parameters)
        verification = shipped.verification
        say(f"{'reloaded ' + out.name if 'safetensors' in formats else 'pruned model'}: max |logit diff| "
            f"{verification['max_abs_logit_diff']:.3g} (compared in {verification['compared_in']}, tolerance "
            f"{verification['tolerance']:g})")
        reloaded = verification.pop("_model")
        with stage("vllm"):
            vllm = _run_vllm(shipped.vllm, out, reloaded)
        memory.policy().between_stages()  # the logit check's float32 upcasts, before the task passes reuse the heap
        with stage("task on the export"):
            task_eval = _evaluate_export(reloaded, out, check, healing, options.progress) if check is not None else None
        del reloaded
        found = {"stats": stats, "verification": verification, "task_eval": task_eval, "healing": healing}
        meta = build_manifest(lm, heads, choice, found, info or {}, enc)
        meta.update(speed=shipped.speed, formats=list(formats), gguf=gguf, vllm=vllm)
        write_text(out / "README.md", model_card(meta))
        # Hidden files (the staging lock) and subdirectories (the result cache) are not part of the model.
        meta["files"] = {p.name: sha256_file(p) for p in sorted(out.iterdir())
                         if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
        meta["verified"] = True
        meta = sealed(meta)
        write_json(out / MANIFEST, meta)  # last: its presence with verified=true marks a complete export
        return ExportResult(choice, stats, verification, task_eval, meta, shipped.speed, gguf, vllm)


def _write_and_check(lm: LoadedModel, choice: LayoutChoice, out: Path, options: ExportOptions, enc, files,
                     healer: Healer | None, offloaded: bool) -> tuple["_WrittenModel", dict | None, dict | None]:
    """(the model that ships and its check, the GGUF's record, healing's record). The pruned copy lives only here:
    the GGUF and the safetensors files are written from it, then the original is released when the caller is done
    with it and the reload is checked; for a GGUF alone, the pruned model in memory is checked instead."""
    pruned, healing = (None, None) if offloaded else _pruned_model(lm, choice, enc, healer)
    with stage("gguf"):
        gguf = (export_gguf(lm, pruned, choice, out, options.gguf_type, sample_prompts(lm, enc), options.measure_speed,
                            healed=healing is not None) if "gguf" in options.formats else None)
    if "safetensors" not in options.formats:
        shipped = _WrittenModel(verify_in_memory(lm, choice, pruned, enc, healed=healing is not None),
                                _speed(lm, pruned) if options.measure_speed else None, model_parameters(pruned))
        return shipped, gguf, healing
    memory.policy().between_stages()  # what the search left free goes back before the reference logits and shards
    shipped = _write_safetensors(lm, pruned, healing, choice, out, options, enc, files)
    shipped.vllm = _prepare_vllm(lm, choice, out, shipped.reference["ids"], options, offloaded, files)
    del pruned  # the last reference to the pruned copy (it shares the original's weights)
    released = options.release_source and not getattr(lm.model, "hf_device_map", None)
    if released:
        release_weights(lm.model)  # the caller is done with the original: free its weights before the reload
    with stage("reload check"):
        _check_reload(lm, choice, out, shipped, released, options.placement)
    return shipped, gguf, healing


@dataclass
class _WrittenModel:
    verification: dict  # with "_model": the model the task is evaluated on
    speed: dict | None
    parameters: int  # the pruned model's
    source_parameters: int | None = None  # counted in the source files when streamed (an offloaded model's own
    # parameters() do not all show)
    reference: dict | None = None  # the reference logits the reload is checked against, until it is
    vllm: VllmCheck | dict | None = None  # the vLLM check, prepared before the source is released (or why not)


def _prepare_vllm(lm: LoadedModel, choice: LayoutChoice, out: Path, ids: torch.Tensor, options: ExportOptions,
                  offloaded: bool, files) -> VllmCheck | dict:
    """The vLLM stage, prepared while the original is loaded (or the record of why not)."""
    if offloaded:
        return not_verified("part of the model was offloaded to disk; run the export in vLLM where it fits")
    return prepare_vllm(lm, choice, out, ids, options.vllm_python, options.measure_speed, files)


def _run_vllm(check: VllmCheck | dict | None, out: Path, reloaded: LoadedModel) -> dict | None:
    """The reloaded export and the unpruned model in vLLM (the record), once the reload is checked."""
    if not isinstance(check, VllmCheck):
        return check
    return check.compare(out, reloaded.model, reloaded.dtype != torch.float32)


def _refuse_offloaded(offloaded: bool, files, formats) -> None:
    """A model partly offloaded to disk exports only by streaming from its safetensors files."""
    if not offloaded:
        return
    if "gguf" in formats:
        raise UserError("part of the model is offloaded to disk (`device_map`); a GGUF is written from the model in "
                        "memory: use `export_format` safetensors here, or export the GGUF where the model fits")
    if files is None:
        raise UserError("part of the model is offloaded to disk (`device_map`), and it is not a plain safetensors "
                        "checkpoint the export could be streamed from; run prune-heads export `heads_file` "
                        "OUT/heads.json where the model fits in memory")


def _write_safetensors(lm: LoadedModel, pruned, healing, choice: LayoutChoice, out: Path, options: ExportOptions,
                       enc, files) -> _WrittenModel:
    """The files first (streamed from the source's safetensors when it can be), then the reference logits (the
    ablated original, or the healed model: full-vocabulary float32 logits, 0.24x of a 0.5B bf16 model's weights,
    so not held beside a shard being written), then the pruned model timed against the original while they share
    weights. The reload and its check come after the caller has let go of what it no longer needs."""
    written = write_checkpoint(lm, pruned, choice, out, options.max_shard_size, files)
    ids = sample_prompts(lm, enc).to(lm.device)
    spilled = SpilledLogits(out / REFERENCE_DIR)  # on disk until the reload is checked (removed then)
    if healing is not None:
        expected, precision = reference_logits(pruned, ids, lm.dtype, into=spilled)
    else:
        expected, precision = reference_logits(lm.model, ids, lm.dtype, lambda: ablate(lm, choice.plan), into=spilled)
    if written["streamed"]:
        say(f"written from {len(set(files.values()))} source safetensors file(s) tensor by tensor: "
            f"{len(written['files'])} shard(s)")
    speed = _speed(lm, pruned) if options.measure_speed and pruned is not None else None
    # What the files hold, counted as the loaded model has it (a tied LM head once): the one count of the card,
    # the manifest and the report.
    parameters = checkpoint_parameters(sorted(out.glob("*.safetensors")), lm.config)
    source = checkpoint_parameters(sorted(set(files.values())), lm.config) if files is not None else None
    return _WrittenModel({}, speed, parameters, source,
                         {"ids": ids, "expected": expected, "precision": precision, "streamed": written["streamed"]})


def _check_reload(lm: LoadedModel, choice: LayoutChoice, out: Path, shipped: _WrittenModel, released: bool,
                  placement: dict | None) -> None:
    """Load the written files as a user would and check their logits against the reference taken before."""
    reference = shipped.reference
    reloaded = reload_export(lm, choice, out, placement)
    ids = reference["ids"]
    result = check_logits(reloaded, ids.to(input_device(reloaded)), reference["expected"], lm.dtype,
                          reference["precision"], f"the exported model in {out}")
    shutil.rmtree(out / REFERENCE_DIR)
    result.update(prompts=int(ids.shape[0]), tokens_per_prompt=int(ids.shape[1]),
                  dtype=str(lm.dtype).replace("torch.", ""), streamed=reference["streamed"], source_released=released)
    result["_model"] = LoadedModel(reloaded, lm.tokenizer, adapter_for(reloaded.config.model_type), lm.source,
                                   lm.dtype, input_device(reloaded))
    shipped.verification, shipped.reference = result, None


def _pruned_model(lm: LoadedModel, choice: LayoutChoice, enc: EncodedTask | None, healer: Healer | None):
    """A physically pruned copy (healed if asked, after checking the unhealed copy against the ablation). Without
    healing it shares every unsliced weight with the original."""
    pruned = pruned_copy(lm.model, lm.arch, choice.plan, share=healer is None)
    if healer is None:
        return pruned, None
    ids = sample_prompts(lm, enc).to(lm.device)
    before = compare_models(lm.model, pruned, ids, lm.dtype, "the pruned model before healing",
                            lambda: ablate(lm, choice.plan))
    pruned, healing = healer.heal(pruned, choice.plan)
    healing["pruned_before_healing_max_abs_logit_diff"] = before["max_abs_logit_diff"]
    return pruned, healing


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


def _speed(lm: LoadedModel, pruned) -> dict:
    """The pruned model (the export's weights and shapes, sharing the rest with the original) timed against the
    original in this run (a few seconds); a failure is recorded, not fatal."""
    try:
        with stage("speed"):
            speed = measure(lm.model, pruned, lm.arch)
    except Exception as e:  # noqa: BLE001  (timing must never lose a verified export)
        return {"skipped": f"{type(e).__name__}: {str(e)[:120]}"}
    say(f"speed of the export against the original ({speed['dtype']}, {speed['device']}, batch {speed['batch']}): "
        f"prefill {speedup_text(speed, 'prefill')} (FLOPs predict x{speed['flops_predicted_prefill_speedup']:.2f}), "
        f"decode {speedup_text(speed, 'decode')}")
    return speed


def _evaluate_export(reloaded: LoadedModel, out: Path, check: ExportCheck, healing, progress: bool) -> dict:
    """The task on the reloaded export: accuracy, paired delta and KL against the unablated model, agreement with
    the verified ablation (and the before/after of healing)."""
    if check.work is not None:  # cached by the written files' content
        result = check.work.task_result_of(check.enc, reloaded, f"export:{files_digest(out)}", "exported model")
    else:
        result = task_loglik(reloaded, check.enc, None, check.batch_size, progress, label="exported model")
    summary = {"n": len(result.questions), "pruned_accuracy": round(result.accuracy, 6)}
    baseline, ablated = check.baseline, check.ablated
    if baseline is not None:
        d = paired_delta(result, baseline)
        summary.update(baseline_accuracy=round(baseline.accuracy, 6), delta_points=round(d.delta, 4),
                       ci95_points=[round(d.ci_low, 4), round(d.ci_high, 4)],
                       kl_answer_nats=round(float(answer_kl(result, baseline).mean()), 6),
                       agreement_with_unablated=round(agreement(result, baseline), 6))
    if ablated is not None:
        summary["agreement_with_verified"] = round(agreement(result, ablated), 6)
        if healing is not None and baseline is not None:  # what was verified before healing, for before/after
            d = paired_delta(ablated, baseline)
            summary["before_healing"] = {"accuracy": round(ablated.accuracy, 6), "delta_points": round(d.delta, 4),
                                         "kl_answer_nats": round(float(answer_kl(ablated, baseline).mean()), 6)}
        elif healing is not None:
            summary["before_healing"] = {"accuracy": round(ablated.accuracy, 6)}
    say(f"exported model: {check.enc.task} {100 * result.accuracy:.2f}% on {summary['n']} questions")
    return summary
