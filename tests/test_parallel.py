"""Several processes, one answer: the main command under torchrun (2 gloo processes on CPU) gives the report a single
process gives, rank 0 alone writes, and an interrupted multi-process run resumes like a single one."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cais_file
from safetensors.torch import load_file
from tiny import save_tiny

from prune_heads.io.parallel import Ranks

pytestmark = pytest.mark.processes

TESTS = Path(__file__).parent
TIMING = {"seconds", "speed", "timings"}  # wall-clock figures differ between any two runs
# What a process kept for layer reuse depends on how the work was shared out (under torchrun, rank 0's share) and on
# what a resumed run found cached: how the numbers were computed, not what they are.
LAYOUT = {"layer_reuse"}


def _env(extra=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(extra or {})}
    env.pop("WORLD_SIZE", None)
    return env


def single(argv, extra=None):
    return subprocess.Popen([sys.executable, "-m", "prune_heads_cli", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(extra), start_new_session=True)


def torchrun(argv, extra=None, entry=("-m", "prune_heads_cli")):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *entry,
           *map(str, argv)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(extra),
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each rank in a session of its own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def finished(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def assert_same_report(a, b, path="report"):
    """Equal everywhere but the timings and the layer reuse's account; floats to 1e-6 relative (the same batches run
    in either case)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            if k not in TIMING | LAYOUT:
                assert_same_report(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_report(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (path, a, b)
    else:
        assert a == b, (path, a, b)


def assert_same_cache(a: Path, b: Path):
    """The same work in both runs (same keys) with the same numbers: every question's log-likelihoods, hence every
    prediction, and every score per calibration input."""
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in b.glob("*.safetensors"))
    for name in names:
        x, y = load_file(a / name), load_file(b / name)
        assert set(x) == set(y)
        for key in x:
            torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-6, msg=f"{name}:{key}")
            if key == "loglik":
                assert torch.equal(x[key].argmax(-1), y[key].argmax(-1)), name


def test_span_and_deal():
    # Balanced contiguous runs; kept to subject boundaries when given; never backwards, covering everything once.
    assert [Ranks(r, 2).span([10]) for r in range(2)] == [(0, 5), (5, 10)]
    sizes = [3, 3, 3, 3, 3]
    cuts = [3, 6, 9, 12, 15]
    assert [Ranks(r, 2).span(sizes, cuts) for r in range(2)] == [(0, 9), (9, 15)]
    assert [Ranks(r, 3).span(sizes, cuts) for r in range(3)] == [(0, 6), (6, 9), (9, 15)]
    spans = [Ranks(r, 4).span([1, 1]) for r in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == 2 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert Ranks(1, 3).deal(list(range(7))) == [1, 4]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    return save_tiny(d / "model", "llama"), cais_file(d, n_subjects=5, per_subject=9)


def args(setup, out, *extra):
    model, mmlu = setup
    return ["--model", model, "--mmlu", mmlu, "--out", out, "--mmlu-per-subject", "all", "--dtype", "float32",
            "--calibration-size", "7", "--batch-size", "2", "--budget", "0.05nat", "--no-progress", *extra]


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    code, err = finished(single(args(setup, out)))
    assert code == 0, err
    return out


@pytest.mark.slow
def test_two_processes_give_the_single_process_report(setup, reference, tmp_path):
    out = tmp_path / "run"
    code, err = finished(torchrun(args(setup, out)))
    assert code == 0, err
    report, ref = (json.loads((d / "report.json").read_text()) for d in (out, reference))
    assert report.pop("processes") == 2 and ref.pop("processes") == 1
    assert_same_report(report, ref)
    assert report["export"]["verification"]["max_abs_logit_diff"] <= report["export"]["verification"]["tolerance"]
    assert_same_cache(out / "cache", reference / "cache")
    assert err.count("pruned model, report") == 1  # rank 0 speaks for the run


@pytest.mark.slow
def test_two_processes_share_the_reference_generations_of_an_lm_eval_budget(setup, tmp_path):
    """A generation budget under torchrun: lm-eval shares the documents out by rank (its own data parallelism), the
    generations and their token ids come back to every rank, and the report is the single process's."""
    pytest.importorskip("lm_eval")
    gen = ["--metric", "kl-text", "--kl-text", "lm-eval:ph_gen", "--no-guard"]
    runs = {n: start(args(setup, tmp_path / n, *gen)) for n, start in (("one", single), ("two", torchrun))}
    for name, proc in runs.items():
        code, err = finished(proc)
        assert code == 0, (name, err)
    report, ref = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("two", "one"))
    assert report.pop("processes") == 2 and ref.pop("processes") == 1
    assert report["task"]["kl_text"]["texts"] == 16 and report["confirmation"]["texts"] == 16
    assert_same_report(report, ref)


