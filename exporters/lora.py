"""Slice a peft LoRA adapter trained on the unpruned base so that it fits a pruned export, using the export's plan:
the adapter's files checked, sliced tensor by tensor (``prune_heads.plan.slicing.sliced_lora_state``: how each LoRA
tensor follows the plan), written, and loaded on the export with peft to check it."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from exporters.logits import compare_models, sample_prompts
from exporters.manifest import read_manifest, source_name
from prune_heads.console import say, warn
from prune_heads.errors import UserError
from prune_heads.io.files import atomic_path, write_json
from prune_heads.io.readers import check_adapter_config, read_json
from prune_heads.models.adapters import ArchAdapter, adapter_for
from prune_heads.models.checks import check_finite
from prune_heads.models.counting import safetensors_shapes
from prune_heads.plan.ablation import ablate
from prune_heads.plan.planner import PrunePlan
from prune_heads.plan.slicing import sliced_lora_state, sliced_lora_tensor

LORA_PARTS = (".lora_A.", ".lora_B.", "lora_magnitude_vector")  # what peft saves of a LoRA (DoRA) module


def _refuse_unsliceable(config: dict, names, arch: ArchAdapter, adapter_dir: Path) -> None:
    """An adapter that trains a projection the export changes as a whole (``modules_to_save``: a full copy of its
    weight) cannot be sliced into a LoRA of the pruned shapes; one with no LoRA tensor at all adapts nothing."""
    saved = [m for m in config.get("modules_to_save") or [] if m in arch.projections]
    pattern = arch.attention_key()
    whole = [n for n in names if pattern.search(n) and not any(part in n for part in LORA_PARTS)]
    if saved or whole:
        what = ", ".join(saved) if saved else whole[0]
        raise UserError(f"adapter {adapter_dir} saves whole attention projections ({what}: `modules_to_save`), "
                        "whose shapes the pruning changes; they cannot be sliced into the export: re-train without "
                        "them in modules_to_save, or merge the adapter into the base before pruning (`adapter`)")
    if not any(".lora_A." in n for n in names):
        raise UserError(f"adapter {adapter_dir} holds no LoRA tensors (its target_modules "
                        f"{config.get('target_modules')!r} matched no module when it was saved); pass a trained "
                        "adapter")


def read_adapter_config(adapter_dir: Path) -> dict:
    """The adapter_config.json of a peft LoRA adapter directory, or a UserError saying what it is not."""
    cfg_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise UserError(f"{adapter_dir} is not a peft adapter (needs adapter_config.json and "
                        "adapter_model.safetensors)")
    config = check_adapter_config(read_json(cfg_path, "adapter config"), cfg_path)
    if config.get("peft_type") != "LORA":
        raise UserError(f"{adapter_dir} is a {config['peft_type']} adapter; only LoRA (and DoRA) adapters can be "
                        "sliced")
    return config


def _expected_width(kind: str, is_a: bool, geo, hidden: int) -> tuple[int, int]:
    """(dimension, size) a LoRA tensor of a projection of ``kind`` must have on the unpruned base: lora_A's input
    columns (dim 1), lora_B's output rows (dim 0)."""
    if kind == "o":
        return (1, geo.num_heads * geo.head_dim) if is_a else (0, hidden)
    if is_a:
        return 1, hidden
    rows = {"q": geo.num_heads, "kv": geo.num_kv_heads, "qkv": geo.num_heads + 2 * geo.num_kv_heads}[kind]
    return 0, rows * geo.head_dim


def _names_source(named: str, source: dict) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the export's source (a Hub id, its path, or the
    directory's name: adapters trained on a local copy name wherever that copy was)."""
    candidates = {str(source.get(k)) for k in ("name", "spec", "path", "hub_id") if source.get(k)}
    return named in candidates or Path(named).name in {Path(c).name for c in candidates}


def check_adapter_fits(shapes: dict[str, tuple[int, ...]], plan: PrunePlan, hidden: int, arch: ArchAdapter,
                       adapter_dir: Path, source: str) -> None:
    """The adapter was trained on the pruned model's source: every attention LoRA tensor has the shape that base's
    projection gives it (layer by layer, from the plan's original geometry), and no layer lies beyond it."""
    pattern = arch.attention_key()
    for name, shape in shapes.items():
        m = pattern.search(name)
        if not m or ("lora_A" not in name and "lora_B" not in name):
            continue
        layer, projection = int(m.group(1)), m.group(2)
        if layer >= len(plan.layers):
            raise UserError(f"adapter {adapter_dir} has layer {layer}, but the pruned model's source {source} has "
                            f"{len(plan.layers)} layers: it was trained on another base; pass an adapter of {source}")
        dim, size = _expected_width(arch.projections[projection], "lora_A" in name, plan.layers[layer].geometry,
                                    hidden)
        if len(shape) != 2 or shape[dim] != size:
            raise UserError(f"adapter {adapter_dir} does not fit the pruned model's source {source}: {name} has shape "
                            f"{list(shape)}, that base's layer {layer} {projection} needs {size} in dimension {dim}; "
                            f"it was trained on another base; pass an adapter of {source}")


