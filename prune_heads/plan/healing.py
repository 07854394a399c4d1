"""LoRA healing of a pruned model (peft), as LLM-Pruner does after structural pruning: a short causal-LM finetune of
low-rank adapters on text that no verification question has seen, merged back into the weights.

Deterministic for a given seed: the adapter initialisation and the order of the training texts are drawn from it,
and there is no dropout.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from prune_heads.console import say
from prune_heads.errors import UserError
from prune_heads.models.adapters import ArchAdapter


@dataclass(frozen=True)
class HealConfig:
    steps: int
    seed: int = 0
    rank: int = 8
    alpha: int = 16
    learning_rate: float = 2e-4
    batch_size: int = 4
    max_length: int = 256

    def to_json(self) -> dict:
        return asdict(self)


def dead_head_slots(model: torch.nn.Module, arch, plan) -> dict[str, tuple[int, list[int]]]:
    """``{o_proj module name: (head_dim, slots)}`` of the head slots of a pruned model that must stay silent: zero
    dummy heads that pad a layer to a shape, and the removed heads of a masked layout."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for i, lp in enumerate(plan.layers):
        if lp.silent_slots:
            o_proj = arch.output_projection(arch.attention(model, i))
            out[names[id(o_proj)]] = (lp.geometry.head_dim, lp.silent_slots)
    return out


def _silence(module: torch.nn.Module, head_dim: int, slots: list[int]):
    """Zero the listed heads' outputs on their way into o_proj (the LoRA path included)."""
    def pre_hook(mod, args):
        x = args[0].clone()
        for j in slots:
            x[..., j * head_dim:(j + 1) * head_dim] = 0
        return (x, *args[1:])

    return module.register_forward_pre_hook(pre_hook)


def _batches(sequences: list[list[int]], config: HealConfig):
    """``config.steps`` padded batches (ids, attention mask, labels), in an order drawn from ``config.seed``."""
    order = torch.Generator().manual_seed(config.seed)
    queue: list[int] = []
    for _ in range(config.steps):
        if len(queue) < config.batch_size:
            queue += torch.randperm(len(sequences), generator=order).tolist()
        batch = [sequences[i] for i in queue[: config.batch_size]]
        del queue[: config.batch_size]
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        yield ids, mask, ids.masked_fill(mask == 0, -100)


def _with_lora(model: torch.nn.Module, targets: list[str], config: HealConfig):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(config.seed)
    with warnings.catch_warnings():  # peft asks the model about gradient checkpointing with a deprecated name
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0,
                                                target_modules=targets, bias="none", task_type="CAUSAL_LM"))


def _train(peft_model, sequences: list[list[int]], config: HealConfig, progress: bool) -> tuple[list, list[float]]:
    """AdamW on the LoRA parameters for ``config.steps`` steps; (trained parameters, loss per step)."""
    device = next(peft_model.parameters()).device
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    losses = []
    bar = tqdm(
        _batches(sequences, config), total=config.steps, desc="healing (LoRA)", unit="step", disable=not progress
    )
    for ids, mask, labels in bar:
        loss = peft_model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    return params, losses


@torch.no_grad()
def _merge(
    peft_model, probe: torch.Tensor, trained: torch.Tensor, dead_heads: dict, dtypes: dict
) -> tuple[torch.nn.Module, float]:
    """Merge the adapters, silence the dead heads' o_proj columns again, restore each tensor's dtype; the merged
    model and its max |logit diff| on ``probe`` against ``trained``, the unmerged model's logits."""
    merged = peft_model.merge_and_unload()
    for name, (d, slots) in dead_heads.items():
        weight = merged.get_submodule(name).weight
        for j in slots:
            weight[:, j * d : (j + 1) * d] = 0
    merge_diff = float((merged(input_ids=probe).logits.float() - trained).abs().max())
    for name, t in [*merged.named_parameters(), *merged.named_buffers()]:
        if name in dtypes and t.dtype != dtypes[name]:
            t.data = t.data.to(dtypes[name])
    merged.eval()
    merged.requires_grad_(False)
    return merged, merge_diff


