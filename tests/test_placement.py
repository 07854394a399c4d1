"""--device-map (accelerate's big-model inference): part of a tiny model offloaded to disk gives the same scores,
predictions and log-likelihoods as the model in memory, through the commands; a disk-offloaded model exports by
streaming its safetensors files (the same files as from memory); bad placements are refused."""
from __future__ import annotations

import json

import pytest
from helpers import cais_file
from tiny import run_cli, save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("placement"), "llama")


def _device_map(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                                "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk",
                                "model.norm": "cpu", "lm_head": "cpu"}))
    return path


def _main(model_dir, tmp_path, capsys, name, *extra, code=0):
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=12)
    got, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", tmp_path / name, "--calibration-size", "4",
                           "--dtype", "float32", "--no-progress", "--budget", "100%", "--mmlu-per-subject", "3",
                           *extra], capsys)
    assert got == code, err
    return (json.loads((tmp_path / name / "report.json").read_text()) if code == 0 else None), err


@pytest.mark.slow
def test_disk_offload_gives_the_same_search(model_dir, tmp_path, capsys):
    plain, _ = _main(model_dir, tmp_path, capsys, "plain", "--no-export")
    mapped, _ = _main(model_dir, tmp_path, capsys, "mapped", "--no-export", "--device-map", _device_map(tmp_path))
    assert plain["scores"] == mapped["scores"]
    strip = lambda points: [{k: v for k, v in p.items() if k != "shipped"} for p in points]  # noqa: E731
    assert strip(plain["search_points"]) == strip(mapped["search_points"]) and plain["final"] == mapped["final"]
    assert not (tmp_path / "mapped" / ".offload").exists()


def test_disk_offload_eval_log_likelihoods_equal(model_dir, tmp_path, capsys):
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=12)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"1": [0, 2], "3": [5]}))
    rows = {}
    for name, extra in (("plain", []), ("mapped", ["--device-map", str(_device_map(tmp_path))])):
        got, _, err = run_cli(["eval", "--model", model_dir, "--mmlu", mmlu, "--out", tmp_path / name, "--ablate",
                               heads, "--dtype", "float32", "--no-progress", "--mmlu-per-subject", "3", *extra], capsys)
        assert got == 0, err
        rows[name] = [json.loads(line) for line in (tmp_path / name / "mmlu.jsonl").read_text().splitlines()]
    assert rows["plain"] == rows["mapped"] and len(rows["plain"]) == 6


@pytest.mark.slow
def test_an_offloaded_model_is_exported_by_streaming_its_safetensors(model_dir, tmp_path, capsys):
    """Half the layers on disk: the export is written from the source files tensor by tensor (the offloaded weights
    are never in memory together), reloaded with the same device map, and equals the export of the model in memory."""
    from safetensors.torch import load_file

    plain, _ = _main(model_dir, tmp_path, capsys, "plain")
    mapped, err = _main(model_dir, tmp_path, capsys, "mapped", "--device-map", _device_map(tmp_path))
    assert "tensor by tensor" in err
    v = mapped["export"]["verification"]
    assert v["streamed"] and v["max_abs_logit_diff"] <= v["tolerance"] and v["argmax_agreement"] == 1.0
    assert mapped["heads"] == plain["heads"] and mapped["export"]["task_eval"] == plain["export"]["task_eval"]
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("plain", "mapped"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert mapped["export"]["stats"] == plain["export"]["stats"]
    assert not (tmp_path / "mapped" / ".offload").exists()


def test_an_offloaded_model_is_not_written_as_gguf(model_dir, tmp_path, capsys):
    _, err = _main(model_dir, tmp_path, capsys, "out", "--device-map", _device_map(tmp_path), "--format", "gguf",
                   code=2)
    assert "offloaded to disk" in err and "--format safetensors" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--device-map", "auto", "--max-memory", "lots"], "is not a list of DEVICE=SIZE"),
    (["--max-memory", "0=10GiB"], "add --device-map auto"),
    (["--device-map", "missing.json"], "does not exist"),
])
def test_bad_placements_are_refused_before_loading(model_dir, tmp_path, capsys, args, message):
    _, err = _main(model_dir, tmp_path, capsys, "out", *args, code=2)
    assert message in err and "resuming" not in err


WEIGHTS_PROBE = """
import sys
from prune_heads.models import loading
real, calls = loading.load_weights, []
def recording(source, config, kwargs, tokenizer=None):
    calls.append("transformers.models.llama.modeling_llama" in sys.modules and tokenizer is not None)
    return real(source, config, kwargs, tokenizer)
loading.load_weights = recording
lm = loading.load_model(sys.argv[1], dtype="float32", device="cpu")
print(calls, type(lm.model).__name__, lm.tokenizer is not None)
"""


@pytest.mark.slow
def test_weights_are_read_in_one_step_after_the_tokenizer_and_the_modelling_code(model_dir):
    """``loading.load_weights`` is where loading reads weights, and only there (benchmarks/bench_memory.py takes its
    baseline at it): in a fresh process, the architecture's modelling module is imported before it runs."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WEIGHTS_PROBE, str(model_dir)], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["[True]", "LlamaForCausalLM", "True"]


def test_the_heap_policy_is_set_unless_the_user_set_mallocs_thresholds(monkeypatch):
    """glibc's mmap threshold fixed at 16 MiB (and the trim threshold at 64 MiB) for the CLI's process; a threshold
    the user set in the environment wins (glibc read it at start), and trimming is always safe to call."""
    import ctypes.util

    from prune_heads_cli.memory import USER_HEAP_SETTINGS, release_free, steady_heap, trim_heap

    for name in USER_HEAP_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    glibc = ctypes.util.find_library("c") is not None and "glibc" in " ".join(__import__("platform").libc_ver())
    assert steady_heap() is glibc
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert steady_heap() is False
    release_free(), trim_heap()


def test_free_heap_pages_are_handed_back_after_each_layer_only_inside_the_context(monkeypatch):
    """``released_after_each``: one ``release_free`` per forward of each module while inside, none after, and the
    hooks gone (a task pass on the exported model runs inside it, layer by layer)."""
    import torch

    import prune_heads_cli.memory as heap

    calls = []
    monkeypatch.setattr(heap, "release_free", lambda: calls.append(1))
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with heap.released_after_each(layers):
        want = layers(x)
        assert len(calls) == 2
    assert torch.equal(layers(x), want) and len(calls) == 2
    assert all(not m._forward_hooks for m in layers)


def test_free_pages_go_back_only_once_the_resident_set_grew_past_the_slack(monkeypatch):
    """A hand-back returns every free page and the next pass faults them in again (the kernel time of the README
    command), so a pass hands back only once the resident set has grown RELEASE_SLACK above where the last one left
    it; between stages it always does."""
    import prune_heads_cli.memory as heap

    trims, rss = [], [500 << 20]

    class Libc:
        @staticmethod
        def malloc_trim(pad):
            trims.append(pad)

    monkeypatch.setattr(heap, "_libc", lambda: Libc)
    monkeypatch.setattr(heap, "resident_bytes", lambda: rss[0])
    monkeypatch.setattr(heap._Floor, "bytes", 0)
    heap.trim_heap()
    assert trims == [0] and heap._Floor.bytes == 500 << 20
    rss[0] += heap.RELEASE_SLACK - 1
    heap.release_free()
    assert trims == [0]  # within the slack: the pages stay for the next pass
    rss[0] += 1
    heap.release_free()
    assert trims == [0, 0] and heap._Floor.bytes == rss[0]
