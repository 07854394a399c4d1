"""Benchmark 5: memory above the process's own baseline, as a multiple of the weights' bytes.

    python benchmarks/bench_memory.py [--dtype float32|bfloat16] [--skip-export] [--skip-main] [--skip-embedded]

Each command runs in a fresh process through a small wrapper that records the RSS just before the weights are read
(the loader's ``reading_weights`` event on the ``prune_heads`` logger: imports done, the modelling code and the
tokenizer loaded, data read: the baseline; the RSS at the start, before the command read anything, is printed
beside it) and the peak RSS at exit (``VmHWM``: the high-water mark of the process's own
memory; ``ru_maxrss`` is not used, since Linux carries the parent's over ``fork`` and ``exec``, which is how one earlier
run read 9.29x). Ratio = (peak - baseline) / weights' bytes in the
run's dtype. Measured on:

- a Qwen2-0.5B-shaped model with random weights (494M parameters: hidden 896, 24 layers, 14 heads, 2 KV heads,
  vocabulary 151,936, tied embeddings), written as sharded safetensors (500 MB shards): ``export`` of one KV group per
  layer, and the main command on a handful of questions;
- the embedded SmolLM2-135M (GGUF, dequantised on load): the main command as the README runs it.

Targets (issue 16): main command <= 1.6x, ``export`` from sharded safetensors <= 1.3x plus one shard.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine, result

WRAPPER = r"""
import json, logging, sys

marks = {}

def rss(key="VmRSS:"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

class Marks(logging.Handler):  # the loader's events on the prune_heads logger (prune_heads/models/loading.py)
    def emit(self, record):
        event = getattr(record, "event", None)
        if event == "reading_weights":
            marks.setdefault("baseline", rss())  # tokenizer and modelling code loaded, no weight read yet
        elif event == "weights_loaded":
            marks["weights"] = record.weights_bytes
            marks["after_load"] = rss()

marks["load_called"] = rss()  # imports aside: what the process holds before the command reads anything
logging.getLogger("prune_heads").addHandler(Marks(logging.DEBUG))
from prune_heads_cli.main import main
logging.getLogger("prune_heads").setLevel(logging.DEBUG)
code = 0
try:
    main(sys.argv[2:])
except SystemExit as e:
    code = e.code or 0
marks["peak"] = rss("VmHWM:")  # this process's own high-water mark (ru_maxrss carries the parent's over exec)
marks["code"] = code
with open(sys.argv[1], "w") as f:
    json.dump(marks, f)
"""


def measure(args: list[str], label: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-memory-marks-") as tmp:
        marks_file = Path(tmp) / "marks.json"
        proc = subprocess.run([sys.executable, "-c", WRAPPER, str(marks_file), *args], capture_output=True, text=True)
        if proc.returncode != 0 or not marks_file.is_file():
            print(proc.stderr[-3000:])
            raise SystemExit(f"{label} failed")
        marks = json.loads(marks_file.read_text())
    if marks["code"]:
        print(proc.stderr[-3000:])
        raise SystemExit(f"{label} exited {marks['code']}")
    ratio = (marks["peak"] - marks["baseline"]) / marks["weights"]
    from_call = (marks["peak"] - marks["load_called"]) / marks["weights"]
    print(f"{label}: weights {marks['weights'] / 2**20:,.0f} MiB, baseline RSS {marks['baseline'] / 2**20:,.0f} MiB "
          f"({marks['load_called'] / 2**20:,.0f} at the start), after load {marks['after_load'] / 2**20:,.0f} "
          f"MiB, peak {marks['peak'] / 2**20:,.0f} MiB: {ratio:.2f}x the weights above the baseline ({from_call:.2f}x "
          "above the RSS at the start)")
    return {**marks, "ratio": ratio}


def qwen2_half_billion(directory: Path, dtype: str) -> Path:
    import torch
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny import tokenizer

    config = tf.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory, max_shard_size="500MB")
    tokenizer().save_pretrained(directory)
    del model
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--skip-export", action="store_true")
    parser.add_argument("--skip-main", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    a = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:  # the 0.5B model and its exports: GBs
        work = Path(tmp)
        if not (a.skip_export and a.skip_main):
            qwen2_runs(work, a)
        if not a.skip_embedded:
            embedded = measure(["--model", "smollm2-135m", "--out", str(work / "embedded"), "--no-progress"],
                               "main command, embedded SmolLM2-135M (README)")
            result("embedded_main_memory_ratio", round(embedded["ratio"], 3))


def qwen2_runs(work: Path, a) -> None:
    model = qwen2_half_billion(work / "qwen2-0.5b", a.dtype)
    shard = max(p.stat().st_size for p in model.glob("*.safetensors"))
    heads = work / "heads.json"
    heads.write_text(json.dumps({str(i): list(range(7)) for i in range(24)}))  # KV group 0 of every layer
    common = ["--dtype", a.dtype, "--no-progress", "--max-shard-size", "500MB"]
    if not a.skip_export:
        export = measure(["export", "--model", str(model), "--heads", str(heads), "--out", str(work / "export"),
                          "--no-task-eval", *common], f"export, Qwen2-0.5B-shaped, {a.dtype}")
        result("export_memory_ratio", round(export["ratio"], 3))
        result("export_memory_ratio_target", round(1.3 + shard / export["weights"], 3))
    if not a.skip_main:
        main_run = measure(["--model", str(model), "--out", str(work / "main"), "--budget", "100%",
                            "--mmlu-per-subject", "1", "--mmlu-subjects", "2", "--calibration-size", "2",
                            "--max-length", "256", *common], f"main command, Qwen2-0.5B-shaped, {a.dtype}")
        result("main_memory_ratio", round(main_run["ratio"], 3))


if __name__ == "__main__":
    main()