def heal(
    model: torch.nn.Module,
    sequences: list[list[int]],
    config: HealConfig,
    progress: bool = True,
    dead_heads: dict[str, tuple[int, list[int]]] | None = None,
    lora_targets: tuple[str, ...] | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Train LoRA adapters on ``model`` (modified in place) for ``config.steps`` steps on ``sequences`` (token ids),
    merge them, and return the merged model (in its original dtype) with the training record. ``lora_targets``:
    the family's linear layers LoRA trains (the architecture adapter's); default every linear layer but lm_head.

    ``dead_heads`` (dead_head_slots) stay silent: their outputs are zeroed while training, and their o_proj columns,
    which the merged o_proj update would otherwise bring back to life, are zeroed after merging, so the merged model
    computes exactly what was trained and the removed heads stay removed."""
    if config.steps <= 0:
        raise UserError("`heal_steps` must be a positive number of training steps")
    sequences = [s[: config.max_length] for s in sequences if len(s) >= 2]
    if not sequences:
        raise UserError("the healing text has no input of at least 2 tokens; pass `heal_data` FILE")
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = sorted(names & set(lora_targets) if lora_targets is not None else names - {"lm_head"})
    # Low-precision training on CPU loses small updates: train in float32, then give every parameter and buffer its
    # own dtype back (not one dtype for all: RoPE's inv_freq stays float32 in a bfloat16 model).
    dtypes = {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}
    model.float().train()
    model.requires_grad_(False)
    peft_model = _with_lora(model, targets, config)
    dead_heads = dead_heads or {}
    hooks = [
        _silence(peft_model.base_model.model.get_submodule(name), d, slots) for name, (d, slots) in dead_heads.items()
    ]
    params, losses = _train(peft_model, sequences, config, progress)
    # What was trained (adapters unmerged, dead heads silenced), to check the merged weights against.
    probe = torch.tensor([sequences[0][:64]], device=next(peft_model.parameters()).device)
    peft_model.eval()
    with torch.no_grad():
        trained = peft_model(input_ids=probe).logits.float()
    for h in hooks:
        h.remove()
    merged, merge_diff = _merge(peft_model, probe, trained, dead_heads, dtypes)
    k = max(1, len(losses) // 10)
    record = {
        **config.to_json(),
        "targets": targets,
        "texts": len(sequences),
        "trainable_parameters": sum(p.numel() for p in params),
        "losses": [round(x, 6) for x in losses],
        "loss_first": round(sum(losses[:k]) / k, 6),
        "loss_last": round(sum(losses[-k:]) / k, 6),
        "merge_max_abs_logit_diff": merge_diff,
    }
    say(
        f"healed with LoRA (rank {config.rank}, {len(targets)} module types) for {config.steps} steps: loss "
        f"{record['loss_first']:.4f} -> {record['loss_last']:.4f} (mean of first and last {k} steps)"
    )
    return merged, record


@dataclass(frozen=True)
class Healer:
    """Healing as a run sets it up: the config, the token ids it trains on (and where they came from), the family's
    LoRA targets. ``heal(pruned, plan)`` heals a physically pruned model, keeping the plan's silent slots silent."""

    config: HealConfig
    sequences: list[list[int]] = field(repr=False)
    source: str
    arch: ArchAdapter  # the family: which linear layers LoRA trains, where the silent slots' o_proj is
    digest: str  # of the token ids: with the config and the source, it keys cached healed evaluations
    progress: bool = True

    @property
    def key(self) -> dict:
        return {"config": self.config.to_json(), "data": self.source, "digest": self.digest}

    def heal(self, model: torch.nn.Module, plan) -> tuple[torch.nn.Module, dict]:
        healed, record = heal(model, self.sequences, self.config, self.progress,
                              dead_heads=dead_head_slots(model, self.arch, plan), lora_targets=self.arch.lora_targets)
        record["data"] = self.source
        return healed, record
