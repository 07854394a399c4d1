"""The GGUF stage of an export: write ``model.gguf``, then prove it in llama.cpp.

In order: write the pruned model (writer.py); write the unpruned model the same way and measure its round trip
against the unablated model (what llama.cpp's arithmetic and the tensor type alone cost); run the pruned GGUF in
llama.cpp on the sample prompts and compare its logits with the verified ablation (max |diff| within twice the round
trip's, or of the masked twin's where larger, plus 1e-3 (the twin: the same heads zeroed in the unpruned shapes,
what llama.cpp's arithmetic costs this very network), argmax agreement no more than 2 points below theirs; both
within a bound per tensor type, so a writer bug cannot widen its own tolerance); check llama.cpp's tokenizer splits
the prompts' text as the Hugging Face one does; time both GGUFs. A failed check is an error: the staging directory,
and the GGUF in it, never reaches the final name. Without llama-cpp-python the file is written and marked as not
verified in llama.cpp.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from exporters.gguf import llamacpp
from exporters.gguf.writer import write_gguf
from exporters.logits import float32_parameters
from prune_heads.console import say
from prune_heads.errors import UserError
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import ablate
from prune_heads.plan.planner import LayoutChoice, plan_masked
from prune_heads.plan.slicing import pruned_copy

GGUF_NAME = "model.gguf"
# Share of positions the pruned GGUF may agree less often than the unpruned round trip: q8_0 also quantises the
# activations, so near-ties flip by chance.
ARGMAX_SLACK = {"f32": 0.01, "f16": 0.02, "bf16": 0.03, "q8_0": 0.06}
# The round trip calibrates the tolerance only if it is sound itself: its max |logit diff| relative to the largest
# logit stays under what the tensor type alone can explain, and it agrees on the argmax almost everywhere. (A writer
# bug would otherwise widen the tolerance it is judged by.) The checks keep llama.cpp's KV cache in float32: with its
# default f16 cache even an f32 GGUF differs by ~2e-3 of the largest logit after 30 layers.
ROUND_TRIP_RTOL = {"f32": 1e-3, "f16": 2e-2, "bf16": 6e-2, "q8_0": 1e-1}
ROUND_TRIP_MIN_ARGMAX = {"f32": 0.98, "f16": 0.95, "bf16": 0.9, "q8_0": 0.8}


def export_gguf(lm: LoadedModel, pruned, choice: LayoutChoice, out: Path, tensor_type: str, ids: torch.Tensor,
                measure_speed: bool = True, healed: bool = False) -> dict:
    """Write ``out/model.gguf`` and verify it in llama.cpp (when installed): against the verified ablation, or, when
    ``healed``, against ``pruned`` itself (the healed model that ships). Returns the manifest's ``gguf``."""
    geometries = lm.arch.geometries(lm.model)
    shapes = [(g.num_heads, g.num_kv_heads) for g in geometries] if choice.layout == "masked" else choice.plan.shapes
    path = out / GGUF_NAME
    info = write_gguf(lm, pruned, shapes, path, tensor_type)
    info["bytes"] = path.stat().st_size
    say(f"wrote {GGUF_NAME} ({info['architecture']}, {tensor_type}, {info['bytes'] / 2**20:.1f} MiB)")
    if not llamacpp.available():
        say(f"llama.cpp is not installed: {GGUF_NAME} was written but not run in llama.cpp; {llamacpp.INSTALL_HINT}")
        return {**info, "verified_in_llama_cpp": False, "why_not": "llama-cpp-python is not installed"}
    scratch = out / ".gguf-unpruned"
    scratch.mkdir(exist_ok=True)
    try:
        original = scratch / GGUF_NAME
        write_gguf(lm, lm.model, [(g.num_heads, g.num_kv_heads) for g in geometries], original, tensor_type)
        check = _verify(lm, choice, path, original, ids, tensor_type, pruned if healed else None)
        speed = _speed(lm, path, original) if measure_speed else None
        original_bytes = original.stat().st_size
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**info, "verified_in_llama_cpp": True, "llama_cpp_python": llamacpp.version(), **check,
            "unpruned_bytes": original_bytes, "speed": speed}


