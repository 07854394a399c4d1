"""Export a head set: physically prune, write a safetensors checkpoint that stock ``from_pretrained`` loads,
reload it in the same run and check it computes what was verified.

Files: ``model*.safetensors`` (+ index when sharded), ``config.json``, ``generation_config.json``, tokenizer
files, ``prune_heads.json`` (what was removed and why, written last with a ``verified`` flag and every file's
sha256), ``README.md`` (model card) and, for the per-layer layout, ``modeling_pruned.py``.
"""
from __future__ import annotations

import datetime
import errno
import hashlib
import json
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prune_heads import __version__
from prune_heads.ablation import ablate
from prune_heads.errors import UserError
from prune_heads.evaluation import EncodedTask, EvalResult, agreement, answer_kl, evaluate, paired_delta
from prune_heads.fileio import read_json, sha256_file, write_json, write_text
from prune_heads.heads import HeadSet
from prune_heads.models.adapters import adapter_for
from prune_heads.models.loading import LoadedModel
from prune_heads.pruning import pruned_copy

from .card import model_card
from .layouts import LayoutChoice, choose_layout

MANIFEST = "prune_heads.json"
TEMPLATE = Path(__file__).parent / "templates" / "modeling_pruned.py"
# Relative to the largest |logit|: the pruned model runs the same arithmetic on fewer heads, but kernels pick
# other blockings for other shapes, so float32 differs in the last bits (~1e-5 relative after 30 layers). In bf16 the
# rounding of different shapes alone reaches a few % after 30 layers, which is why comparisons run in float32
# whenever memory allows (see compare_models); the bf16 tolerance is the fallback for models that do not fit.
LOGIT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass
class ExportResult:
    choice: LayoutChoice
    stats: dict
    verification: dict
    mmlu: dict | None
    manifest: dict = field(default_factory=dict)


def _bytes_per_value(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def model_stats(model, plan_or_layouts, dtype) -> dict:
    shapes = plan_or_layouts
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "query_heads": sum(h for h, _ in shapes),
        "kv_heads": sum(k for _, k in shapes),
        "kv_cache_bytes_per_token": sum(2 * k for _, k in shapes) * _head_dim(model) * _bytes_per_value(dtype),
    }


def _head_dim(model) -> int:
    cfg = model.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sample_prompts(lm: LoadedModel, enc: EncodedTask | None, n: int = 4, length: int = 96) -> torch.Tensor:
    """A few real prompts (MMLU contexts, truncated) for the logit comparison; token ids 0.. otherwise."""
    if enc is not None and len(enc):
        seqs = [it.context[-length:] for it in enc.items[:n]]
        m = min(len(s) for s in seqs)
        return torch.tensor([s[-m:] for s in seqs])
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, lm.config.vocab_size, (n, length), generator=g)


def _check_disk(out: Path, model) -> None:
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(out).free
    if free < need * 1.05 + (64 << 20):
        raise UserError(f"not enough disk space in {out}: the export needs about {need / 2**30:.2f} GiB, "
                        f"{free / 2**30:.2f} GiB are free; free some space or choose another --out")