def slice_adapter(adapter_dir: str | Path, pruned_dir: str | Path, out: str | Path, check: bool = True) -> Path:
    """Write ``adapter_dir``'s LoRA adapter, sliced by the plan in ``pruned_dir``'s manifest, into ``out``;
    ``check``: load it there with peft and check it against the plan (:func:`check_loads`; the main command checks
    the merged model's logits instead)."""
    adapter_dir, pruned_dir, out = Path(adapter_dir), Path(pruned_dir), Path(out)
    config = read_adapter_config(adapter_dir)
    meta = read_manifest(pruned_dir)
    plan = PrunePlan.from_json(meta.get("plan") or {})
    weights_path = adapter_dir / "adapter_model.safetensors"
    model_config = read_json(pruned_dir / "config.json", "pruned model config")
    model_type = model_config.get("model_type") if isinstance(model_config, dict) else None
    arch = adapter_for(model_type)
    source = source_name(meta)
    check_adapter_fits(safetensors_shapes([weights_path]), plan, int(model_config["hidden_size"]), arch, adapter_dir,
                       source)
    named = config.get("base_model_name_or_path")
    if named and not _names_source(named, meta["source_model"]):
        warn(f"adapter {adapter_dir} names {named} as its base, the export was pruned from {source}; its "
             "tensor shapes fit that model, so it is sliced: check it is the adapter you meant")
    state = load_file(str(weights_path))
    _refuse_unsliceable(config, list(state), arch, adapter_dir)
    check_finite(state.items(), str(adapter_dir), "adapter tensors")
    sliced = sliced_lora_state(state, plan, arch)
    config["base_model_name_or_path"] = str(pruned_dir.resolve())
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "adapter_model.safetensors") as tmp:
        save_file(sliced, tmp, metadata={"format": "pt"})
    write_json(out / "adapter_config.json", config)
    if check:
        modules = check_loads(pruned_dir, out, state, plan, arch)
        say(f"loaded on {pruned_dir} with peft: each of {modules} LoRA modules changes the weights as the original "
            "adapter changes the kept heads")
    say(f"sliced {len(state)} adapter tensors to {len(sliced)} for {pruned_dir}")
    return out


@torch.no_grad()
def check_loads(pruned_dir: Path, adapter_out: Path, state: dict, plan: PrunePlan, arch: ArchAdapter) -> int:
    """Load the sliced adapter on the pruned export with peft, as a user does, and check every LoRA module it
    builds: its weight change (peft's ``get_delta_weight``) equals the original adapter's change (B A, scaled),
    sliced by the plan. Returns the number of modules checked; a UserError if peft cannot load it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pruned_dir, dtype=torch.float32)
    try:
        model = PeftModel.from_pretrained(base, adapter_out)
    except Exception as e:  # noqa: BLE001  (peft raises many kinds of errors for an adapter that does not fit)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"the sliced adapter does not load on {pruned_dir} with peft ({type(e).__name__}: {first}); "
                        "nothing was written under `out`") from None
    pattern, checked = arch.attention_key(), 0
    for name, module in model.named_modules():
        found = pattern.search(name + ".weight")
        if not found or "default" not in getattr(module, "lora_A", {}):
            continue
        lp, kind = plan.layers[int(found.group(1))], arch.projections[found.group(2)]
        a, b = state[f"{name}.lora_A.weight"].float(), state[f"{name}.lora_B.weight"].float()  # peft's own names
        expected = sliced_lora_tensor(f"{name}.lora_{'A' if kind == 'o' else 'B'}.weight", kind,
                          (b @ a) * module.scaling["default"], lp, arch)
        got = module.get_delta_weight("default").float()
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-6):
            raise UserError(f"the sliced adapter's {found.group(2)} of layer {found.group(1)} does not change the "
                            "pruned weights as the original changes the kept heads; nothing was written under `out` "
                            "(please report this as a bug)")
        checked += 1
    return checked


@torch.no_grad()
def load_sliced(merged, pruned_dir: Path, adapter_out: Path):
    """The pruned base in ``pruned_dir`` with the sliced adapter merged in, on the device and dtype of ``merged``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pruned_dir, dtype=merged.dtype)
    return PeftModel.from_pretrained(base, adapter_out).merge_and_unload().to(merged.device).eval()


def check_sliced(merged, model, plan: PrunePlan, enc) -> dict:
    """Logits of pruned base + sliced adapter against the verified model (base + adapter merged, ablated)."""
    ids = sample_prompts(merged, enc).to(merged.device)
    return compare_models(
        merged.model, model, ids, merged.dtype, "pruned base + sliced adapter", lambda: ablate(merged, plan)
    )
