"""Is the model that ships the model that was verified? Logits of two models on the same prompts, compared in
float32 module by module (both ways exact for bf16/fp16 weights, one module's float32 copy at a time), with a
tolerance set by precision."""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterable, Iterator

import torch

from prune_heads.errors import UserError
from prune_heads.eval.encoding import EncodedTask
from prune_heads.models.dtypes import available_bytes
from prune_heads.models.loading import LoadedModel

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


LOW_PRECISION = (torch.bfloat16, torch.float16)


@contextmanager
def float32_parameters(model: torch.nn.Module, enabled: bool = True):
    """The model computing in float32 for the duration, one module at a time: each module's bf16/fp16 parameters
    become float32 just before its forward and get their own storage back just after, so at most one module's
    float32 copy exists (a layer, or the embedding) rather than a float32 copy of the whole model. Exact both ways:
    every bf16 or fp16 value is a float32 value. Buffers keep their dtype (RoPE's inv_freq is float32 already).

    The vocabulary matrices, often the largest tensors of a small model (SmolLM2-135M: 113 MB in float32, more than
    any layer), are never upcast whole: the input embedding upcasts only the rows the prompt looks up, and the output
    projection multiplies a block of vocabulary rows at a time, each block no larger than the largest layer module."""
    if not enabled:
        yield model
        return
    saved: dict[int, dict[str, torch.Tensor]] = {}
    vocab_in, vocab_out = _vocabulary_modules(model)
    padding_idx = getattr(vocab_in, "padding_idx", None)

    def upcast(module, args):
        own = {n: p for n, p in module.named_parameters(recurse=False) if p.dtype in LOW_PRECISION}
        saved[id(module)] = {n: p.data for n, p in own.items()}
        if module is vocab_in and args and torch.is_tensor(args[0]):  # only the rows looked up
            rows, ids = args[0].unique(return_inverse=True)
            module.weight.data = module.weight.data[rows].float()
            module.padding_idx = None  # an index of the full table (it only stops gradients): not one of these rows
            return (ids, *args[1:])
        for p in own.values():
            p.data = p.data.float()

    def restore(module, *_):
        for name, data in saved.pop(id(module), {}).items():
            getattr(module, name).data = data
        if module is vocab_in:
            module.padding_idx = padding_idx

    modules = [m for m in model.modules() if m is not vocab_out and _low_precision(m)]
    handles = [h for m in modules for h in (m.register_forward_pre_hook(upcast), m.register_forward_hook(restore))]
    if vocab_out is not None:
        vocab_out.forward = _blockwise_float32_linear(vocab_out, _largest_upcast(model))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in modules:  # a forward that raised leaves its module upcast
            restore(m)
        if vocab_out is not None:
            del vocab_out.forward  # the class's own forward again


def _low_precision(module: torch.nn.Module) -> bool:
    return any(p.dtype in LOW_PRECISION for p in module.parameters(recurse=False))


