"""Loading a GGUF: the first load of a file (transformers converts its config, tokenizer and tensor names) against
the next ones (read back from the conversion kept by prune_heads/models/gguf_cache.py), each in a fresh process.

    python benchmarks/bench_gguf_load.py [--model smollm2-135m] [--dtype float32] [--repeats 2]

Per process: the seconds ``load_model`` takes (imports excluded: they are the same either way), with an empty cache
directory first, then ``--repeats`` times with the entry the first one wrote. Also checks that every load gives the
same weights (a digest of the state dict) and the same tokenizer ids on a sample text. Prints the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _common import machine, result

PROBE = """
import hashlib, json, sys, time
import torch
from prune_heads.models.loading import load_model
start = time.perf_counter()
lm = load_model(sys.argv[1], dtype=sys.argv[2], device="cpu")
seconds = time.perf_counter() - start
h = hashlib.sha256()
for name, tensor in sorted(lm.model.state_dict().items()):
    h.update(name.encode()); h.update(tensor.float().numpy().tobytes())
ids = lm.tokenizer("The answer is (B). Ünïcode, digits 12345 and  spaces.").input_ids
print(json.dumps({"seconds": seconds, "weights": h.hexdigest(), "ids": ids}))
"""


def _load(model: str, dtype: str, cache: str) -> dict:
    env = {**os.environ, "PRUNE_HEADS_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, model, dtype], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-gguf-cache-") as cache:
        first = _load(args.model, args.dtype, cache)
        again = [_load(args.model, args.dtype, cache) for _ in range(args.repeats)]
    same = all(r["weights"] == first["weights"] and r["ids"] == first["ids"] for r in again)
    cached = min(r["seconds"] for r in again)
    print(f"load_model({args.model!r}, {args.dtype}): converting {first['seconds']:.1f} s, from the kept conversion "
          f"{cached:.1f} s (fastest of {args.repeats}); same weights and tokenizer ids: {same}")
    result("gguf_load_converting_s", round(first["seconds"], 2))
    result("gguf_load_cached_s", round(cached, 2))
    result("gguf_load_speedup", round(first["seconds"] / cached, 2))
    result("gguf_load_same_model", same)


if __name__ == "__main__":
    main()
