"""Runs models in vLLM, one after the other, and writes what each computed: the script prune-heads starts with a
Python that has vLLM (vLLM pins its own transformers, so it often lives in an environment of its own). Imports vLLM
and the standard library only.

    python vllm_worker.py REQUEST.json RESULT.json

REQUEST: ``models`` (directories, run in this order in the same process: vLLM is imported once, ~15 s on 2 cores,
and each engine is released before the next starts), ``prompts`` (token id lists), ``greedy_tokens``, ``dtype``,
``max_model_len``, ``kv_cache_bytes`` and, optionally, ``throughput`` (``batch``, ``prompt_tokens``,
``decode_tokens``). RESULT: a list with, per model, the log-probability of every prompt token after the first
(``prompt_logprobs``), the greedy continuation of every prompt (``greedy``), the vLLM version, the class vLLM built,
its device and dtype, the engine start time and, if asked, prefill and decode tokens per second for a batch of prompts.
"""
from __future__ import annotations

import gc
import json
import sys
import time


def _prompt_logprobs(llm, prompts: list[list[int]], greedy_tokens: int):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=greedy_tokens, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    logprobs, greedy = [], []
    for prompt, out in zip(prompts, outputs):
        # prompt_logprobs[0] is None (the first token has no context); entry i maps token id -> Logprob.
        logprobs.append([float(out.prompt_logprobs[i][tok].logprob) for i, tok in enumerate(prompt) if i > 0])
        greedy.append(list(out.outputs[0].token_ids))
    return logprobs, greedy


def _throughput(llm, prompts: list[list[int]], spec: dict) -> dict:
    """Prefill: a batch of prompts, one new token each; decode: the same batch generating ``decode_tokens`` more,
    less the prefill time. Each the fastest of ``rounds`` (default 3) after one warm-up: a 2-core machine's
    other work only ever slows a round down."""
    from vllm import SamplingParams, TokensPrompt

    length, batch, new = spec["prompt_tokens"], spec["batch"], spec["decode_tokens"]
    base = [t for p in prompts for t in p]
    batch_prompts = [TokensPrompt(prompt_token_ids=[base[(i * 7 + j) % len(base)] for j in range(length)])
                     for i in range(batch)]

    def timed(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(batch_prompts, params, use_tqdm=False)  # warm-up
        times = []
        for _ in range(spec.get("rounds", 3)):
            start = time.perf_counter()
            llm.generate(batch_prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return min(times)

    prefill = timed(1)
    decode = max(timed(1 + new) - prefill, 1e-9)
    return {"batch": batch, "prompt_tokens": length, "decode_tokens": new, "rounds": spec.get("rounds", 3),
            "prefill_tokens_per_s": batch * length / prefill, "decode_tokens_per_s": batch * new / decode}


def _run_one(model: str, request: dict) -> dict:
    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    start = time.perf_counter()
    llm = LLM(model=model, dtype=request.get("dtype", "float32"), enforce_eager=True, seed=0,
              max_model_len=request.get("max_model_len", 512), enable_prefix_caching=False,
              kv_cache_memory_bytes=request.get("kv_cache_bytes", 1 << 29))  # not vLLM's 90% of the machine
    started = time.perf_counter() - start
    logprobs, greedy = _prompt_logprobs(llm, request["prompts"], request.get("greedy_tokens", 8))
    result = {"vllm": vllm.__version__, "engine_start_s": round(started, 1), "prompt_logprobs": logprobs,
              "greedy": greedy, "architecture": llm.llm_engine.model_config.architecture,
              "device": str(current_platform.device_type), "dtype": str(llm.llm_engine.model_config.dtype)}
    if request.get("throughput"):
        result["throughput"] = _throughput(llm, request["prompts"], request["throughput"])
    return result


def main(request_path: str, result_path: str) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    request = json.loads(open(request_path).read())
    results = []
    for model in request["models"]:  # one engine at a time, each released before the next starts
        results.append(_run_one(model, request))
        gc.collect()
        cleanup_dist_env_and_memory()  # vLLM's own teardown between engines: its process groups, the GPU's memory
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from rerunning this
    main(*sys.argv[1:3])