def _reference_logits(lm: LoadedModel, ids: torch.Tensor, plan=None, model=None):
    """The transformers model's logits in float32: ``lm`` with ``plan`` ablated (the verified model), or ``model``."""
    if model is not None:
        with torch.no_grad(), float32_parameters(model, lm.dtype != torch.float32):
            return model(input_ids=ids.to(lm.device)).logits.float().cpu().numpy()
    with torch.no_grad(), float32_parameters(lm.model, lm.dtype != torch.float32), ablate(lm, plan):
        return lm.model(input_ids=ids.to(lm.device)).logits.float().cpu().numpy()


def _round_trip(lm: LoadedModel, original: Path, ids: torch.Tensor, tensor_type: str) -> tuple[dict, float]:
    """The unpruned model's GGUF against the unablated model: what llama.cpp and the tensor type alone cost, itself
    checked against the type's bound. Returns (comparison, bound)."""
    unablated = _reference_logits(lm, ids)
    roundtrip = llamacpp.compare(unablated, llamacpp.logits(llamacpp.load(original, ids.shape[1] + 8, f32_cache=True),
                                                        ids.tolist()))
    bound = ROUND_TRIP_RTOL[tensor_type] * max(1.0, float(abs(unablated).max()))
    if roundtrip["max_abs_logit_diff"] > bound or roundtrip["argmax_agreement"] < ROUND_TRIP_MIN_ARGMAX[tensor_type]:
        raise UserError(f"the unpruned model's own GGUF does not run in llama.cpp as it does in transformers "
                        f"({roundtrip}, allowed {bound:.3g} at {tensor_type}); nothing was written under `out` "
                        "(please report this as a bug)")
    return roundtrip, bound


def _masked_twin(lm: LoadedModel, choice: LayoutChoice, scratch: Path, ids: torch.Tensor, reference,
                 tensor_type: str) -> tuple[dict, object] | None:
    """The same heads zeroed in the unpruned shapes (only their o_proj columns: no slicing involved), written as a
    GGUF and run in llama.cpp against the verified ablation: what llama.cpp's arithmetic costs *this* network.
    Returns (its comparison with the verified model, its logits); None where the export is its own twin.

    An ablated network can amplify rounding far more than the unpruned one. The embedded model with layer 0 emptied,
    a KV group and single heads removed: 0.0044 at f32 and 1.27 at f16 against the verified model, where the unpruned
    round trip is 0.0001 and 0.20; in transformers alone, weights rounded to f16 move the unpruned logits by 0.042
    and this network's by 0.43; and its per-layer GGUF equals this twin in llama.cpp to the last bit. So the tolerance
    against the verified model comes from the twin, and the export must equal the twin within the unpruned round
    trip's own tolerance (a wrong slice is far outside it). The twin's writer is the one the round trip bounds; its
    argmax agreement must reach the round trip's floor for the type."""
    if choice.layout == "masked" or not choice.plan.removed:
        return None  # the export is the twin itself, or nothing was removed
    geometries = lm.arch.geometries(lm.model)
    twin = pruned_copy(lm.model, lm.arch, plan_masked(choice.plan.removed, geometries), share=True)
    path = scratch / "masked-twin.gguf"
    write_gguf(lm, twin, [(g.num_heads, g.num_kv_heads) for g in geometries], path, tensor_type)
    del twin
    logits = llamacpp.logits(llamacpp.load(path, ids.shape[1] + 8, f32_cache=True), ids.tolist())
    got = llamacpp.compare(reference, logits)
    if got["argmax_agreement"] < ROUND_TRIP_MIN_ARGMAX[tensor_type]:
        raise UserError(f"the removed heads zeroed in the unpruned shapes do not run in llama.cpp as the verified "
                        f"model does ({got}, at least {ROUND_TRIP_MIN_ARGMAX[tensor_type]:.0%} argmax agreement at "
                        f"{tensor_type}); nothing was written under `out` (please report this as a bug)")
    return got, logits


