"""The safetensors checkpoint of an export: weights (streamed from the source's files tensor by tensor when it can be,
else saved from the pruned model), tokenizer, ``config.json`` with the plan's head counts (and, for the per-layer
layout, ``modeling_pruned.py`` with its ``auto_map`` for readers without prune-heads), and the reload a user would
do: plain ``from_pretrained``, no remote code (``import prune_heads`` registered the per-layer classes)."""
from __future__ import annotations

import json
from pathlib import Path

from exporters.stream import stream_export
from prune_heads.errors import UserError
from prune_heads.io.files import write_json, write_text
from prune_heads.models.loading import LoadedModel, dense_logits_input
from prune_heads.plan.planner import LayoutChoice
from prune_heads.runtime import MODEL_TYPE_PREFIX, pruned_classes


def _export_config(lm: LoadedModel, choice: LayoutChoice):
    """The pruned model's config: the plan's head counts (the original ones for the masked layout)."""
    geometries = lm.arch.geometries(lm.model)
    shapes = ([(g.num_heads, g.num_kv_heads) for g in geometries] if choice.layout == "masked"
              else choice.plan.shapes)
    config = lm.arch.export_config(lm.config, shapes)
    if config is None:
        raise UserError(f"the {lm.config.model_type} config cannot describe the head counts {sorted(set(shapes))}; "
                        "use `layout` masked")
    config.dtype = lm.dtype
    return config


def write_checkpoint(lm: LoadedModel, pruned, choice: LayoutChoice, out: Path, max_shard_size: str, files=None) -> dict:
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


def remote_code(family: str) -> str:
    """``modeling_pruned.py``: prune_heads.runtime's own text (torch and transformers only) and the family's two
    classes by the names ``auto_map`` gives."""
    from prune_heads import runtime

    config_class, model_class = pruned_classes(family)
    return (Path(runtime.__file__).read_text() + "\n\n# The classes this checkpoint's auto_map names.\n"
            f"{config_class.__name__}, {model_class.__name__} = pruned_classes({family!r})\n")


def _finish_config(lm: LoadedModel, config, choice: LayoutChoice, out: Path) -> None:
    """config.json as from_pretrained reads it: the stock class for shared shapes, the ``pruned_<family>`` classes
    (and the modelling file for readers without prune-heads) for per-layer head counts."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    family = config.model_type.removeprefix(MODEL_TYPE_PREFIX)
    if config.model_type.startswith(MODEL_TYPE_PREFIX):
        config_class, model_class = pruned_classes(family)
        write_text(out / "modeling_pruned.py", remote_code(family))
        cfg["auto_map"] = {"AutoConfig": f"modeling_pruned.{config_class.__name__}",
                           "AutoModelForCausalLM": f"modeling_pruned.{model_class.__name__}"}
        cfg["architectures"] = [model_class.__name__]
    else:
        cfg["architectures"] = [lm.arch.causal_lm_class_name(config)]
    cfg.pop("quantization_config", None)
    write_json(cfg_path, cfg)


def reload_export(lm: LoadedModel, choice: LayoutChoice, out: Path, placement: dict | None):
    """The written export, loaded as a user loads it: plain from_pretrained, no remote code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=lm.dtype, **(placement or {}))
    if not (placement or {}).get("device_map"):
        model.to(lm.device)
    dense_logits_input(model)
    return model.eval().requires_grad_(False)


