"""A model the user holds, as the core reads one: the family's adapter, where the model sits, a source that keys the
cache by its weights, and the run's settings from keyword arguments, checked as the command line checks its flags.

Every keyword argument of the API's functions that is not its own is a setting of the main command, by the name
``Settings`` gives it (``prune_heads.pipeline.settings``): ``max_length=512``, ``guard=()``, ``recipe="smollm2"``;
``mmlu_per_subject`` also takes ``"all"`` and ``"auto"`` as the flag does.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Protocol, Union

import torch

from prune_heads.errors import AlreadyPruned, UnsupportedModel, UserError
from prune_heads.heads import HeadSet
from prune_heads.models.adapters import adapter_for
from prune_heads.models.loading import LoadedModel, ModelSource
from prune_heads.models.placement import input_device
from prune_heads.pipeline.inputs import Inputs, load_inputs
from prune_heads.pipeline.merging import resolve_settings
from prune_heads.pipeline.settings import Settings


class HasHeads(Protocol):
    """A result that carries a head set (``HeadSelection``)."""

    heads: HeadSet


# Heads as the public functions take them: {layer: [head, ...]} (heads.json's form), a HeadSet, or a HeadSelection.
Heads = Union[Mapping[int, Sequence[int]], HeadSet, HasHeads]

# A keyword argument that is not a field of Settings: resolve_settings reads it (the budget's metric).
EXTRA_SETTINGS = ("metric",)
# Settings that describe how the command line loads a model, meaningless for a model already in memory.
LOADING_SETTINGS = ("model", "device", "device_map", "max_memory", "dtype", "trust_remote_code", "allow_pickle",
                    "revision", "resume", "lora_adapter", "vllm_python", "max_shard_size", "export_format",
                    "gguf_type", "measure_speed", "export")


def is_peft(model) -> bool:
    """A peft ``PeftModel`` (checked without importing peft)."""
    return type(model).__module__.split(".")[0] == "peft" and hasattr(model, "get_base_model")


def causal_lm(model) -> torch.nn.Module:
    """The transformers model under ``model`` (a PeftModel's base), checked to be one prune-heads can read."""
    base = model.get_base_model() if is_peft(model) else model
    config = getattr(base, "config", None)
    if not isinstance(base, torch.nn.Module) or not hasattr(config, "model_type"):
        raise UnsupportedModel(f"{type(model).__name__} is not a transformers model; pass a PreTrainedModel (e.g. "
                               "AutoModelForCausalLM.from_pretrained(...)) or a peft PeftModel around one")
    if base.get_output_embeddings() is None:
        raise UnsupportedModel(f"{type(base).__name__} has no language-model head; load the checkpoint with "
                               "AutoModelForCausalLM")
    return base


def in_place(model, tokenizer=None) -> LoadedModel:
    """The model itself (a PeftModel's base, its LoRA layers in place) as the core reads it, no copy: what ``ablate``
    and ``prune`` act on."""
    base = causal_lm(model)
    arch = adapter_for(base.config.model_type)
    check_unpruned(base, arch)
    return _loaded(base, tokenizer, arch, None)


def held(model, tokenizer, fingerprint: bool = False) -> LoadedModel:
    """``model`` and ``tokenizer`` as the core's ``LoadedModel`` for reading (scoring, evaluating, searching); a
    PeftModel as a merged copy (what the command line's ``adapter`` verifies). ``fingerprint``: key the cache by a
    digest of the weights (for ``out``; seconds per GB)."""
    lm = in_place(model, tokenizer)
    if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
        raise UserError("the tokenizer is missing or is not a transformers tokenizer; pass "
                        "AutoTokenizer.from_pretrained(...) of the same checkpoint")
    base = copy.deepcopy(model).merge_and_unload() if is_peft(model) else lm.model
    return _loaded(base.eval(), tokenizer, lm.arch, weights_digest(base) if fingerprint else None)


def _loaded(base: torch.nn.Module, tokenizer, arch, digest: str | None) -> LoadedModel:
    name = getattr(base.config, "_name_or_path", "") or type(base).__name__
    source = ModelSource(spec=name, kind="memory", path=name, fingerprint=digest)
    return LoadedModel(base, tokenizer, arch, source, next(base.parameters()).dtype, input_device(base),
                       {"held": True})


def check_unpruned(model: torch.nn.Module, arch) -> None:
    """Weights that agree with their config: a model pruned by another tool (its config left as it was, or
    transformers' own ``pruned_heads`` record) would make every head index wrong."""
    config = model.config.get_text_config()
    if getattr(config, "pruned_heads", None):
        raise AlreadyPruned(f"the config records heads pruned by another tool ({config.pruned_heads}); pass the "
                            "unpruned checkpoint")
    if not arch.is_stock(model):
        return  # a per-layer export of ours: its config holds each layer's counts
    geo = arch.geometry(model, 0)
    expected = getattr(config, "num_attention_heads", geo.num_heads)
    expected_kv = getattr(config, "num_key_value_heads", None) or expected
    if (geo.num_heads, geo.num_kv_heads) != (expected, expected_kv):
        raise AlreadyPruned(f"the attention weights hold {geo.num_heads} query and {geo.num_kv_heads} KV heads but "
                            f"the config says {expected} and {expected_kv}: the model was pruned by another tool that "
                            "left the config as it was; pass the unpruned checkpoint, or fix its config")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter and buffer (name, dtype, shape, bytes): what keys a cached result to these weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "memory:" + h.hexdigest()


def heads_of(heads, lm: LoadedModel) -> HeadSet:
    """Heads as ``{layer: [head, ...]}``, a HeadSet or a ``HeadSelection`` (its ``heads``), checked against the
    model."""
    heads = getattr(heads, "heads", heads)
    if isinstance(heads, HeadSet):
        found = heads
    elif isinstance(heads, dict):
        try:
            found = HeadSet.of({int(k): [int(h) for h in v] for k, v in heads.items()})
        except (TypeError, ValueError):
            raise UserError("heads must map a layer to a list of head indices, e.g. {3: [0, 5], 7: [2]}") from None
    else:
        raise UserError(f"heads must be {{layer: [head, ...]}} or a HeadSelection, not {type(heads).__name__}")
    geometries = lm.arch.geometries(lm.model)
    return found.validate(len(geometries), [g.num_heads for g in geometries])


def settings_of(lm: LoadedModel, budget=None, progress: bool = True, **kwargs) -> tuple[Settings, Inputs]:
    """The run's settings from keyword arguments over the model's recipe, and every input they name, loaded."""
    known = {f.name for f in fields(Settings)} | set(EXTRA_SETTINGS)
    for key in kwargs:
        if key not in known or key in LOADING_SETTINGS:
            close = difflib.get_close_matches(key, sorted(known - set(LOADING_SETTINGS)), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"unknown setting {key!r}{hint} (the settings are Settings' fields: "
                            "prune_heads.pipeline.settings)")
    recipe = kwargs.pop("recipe", None)
    overrides = {}
    per_subject = kwargs.pop("mmlu_per_subject", None)
    if per_subject == "auto":
        kwargs["size_questions"] = True
    elif per_subject is not None:
        overrides["mmlu_per_subject"] = None if per_subject == "all" else int(per_subject)
    if kwargs.get("task_limit") == "all":
        kwargs.pop("task_limit")
        overrides["task_limit"] = None
    flags = {**kwargs, "budget": budget, "progress": progress,
             "device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch.")}
    settings = resolve_settings(lm.source.spec, recipe, overrides, source=lm.source, config=lm.config, **flags)
    return settings, load_inputs(settings, lm.source, lm.config)