def export_pruned(
    lm: LoadedModel,
    heads: HeadSet,
    out: Path,
    layout: str = "auto",
    max_shard_size: str = "2GB",
    enc: EncodedTask | None = None,
    baseline: EvalResult | None = None,
    ablated: EvalResult | None = None,
    info: dict | None = None,
    batch_size: int = 8,
    progress: bool = True,
    log=print,
    evaluate_exported=None,
    heal_fn=None,
) -> ExportResult:
    """Write the pruned model into ``out`` (an existing, empty staging directory) and verify it there.

    ``heal_fn(pruned_model, plan) -> (healed_model, record)`` (LoRA healing) runs on the physically pruned model once
    it is checked against the ablated original; the export then ships, and is verified against, the healed model."""
    info = info or {}
    layouts = lm.adapter.layouts(lm.model)
    heads.validate(len(layouts), [lay.num_heads for lay in layouts])
    choice = choose_layout(layout, heads, layouts, lm.adapter, lm.config, _bytes_per_value(lm.dtype))
    log(f"layout {choice.layout}: {choice.reason}")

    # 1. Physically prune a copy and give it a config that describes the new shapes.
    pruned = pruned_copy(lm.model, lm.adapter, choice.plan)
    healing = None
    if heal_fn is not None:
        ids = sample_prompts(lm, enc).to(lm.device)
        before = compare_models(lm.model, pruned, ids, lm.dtype, "the pruned model before healing",
                                lambda: ablate(lm, choice.plan))
        pruned, healing = heal_fn(pruned, choice.plan)
        healing["pruned_before_healing_max_abs_logit_diff"] = before["max_abs_logit_diff"]
    if choice.layout == "masked":
        config = lm.adapter.export_config(lm.config, [(lay.num_heads, lay.num_kv_heads) for lay in layouts])
    else:
        config = lm.adapter.export_config(lm.config, choice.plan.shapes)
    if config is None:
        raise UserError(f"the {lm.config.model_type} config cannot describe the head counts {sorted(set(choice.plan.shapes))}; "
                        "use --layout masked")
    config.dtype = lm.dtype
    pruned.config = config
    _check_disk(out, pruned)

    # 2. Write it. A full disk mid-write removes what was written, so no partial export is left behind.
    before_files = set(out.iterdir())
    try:
        pruned.save_pretrained(out, max_shard_size=max_shard_size)
        lm.tokenizer.save_pretrained(out)
    except OSError as e:
        for f in set(out.iterdir()) - before_files:
            if f.is_file():
                f.unlink()
        if e.errno == errno.ENOSPC:
            raise UserError(f"the disk filled up while writing the export to {out}; the partial files were removed; "
                            "free some space and rerun the same command (finished evaluations are cached)") from None
        raise
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    base_arch = type(lm.model).__name__.replace(type(lm.config).__name__.replace("Config", ""), type(config).__name__.replace("Config", ""))
    cfg["architectures"] = [base_arch]
    if choice.layout == "per-layer":
        write_text(out / "modeling_pruned.py", TEMPLATE.read_text().replace("{{BASE_ARCHITECTURE}}", base_arch))
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_pruned.PrunedForCausalLM"}
        cfg["architectures"] = ["PrunedForCausalLM"]
    cfg.pop("quantization_config", None)
    write_json(cfg_path, cfg)

    # 3. Reload from disk and check it computes what was verified.
    verification = verify_export(lm, choice, out, enc, progress=progress, reference=pruned if healing else None)
    log(f"reloaded {out.name}: max |logit diff| {verification['max_abs_logit_diff']:.3g} "
        f"(compared in {verification['compared_in']}, tolerance {verification['tolerance']:g})")
    mmlu = None
    if enc is not None:
        reloaded = verification.pop("_model")
        if evaluate_exported is not None:  # cached by the written files' content
            weights = sorted(p for p in out.iterdir() if p.suffix in (".safetensors", ".json") and p.name != MANIFEST)
            files_digest = hashlib.sha256("".join(sha256_file(p) for p in weights).encode()).hexdigest()
            pruned_result = evaluate_exported(reloaded, files_digest)
        else:
            pruned_result = evaluate(reloaded, enc, None, batch_size, progress, label="exported model")
        mmlu = {"n": len(pruned_result.questions), "pruned_accuracy": round(pruned_result.accuracy, 6)}
        if baseline is not None:
            d = paired_delta(pruned_result, baseline)
            mmlu.update(baseline_accuracy=round(baseline.accuracy, 6), delta_points=round(d.delta, 4),
                        ci95_points=[round(d.ci_low, 4), round(d.ci_high, 4)],
                        kl_answer_nats=round(float(answer_kl(pruned_result, baseline).mean()), 6),
                        agreement_with_unablated=round(agreement(pruned_result, baseline), 6))
        if ablated is not None:
            mmlu["agreement_with_verified"] = round(float((pruned_result.pred == ablated.pred).double().mean()), 6)
            if healing is not None:  # what was verified before healing, for before/after
                d = paired_delta(ablated, baseline) if baseline is not None else None
                mmlu["before_healing"] = {"accuracy": round(ablated.accuracy, 6),
                                          **({"delta_points": round(d.delta, 4),
                                              "kl_answer_nats": round(float(answer_kl(ablated, baseline).mean()), 6)}
                                             if d else {})}
        log(f"exported model: MMLU {100 * pruned_result.accuracy:.2f}% on {mmlu['n']} questions")
    verification.pop("_model", None)

    before = model_stats(lm.model, [(lay.num_heads, lay.num_kv_heads) for lay in layouts], lm.dtype)
    after_shapes = choice.plan.shapes
    after = model_stats(pruned, after_shapes, lm.dtype)
    if choice.layout == "masked":
        after["query_heads"] = before["query_heads"] - len(heads)
    stats = {"before": before, "after": after}
    del pruned

    # 4. Card, then the manifest last: its presence with verified=true marks a complete export.
    meta = {
        "format": "prune-heads/1",
        "prune_heads_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source_model": {**lm.source.to_json(), **({"hub_id": lm.source.spec} if lm.source.kind == "hub" else {})},
        "removed_heads": heads.to_json(),
        "heads_removed": len(heads),
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
        "mmlu": mmlu,
        "healing": healing,
        "warnings": info.get("warnings", []),
        "dtype": str(lm.dtype).replace("torch.", ""),
    }
    write_text(out / "README.md", model_card(meta))
    # Hidden files (the staging lock) and subdirectories (the result cache) are not part of the model.
    meta["files"] = {p.name: sha256_file(p) for p in sorted(out.iterdir())
                     if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
    meta["verified"] = True
    write_json(out / MANIFEST, meta)
    return ExportResult(choice, stats, verification, mmlu, meta)


@contextmanager
def float32_parameters(model: torch.nn.Module, enabled: bool = True):
    """The model's low-precision parameters in float32 for the duration, then back. Exact both ways: every bf16 or
    fp16 value is a float32 value. Buffers keep their dtype (RoPE's inv_freq is float32 already)."""
    changed = {}
    if enabled:
        for name, p in model.named_parameters():
            if p.dtype in (torch.bfloat16, torch.float16):
                changed[name] = p.dtype
                p.data = p.data.float()
    try:
        yield model
    finally:
        for name, p in model.named_parameters():
            if name in changed:
                p.data = p.data.to(changed[name])


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def comparison_dtype(models: list[torch.nn.Module], dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 if the largest model's float32 upcast fits in free memory (with room to spare), else ``dtype``."""
    if dtype == torch.float32:
        return dtype
    extra = max(sum(p.numel() for p in m.parameters()) for m in models) * (4 - _bytes_per_value(dtype))
    free = _available_bytes(device)
    return torch.float32 if free is not None and extra * 1.5 < free else dtype


@torch.no_grad()
def compare_models(reference: torch.nn.Module, candidate: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype,
                   what: str, reference_context=nullcontext) -> dict:
    """Check ``candidate`` computes what ``reference`` (inside ``reference_context()``, e.g. an ablation) computes on
    ``ids``: logits within tolerance, else an error. Both run in float32 when that fits in memory, so the check is
    sharp (a wrong slice moves logits by whole units, bf16 rounding alone by ~1% after 30 layers)."""
    precision = comparison_dtype([reference, candidate], dtype, ids.device)
    upcast = precision != dtype
    with float32_parameters(reference, upcast), reference_context():
        expected = reference(input_ids=ids).logits.float()
    with float32_parameters(candidate, upcast):
        got = candidate(input_ids=ids).logits.float()
    diff, tol = check_logits(expected, got, precision, what)
    return {"max_abs_logit_diff": diff, "tolerance": round(tol, 6), "compared_in": str(precision).replace("torch.", ""),
            "argmax_agreement": float((got.argmax(-1) == expected.argmax(-1)).double().mean())}


def check_logits(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, what: str) -> tuple[float, float]:
    """(max |difference|, tolerance); a difference beyond tolerance is an error, not a warning."""
    expected, got = expected.float(), got.float()
    diff = float((got - expected).abs().max())
    tol = LOGIT_RTOL.get(dtype, 1e-4) * max(1.0, float(expected.abs().max()))
    if not diff <= tol:
        raise RuntimeError(f"{what} does not reproduce the verified ablated model: max |logit diff| {diff:.3g} > "
                           f"{tol:g}; nothing was published (please report this as a bug)")
    return diff, tol


@torch.no_grad()
def verify_export(lm: LoadedModel, choice: LayoutChoice, out: Path, enc: EncodedTask | None, progress: bool = False,
                  reference=None) -> dict:
    """Reload ``out`` and compare its logits with the ablated original, or with ``reference`` (the healed model)."""
    from transformers import AutoModelForCausalLM

    trust = choice.layout == "per-layer"  # our own modelling file, written a moment ago
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=lm.dtype, trust_remote_code=trust).to(lm.device).eval()
    ids = sample_prompts(lm, enc).to(lm.device)
    what = f"the exported model in {out}"
    if reference is not None:
        result = compare_models(reference, reloaded, ids, lm.dtype, what)
    else:
        result = compare_models(lm.model, reloaded, ids, lm.dtype, what, lambda: ablate(lm, choice.plan))
    result.update(prompts=int(ids.shape[0]), tokens_per_prompt=int(ids.shape[1]), dtype=str(lm.dtype).replace("torch.", ""))
    result["_model"] = LoadedModel(reloaded, lm.tokenizer, adapter_for(reloaded.config.model_type), lm.source, lm.dtype, lm.device)
    return result


def read_manifest(directory: Path) -> dict:
    """The manifest of a complete, verified export, or a UserError saying what is wrong."""
    path = Path(directory) / MANIFEST
    meta = read_json(path, f"{directory} is not a prune-heads export (no {MANIFEST}); export one with prune-heads or "
                     "prune-heads export", f"{path} is corrupt; export the model again")
    if not meta.get("verified"):
        raise UserError(f"{directory} was not verified; export it again")
    for name, digest in (meta.get("files") or {}).items():
        f = Path(directory) / name
        if not f.is_file():
            raise UserError(f"{directory} is incomplete: {name} is missing; export the model again")
        if sha256_file(f) != digest:
            raise UserError(f"{directory} was modified after export: {name} does not match its recorded sha256; export again")
    return meta