def _verify(lm: LoadedModel, choice: LayoutChoice, path: Path, original: Path, ids: torch.Tensor, tensor_type: str,
            healed=None) -> dict:
    """The GGUF in llama.cpp against the verified model: max |logit diff| within twice what llama.cpp's arithmetic
    costs the same network (the larger of the unpruned round trip and the masked twin's) plus 1e-3, argmax agreement,
    the tokenizer."""
    roundtrip, bound = _round_trip(lm, original, ids, tensor_type)
    prompts = ids.tolist()
    reference = _reference_logits(lm, ids, choice.plan, healed)
    twinned = None if healed is not None else _masked_twin(lm, choice, original.parent, ids, reference, tensor_type)
    twin = twinned[0] if twinned else None
    llm = llamacpp.load(path, ids.shape[1] + 8, f32_cache=True)
    got = llamacpp.logits(llm, prompts)
    result = llamacpp.compare(reference, got)
    # The export against its twin, both in llama.cpp: the same network in the same arithmetic up to the order of
    # sums, so within what that order costs the unpruned model; a wrong slice is far outside it.
    against_twin = llamacpp.compare(twinned[1], got)["max_abs_logit_diff"] if twinned else None
    twin_tolerance = 2 * roundtrip["max_abs_logit_diff"] + 1e-3
    texts = [lm.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
    tokens = llamacpp.tokenizer_agreement(llm, lm.tokenizer, texts)
    calibration = max([roundtrip] + ([twin] if twin else []), key=lambda r: r["max_abs_logit_diff"])
    tolerance = 2 * calibration["max_abs_logit_diff"] + 1e-3
    agreement = min(roundtrip["argmax_agreement"], twin["argmax_agreement"] if twin else 1.0)
    record = {**{k: round(v, 6) for k, v in result.items()}, "tolerance": round(tolerance, 6),
              "round_trip_bound": round(bound, 6), "prompts": len(prompts), "tokens_per_prompt": int(ids.shape[1]),
              "unpruned_round_trip": {k: round(v, 6) for k, v in roundtrip.items()}, "tokenizer_agreement": tokens,
              "masked_twin": {**{k: round(v, 6) for k, v in twin.items()},
                              "export_max_abs_logit_diff": round(against_twin, 6),
                              "tolerance": round(twin_tolerance, 6)} if twin else None}
    source = "the masked twin's" if calibration is twin else "the unpruned round trip's"
    say(f"llama.cpp runs {path.name}: max |logit diff| {result['max_abs_logit_diff']:.3g} against the verified model "
        f"(tolerance {tolerance:.3g}, from {source} {calibration['max_abs_logit_diff']:.3g}), argmax "
        f"agreement {100 * result['argmax_agreement']:.1f}% (reference {100 * agreement:.1f}%), "
        f"tokenizer agreement {100 * tokens:.0f}%")
    if (result["max_abs_logit_diff"] > tolerance or tokens < 1.0
            or (against_twin is not None and against_twin > twin_tolerance)
            or result["argmax_agreement"] < agreement - ARGMAX_SLACK[tensor_type]):
        raise UserError(f"the GGUF does not run in llama.cpp as the verified model does ({record}); nothing was "
                        "written under `out` (please report this as a bug)")
    return record


def _speed(lm: LoadedModel, path: Path, original: Path) -> dict:
    """Tokens/s of both GGUFs in llama.cpp; a failure is recorded, never fatal."""
    try:
        speed = llamacpp.speed(path, original, vocab=int(lm.config.vocab_size))
    except Exception as e:  # noqa: BLE001  (timing must never lose a verified export)
        return {"skipped": f"{type(e).__name__}: {str(e)[:120]}"}
    say(f"llama.cpp speed ({speed['threads']} threads): prompt {speed['pruned_prompt_tokens_per_s']:.0f} tok/s vs "
        f"{speed['original_prompt_tokens_per_s']:.0f} (x{speed['prompt_speedup']:.2f}), generation "
        f"{speed['pruned_generation_tokens_per_s']:.0f} vs {speed['original_generation_tokens_per_s']:.0f} tok/s "
        f"(x{speed['generation_speedup']:.2f})")
    return speed
