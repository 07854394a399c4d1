"""Hostile and careless inputs: each is answered with one ``error:`` line naming the problem (exit 2), no traceback,
and every file that existed before is byte-identical afterwards. Property tests throw arbitrary strings and JSON/YAML
values at the budget parser, the heads-file reader and the recipe reader."""
from __future__ import annotations

import json
import struct

import pytest
import yaml
from helpers import cais_file, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import run_cli, save_tiny

from prune_heads.errors import UserError
from prune_heads.io.readers import read_heads
from prune_heads.pipeline.recipes import read_recipe
from prune_heads.search.budget import Budget


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("hostile") / "model", "llama")


@pytest.fixture
def case(tmp_path, capsys, model_dir):
    """Run the CLI in ``tmp_path`` and check the answer: exit 2, one error line mentioning ``expect``, nothing that
    existed before changed (the shared model directory included)."""
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=8)

    def run(args, expect, code=2):
        before, model_before = snapshot(tmp_path), snapshot(model_dir)
        got, _, err = run_cli([str(a).replace("MODEL", str(model_dir)).replace("MMLU", str(mmlu)) for a in args],
                              capsys)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert got == code, err
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
        assert expect in lines[0], lines[0]
        after = snapshot(tmp_path)
        assert {k: v for k, v in after.items() if k in before} == before and snapshot(model_dir) == model_before
        return lines[0]

    return run


def _model_copy(tmp_path, model_dir, name="m"):
    import shutil

    target = tmp_path / name
    shutil.copytree(model_dir, target)
    return target


# -- corrupt weights and configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage-header", "huge-header-length", "empty"])
def test_corrupt_safetensors(tmp_path, model_dir, case, damage):
    m = _model_copy(tmp_path, model_dir)
    weights = m / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "garbage-header": struct.pack("<Q", 40) + b"{" * 40,
                         "huge-header-length": struct.pack("<Q", 1 << 60) + data[8:], "empty": b""}[damage])
    case(["eval", "--model", m, "--mmlu", "MMLU", "--out", tmp_path / "o", "--no-progress"], "could not load model")


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, b"not a gguf at all"])
def test_corrupt_gguf(tmp_path, case, content):
    f = tmp_path / "model.gguf"
    f.write_bytes(content)
    case(["eval", "--model", f, "--mmlu", "MMLU", "--out", tmp_path / "o"], "model.gguf")


@pytest.mark.parametrize("change,expect", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": -4}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_key_value_heads": 4}, "does not divide"),
    ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers"),
    ({"num_hidden_layers": 2}, "num_hidden_layers"),
    ({"head_dim": 7}, "head_dim"),
    ({"hidden_size": "big"}, "config"),
])
def test_impossible_configs_are_refused_before_any_allocation(tmp_path, model_dir, case, change, expect):
    m = _model_copy(tmp_path, model_dir)
    config = json.loads((m / "config.json").read_text())
    config.update(change)
    (m / "config.json").write_text(json.dumps(config))
    case(["eval", "--model", m, "--mmlu", "MMLU", "--out", tmp_path / "o"], expect)


def test_a_corrupt_pickle_with_allow_pickle(tmp_path, model_dir, case):
    m = _model_copy(tmp_path, model_dir)
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    case(["eval", "--model", m, "--mmlu", "MMLU", "--out", tmp_path / "o", "--allow-pickle"], "could not load model")


# -- text files ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--calibration", "--mmlu", "--kl-text"])
def test_non_utf8_text_files_name_the_line(tmp_path, case, flag):
    f = tmp_path / ("bad.jsonl" if flag == "--mmlu" else "bad.txt")
    f.write_bytes(b"first line is fine\nsecond \xc3\x28 is not\n")
    args = ["score" if flag == "--calibration" else "eval", "--model", "MODEL", flag, f, "--out", tmp_path / "o"]
    if flag != "--mmlu":
        args += ["--mmlu", "MMLU"]
    case(args, "line 2, column 8, is not UTF-8")


