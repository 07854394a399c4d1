"""Is the model that ships the model that was verified? Logits of two models on the same prompts, compared in
float32 whenever memory allows (both ways exact for bf16/fp16 weights), with a tolerance set by precision."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from .evaluation import EncodedTask
from .models.dtypes import available_bytes
from .models.loading import LoadedModel

# Relative to the largest |logit|: the pruned model runs the same arithmetic on fewer heads, but kernels pick
# other blockings for other shapes, so float32 differs in the last bits (~1e-5 relative after 30 layers). In bf16 the
# rounding of different shapes alone reaches a few % after 30 layers, which is why comparisons run in float32
# whenever memory allows (see compare_models); the bf16 tolerance is the fallback for models that do not fit.
LOGIT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def bytes_per_value(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def sample_prompts(lm: LoadedModel, enc: EncodedTask | None, n: int = 4, length: int = 96) -> torch.Tensor:
    """A few real prompts (task contexts, truncated) for the logit comparison; random token ids otherwise."""
    if enc is not None and len(enc):
        seqs = [it.context[-length:] for it in enc.items[:n]]
        m = min(len(s) for s in seqs)
        return torch.tensor([s[-m:] for s in seqs])
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, lm.config.vocab_size, (n, length), generator=g)


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


def comparison_dtype(models: list[torch.nn.Module], dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 if the largest model's float32 upcast fits in free memory (with room to spare), else ``dtype``."""
    if dtype == torch.float32:
        return dtype
    extra = max(sum(p.numel() for p in m.parameters()) for m in models) * (4 - bytes_per_value(dtype))
    free = available_bytes(device)
    return torch.float32 if free is not None and extra * 1.5 < free else dtype


@torch.no_grad()
def compare_models(reference: torch.nn.Module, candidate: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype,
                   what: str, reference_context=nullcontext) -> dict:
    """Check ``candidate`` computes what ``reference`` (inside ``reference_context()``, e.g. an ablation) computes on
    ``ids``: logits within tolerance, else an error. Both run in float32 when that fits in memory, so the check is
    sharp (a wrong slice moves logits by whole units, bf16 rounding alone by ~1% after 30 layers)."""
    precision = comparison_dtype([reference, candidate], dtype, ids.device)
    upcast = precision != dtype
    # One prompt at a time: a batch of full-vocabulary float32 logits is itself a sizeable share of a small model.
    with float32_parameters(reference, upcast), reference_context():
        expected = [reference(input_ids=row[None]).logits.float() for row in ids]
    diff, largest, same = 0.0, 0.0, 0
    with float32_parameters(candidate, upcast):
        for row, want in zip(ids, expected):
            got = candidate(input_ids=row[None]).logits.float()
            diff = max(diff, float((got - want).abs().max()))
            largest = max(largest, float(want.abs().max()))
            same += int((got.argmax(-1) == want.argmax(-1)).sum())
    tol = check_difference(diff, largest, precision, what)
    return {"max_abs_logit_diff": diff, "tolerance": round(tol, 6), "compared_in": str(precision).replace("torch.", ""),
            "argmax_agreement": same / ids.numel()}


def check_difference(diff: float, largest: float, dtype: torch.dtype, what: str) -> float:
    """The tolerance for logits whose largest magnitude is ``largest``; beyond it, an error."""
    tol = LOGIT_RTOL.get(dtype, 1e-4) * max(1.0, largest)
    if not diff <= tol:
        raise RuntimeError(f"{what} does not reproduce the verified ablated model: max |logit diff| {diff:.3g} > "
                           f"{tol:g}; nothing was published (please report this as a bug)")
    return tol