def _vocabulary_modules(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The input embedding (an ``nn.Embedding``) and the output projection (an ``nn.Linear``) where the model has
    them in low precision; None where it has not, or where accelerate's hooks place them (--device-map): those are
    upcast like any module."""
    def own(getter, kind):
        module = getattr(model, getter, lambda: None)()
        plain = isinstance(module, kind) and not hasattr(module, "_hf_hook")
        return module if plain and _low_precision(module) else None

    return own("get_input_embeddings", torch.nn.Embedding), own("get_output_embeddings", torch.nn.Linear)


def _largest_upcast(model: torch.nn.Module) -> int:
    """Parameters of the largest module :func:`float32_parameters` upcasts whole (the vocabulary matrices excluded)."""
    skip = [m for m in _vocabulary_modules(model) if m is not None]
    sizes = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules() if m not in skip]
    return max([s for s in sizes if s] or [1])


def _blockwise_float32_linear(linear: torch.nn.Linear, block_params: int):
    """``linear``'s forward in float32, upcasting ``block_params`` worth of output rows at a time."""
    weight, bias = linear.weight, linear.bias
    rows = max(1, block_params // weight.shape[1])

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for lo in range(0, weight.shape[0], rows):
            hi = min(lo + rows, weight.shape[0])
            out[..., lo:hi] = torch.nn.functional.linear(
                x, weight[lo:hi].float(), None if bias is None else bias[lo:hi].float())
        return out

    return forward


def comparison_dtype(models: list[torch.nn.Module], dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 if the largest module's float32 upcast fits in free memory (with room to spare), else ``dtype``."""
    if dtype == torch.float32:
        return dtype
    largest = max(_largest_upcast(model) for model in models)
    free = available_bytes(device)
    return torch.float32 if free is not None and largest * (4 - bytes_per_value(dtype)) * 1.5 < free else dtype


class SpilledLogits:
    """Reference logits kept on disk, one file per prompt, read back one at a time: on a small model with a large
    vocabulary they are a sizeable share of its weights (SmolLM2-135M: 4 prompts x 96 tokens x 49,152 float32 logits
    = 72 MiB, 0.28x of its bf16 weights) and an export holds them from before its files are written until the
    reload is checked."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.paths = directory, []

    def append(self, logits: torch.Tensor) -> None:
        path = self.directory / f"prompt-{len(self.paths)}.pt"
        torch.save(logits, path)
        self.paths.append(path)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.load(path) for path in self.paths)

    def __len__(self) -> int:
        return len(self.paths)


@torch.no_grad()
def reference_logits(reference: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype, reference_context=nullcontext,
                     precision: torch.dtype | None = None, into: list | SpilledLogits | None = None
                     ) -> tuple[list[torch.Tensor] | SpilledLogits, torch.dtype]:
    """``reference``'s float32 logits on each prompt (inside ``reference_context()``, e.g. an ablation), computed in
    float32 when one module's upcast fits, and the precision used. One prompt at a time: a batch of full-vocabulary
    float32 logits is itself a sizeable share of a small model. ``into``: where each prompt's logits go as they are
    computed (a list by default, or :class:`SpilledLogits`)."""
    precision = precision or comparison_dtype([reference], dtype, ids.device)
    out = [] if into is None else into
    with float32_parameters(reference, precision != dtype), reference_context():
        for row in ids:
            out.append(reference(input_ids=row[None]).logits.float().cpu())
    return out, precision


@torch.no_grad()
def check_logits(candidate: torch.nn.Module, ids: torch.Tensor, expected: Iterable[torch.Tensor], dtype: torch.dtype,
                 precision: torch.dtype, what: str) -> dict:
    """Check ``candidate`` reproduces ``expected`` (``reference_logits``) on ``ids`` within tolerance, else an error."""
    diff, largest, same = 0.0, 0.0, 0
    with float32_parameters(candidate, precision != dtype):
        for row, want in zip(ids, expected):
            got = candidate(input_ids=row[None]).logits.float().cpu()
            same += int((got.argmax(-1) == want.argmax(-1)).sum())
            largest = max(largest, float(want.abs().max().nan_to_num(0.0, 0.0, 0.0)))
            # In place: a prompt's full-vocabulary float32 logits are a sizeable block (Qwen2-0.5B: 96 tokens x
            # 151,936 = 56 MiB), and neither the difference nor its magnitude needs one of its own.
            diff = max(diff, worst_difference(got.sub_(want).abs_()))
            del got, want  # not alive through the next prompt's forward
    tol = check_difference(diff, largest, precision, what)
    return {"max_abs_logit_diff": diff, "tolerance": round(tol, 6), "compared_in": str(precision).replace("torch.", ""),
            "argmax_agreement": same / ids.numel()}


def compare_models(reference: torch.nn.Module, candidate: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype,
                   what: str, reference_context=nullcontext) -> dict:
    """Check ``candidate`` computes what ``reference`` (inside ``reference_context()``, e.g. an ablation) computes on
    ``ids``: logits within tolerance, else an error. Both run in float32 module by module when that fits, so the
    check is sharp (a wrong slice moves logits by whole units, bf16 rounding alone by ~1% after 30 layers)."""
    precision = comparison_dtype([reference, candidate], dtype, ids.device)
    expected, precision = reference_logits(reference, ids, dtype, reference_context, precision)
    return check_logits(candidate, ids, expected, dtype, precision, what)


def worst_difference(diff) -> float:
    """The largest of ``diff`` (a tensor or array of absolute differences), infinite when any is not a finite number:
    a NaN is no evidence of agreement, and Python's ``max`` and ``>`` would let it pass as none."""
    if (diff.numel() if torch.is_tensor(diff) else diff.size) == 0:
        return 0.0
    worst = float(diff.max())  # both torch's and numpy's max propagate NaN
    return worst if math.isfinite(worst) else math.inf


def check_difference(diff: float, largest: float, dtype: torch.dtype, what: str) -> float:
    """The tolerance for logits whose largest magnitude is ``largest``; beyond it (or not a finite number), an
    error."""
    tol = LOGIT_RTOL.get(dtype, 1e-4) * max(1.0, largest)
    if not math.isfinite(diff):
        raise UserError(f"{what} computes logits that are not finite numbers (NaN or infinity) where the verified "
                        "model's are finite; nothing was published (compute in float32: `dtype` float32)")
    if not diff <= tol:
        raise RuntimeError(f"{what} does not reproduce the verified ablated model: max |logit diff| {diff:.3g} > "
                           f"{tol:g}; nothing was published (please report this as a bug)")
    return tol