@pytest.mark.parametrize("content,expect", [
    (b"{\"0\": [1, 2]", "is not valid JSON"),
    (b"[1, 2]", "is a JSON list"),
    (b"{\"0\": [\"1\"]}", "0.0 = '1'"),
    (b"{\"0\": [1.0]}", "0.0 = 1.0"),
    (b"{\"0\": [true]}", "0.0 = True"),
    (b"{\"zero\": [1]}", "'zero'"),
    (b"{\"0\": [-1]}", "0.0 = -1"),
    (b"{\"0\": [NaN]}", "is not valid JSON"),
    (b"{\"0\": [1]}\xff", "is not UTF-8"),
])
def test_malformed_heads_files(tmp_path, case, content, expect):
    f = tmp_path / "heads.json"
    f.write_bytes(content)
    case(["export", "--model", "MODEL", "--heads", f, "--out", tmp_path / "o", "--no-task-eval"], expect)


def test_head_indices_beyond_the_model_are_refused_before_it_loads(tmp_path, case):
    f = tmp_path / "heads.json"
    f.write_text(json.dumps({"0": [99]}))
    case(["eval", "--model", "MODEL", "--mmlu", "MMLU", "--ablate", f, "--out", tmp_path / "o"], "head 99 of layer 0")
    f.write_text(json.dumps({"40": [0]}))
    case(["export", "--model", "MODEL", "--heads", f, "--out", tmp_path / "o"], "layer 40")


@pytest.mark.parametrize("content,expect", [
    ("batch_size: '4'\n", "batch_size"),
    ("calibration_size: 2.5\n", "calibration_size"),
    ("search: {grid: [0.1, 7]}\n", "search.grid.1"),
    ("heal: {rank: true}\n", "heal.rank"),
    ("nonsense_key: 1\n", "nonsense_key"),
    ("a: &x [1, 2]\nb: *x\n", "aliases"),
    ("lol: &a [x, x]\nlol2: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nlol3: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n",
     "aliases"),
    ("x: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    ("- just\n- a list\n", "mapping"),
])
def test_malformed_recipes(tmp_path, case, content, expect):
    f = tmp_path / "r.yaml"
    f.write_text(content)
    case(["eval", "--model", "MODEL", "--mmlu", "MMLU", "--recipe", f, "--out", tmp_path / "o"], expect)


# -- values that used to be accepted, or refused too late -----------------------------------------------------------------


@pytest.mark.parametrize("args,expect", [
    (["--budget", "1e999nat"], "--budget"),
    (["--budget", "5000nat"], "--budget"),
    (["--budget", "nan"], "--budget"),
    (["--budget", "inf%"], "--budget"),
    (["--max-shard-size", "lots"], "--max-shard-size"),
    (["--max-shard-size", "0MB"], "--max-shard-size"),
    (["--push-to", "user/x", "--no-export"], "--push-to"),
    (["--private"], "--private"),
    (["--mmlu-subjects", "nonexistent subject"], "unknown MMLU subject"),
])
def test_bad_values_are_refused_before_the_model_loads(tmp_path, case, args, expect):
    case(["--model", "MODEL", "--mmlu", "MMLU", "--out", tmp_path / "o", *args], expect)


@pytest.mark.parametrize("args,expect", [
    (["--percents", "nan"], "--percents"),
    (["--percents", "0,500"], "--percents"),
    (["--modes", "dynamic,sideways"], "sideways"),
    (["--functions", "ahon,nope"], "nope"),
])
def test_bad_study_values(tmp_path, case, args, expect):
    case(["study", "--model", "MODEL", "--mmlu", "MMLU", "--out", tmp_path / "o", *args], expect)


def test_a_selection_that_leaves_no_questions_is_an_error_not_nan(tmp_path, case):
    rows = [{"question": "q", "subject": "s", "choices": ["a", "b", "c", "d"], "answer": 0}] * 5  # all exemplars
    f = tmp_path / "mmlu.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    case(["eval", "--model", "MODEL", "--mmlu", f, "--out", tmp_path / "o"], "no questions")


@pytest.mark.parametrize("out", ["/proc/prune-heads-out", "/dev/null", "/proc/self/status/x"])
def test_unwritable_or_special_out(tmp_path, case, out):
    case(["eval", "--model", "MODEL", "--mmlu", "MMLU", "--out", out], "--out")


@pytest.mark.parametrize("content,expect", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "holds a list, not a mapping"),
    ('{"peft_type": 7}', "peft_type"),
    ('{"peft_type": "PREFIX_TUNING"}', "only LoRA"),
])
def test_malformed_adapter_configs(tmp_path, model_dir, case, content, expect):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(content)
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    case(["adapt", adapter, "--pruned", tmp_path, "--out", tmp_path / "o"], expect)