@pytest.mark.slow
def test_rank_0_alone_writes(setup, tmp_path):
    watch = tmp_path / "outputs"
    watch.mkdir()
    log = tmp_path / "writes"
    code, err = finished(torchrun(args(setup, watch / "run"), {"PROBE_WATCH": str(watch), "PROBE_LOG": str(log)},
                                  entry=(str(TESTS / "rank_probe.py"),)))
    assert code == 0, err
    rank0, rank1 = (Path(f"{log}.{r}").read_text().split("\n") for r in (0, 1))
    assert [w for w in rank1 if w] == []
    written = "\n".join(rank0)
    assert "report.json" in written and "model.safetensors" in written and "/cache/" in written
    assert (watch / "run" / "report.json").is_file()


@pytest.mark.slow
def test_interrupted_two_process_run_resumes(setup, reference, tmp_path):
    out, partial = tmp_path / "run", tmp_path / ".run.partial"
    proc = torchrun(args(setup, out), {"PRUNE_HEADS_TEST_PAUSE_AFTER_CACHE_WRITE": "0.4"})
    deadline = time.time() + 300
    while len(list((partial / "cache").glob("eval-*.safetensors"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    for pid in [proc.pid, *descendants(proc.pid)]:  # the launcher and every rank at once: a crash
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    assert not out.exists()
    done_before = len(list((partial / "cache").glob("*.safetensors")))
    assert done_before >= 3
    code, err = finished(torchrun(args(setup, out)))
    assert code == 0, err
    report, ref = (json.loads((d / "report.json").read_text()) for d in (out, reference))
    assert "resuming" in err
    assert report["cache"]["computed"] == ref["cache"]["computed"] - done_before  # nothing finished is redone
    for r in (report, ref):
        r.pop("cache"), r.pop("processes")
    assert_same_report(report, ref)


@pytest.mark.slow
def test_refusals_under_torchrun(setup, tmp_path):
    code, err = finished(torchrun(args(setup, tmp_path / "a", "--device-map", "auto")))
    assert code != 0 and "error: --device-map places one model across devices" in err
    code, err = finished(torchrun(["score", "--model", setup[0], "--out", tmp_path / "b"]))
    assert code != 0 and "only the main command" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.embedded(processes=3)  # one run beside a two-process one
@pytest.mark.slow
def test_the_readme_command_on_the_embedded_model_in_one_process_and_in_two(tmp_path):
    """The README's main command on the embedded SmolLM2-135M wheel (GGUF; 30 layers x 9 heads, 3 KV heads) on a small
    MMLU subset, healing the export (a GGUF-loaded, dequantised model); the same command under torchrun gives the same
    heads, scores, predictions and export. One test, not two: each run of the real model costs minutes, and the
    single-process run is the reference of the two-process one. The long-context guard is off here: its probes read
    16,000 tokens per point, two thirds of these runs' time; it is tested on this model by
    test_guard.py::test_zeroing_the_heads_the_probes_find_retrieving_is_refused_on_the_embedded_model, and through the
    main command, under torchrun too, on tiny models."""
    pytest.importorskip("gguf")
    argv = ["--model", "smollm2-135m", "--mmlu-per-subject", "1", "--mmlu-subjects", "6",  # the recipe's budget
            "--calibration-size", "6", "--no-progress", "--no-speed", "--heal-steps", "2", "--no-guard",
            "--dtype", "float32"]  # the same in both runs (auto measures the CPU in each)
    runs = {"one": single([*argv, "--out", tmp_path / "one"]), "two": torchrun([*argv, "--out", tmp_path / "two"])}
    errs = {}
    for name, proc in runs.items():
        code, errs[name] = finished(proc, timeout=1500)
        assert code == 0, (name, errs[name][-3000:])
    one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    _assert_the_readme_run(one, tmp_path / "one", errs["one"])
    assert (one.pop("processes"), two.pop("processes")) == (1, 2)
    assert_same_report(two, one)
    assert_same_cache(tmp_path / "two" / "cache", tmp_path / "one" / "cache")
    assert one["heads"] and one["budget"]["metric"] == "kl" and one["budget"]["limit"] == 0.02


def _assert_the_readme_run(report: dict, out: Path, stderr: str):
    assert report["architecture"] == {"model_type": "llama", "adapter": "llama", "layers": 30, "heads_per_layer": [9] * 30,
                                      "kv_heads_per_layer": [3] * 30, "head_dim": 64}
    assert report["model"]["kind"] == "embedded" and len(report["model"]["fingerprint"]) == 64
    assert report["recipe"]["name"] == "smollm2"
    assert report["task"]["questions"] == 6 and report["task"]["skipped_rows"] == 2
    assert len(report["scores"]["ahon_ln"]) == 30 and len(report["scores"]["ahon_ln"][0]) == 9
    # 6 questions cannot tell the model from chance: the run must say so (an accuracy budget would verify nothing).
    assert report["warnings"] and "chance" in report["warnings"][0] and "chance" in stderr
    assert json.loads((out / "heads.json").read_text()) == report["heads"]
    heal = report["export"]["healing"]
    assert heal["steps"] == 2 and heal["merge_max_abs_logit_diff"] < 1e-2 and len(heal["losses"]) == 2
    assert "%|" not in stderr and "it/s" not in stderr  # --no-progress: GGUF conversion's bar too