def test_push_without_a_network_is_one_line(tmp_path, model_dir, capsys, monkeypatch):
    from tiny import tiny_model

    from exporters.export import ExportOptions, export_pruned
    from prune_heads.heads import HeadSet

    d = tmp_path / "export"
    d.mkdir()
    export_pruned(tiny_model("llama"), HeadSet.of({0: [0]}), d, ExportOptions(progress=False))
    capsys.readouterr()  # the export's own lines (shown once a command installed the CLI's handler)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    code, _, err = run_cli(["push", d, "--push-to", "user/x"], capsys)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err and "hf_not_a_real_token" not in err


# -- property tests ---------------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.sampled_from([None, "accuracy", "kl", "kl-text", "mmlu", "mmlu-cloze"]))
def test_budget_parser_returns_a_finite_budget_or_one_line(text, metric):
    try:
        b = Budget.parse(text, metric)
    except UserError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert b.metric in ("accuracy", "kl", "kl-text") and 0 <= b.limit <= 100


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                    max_leaves=12)


def _value_or_one_line(read, path):
    """``read(path)``, or None when it refused with a one-line UserError (anything else fails the test)."""
    try:
        return read(path)
    except UserError as e:
        assert "\n" not in str(e) and str(e)
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(JSON)
def test_heads_reader_returns_integer_heads_or_one_line(tmp_path, value):
    f = tmp_path / "heads.json"
    f.write_text(json.dumps(value))
    heads = _value_or_one_line(read_heads, f)
    assert heads is None or all(type(k) is int and k >= 0 and all(type(h) is int and h >= 0 for h in v) for k, v in heads.items())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["batch_size", "budget", "scorer", "search", "heal", "dtype", "x", "name",
                                        "mmlu_subjects", "calibration_size"]), JSON, max_size=4) | JSON)
def test_recipe_reader_returns_a_checked_mapping_or_one_line(tmp_path, value):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(value))
    data = _value_or_one_line(read_recipe, f)
    if data is None:
        return
    assert isinstance(data, dict)
    if "batch_size" in data and not isinstance(data["batch_size"], dict) and data["batch_size"] is not None:
        assert type(data["batch_size"]) is int and data["batch_size"] > 0


@pytest.mark.slow
def test_no_progress_silences_every_bar_the_libraries_included(tmp_path, model_dir):
    import subprocess
    import sys

    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=8)

    def export(out, *extra):
        return subprocess.run([sys.executable, "-m", "prune_heads_cli", "export", "--model", str(model_dir), "--heads",
                               str(_heads(tmp_path)), "--mmlu", str(mmlu), "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=600)

    quiet = export(tmp_path / "o", "--no-progress")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "it/s" not in quiet.stderr and "%|" not in quiet.stderr, quiet.stderr[-2000:]
    loud = export(tmp_path / "loud")
    assert loud.returncode == 0 and "%|" in loud.stderr  # the bars exist, and --no-progress is what removed them


def _heads(tmp_path):
    f = tmp_path / "heads.json"
    f.write_text(json.dumps({"0": [0, 1]}))
    return f
