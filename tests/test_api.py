"""The Python API (``prune_heads.api``, importable from ``prune_heads``) on models the user holds: the same numbers,
heads and files as the command line on the same inputs, pruning equal to ablation, a reload in a fresh process, peft
adapters sliced as ``adapt`` slices them, each bad input one documented exception, and the public names kept."""
from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cais_file
from tiny import run_cli, save_tiny, tiny_model

import prune_heads
from prune_heads.heads import HeadSet
from prune_heads_cli.console import worded_json

ROOT = Path(__file__).resolve().parents[1]
UNEVEN = {0: [1, 2], 1: [0, 1, 2, 3, 4, 5], 3: [0, 3, 4]}  # layer 1 loses every head; layer 3 a whole KV group and one

# The public names and their signatures: a change here is a change of the API (CHANGELOG.md, and a deprecation for a
# name that goes or an argument that changes).
SIGNATURES = {
    "score_heads": "(model: 'nn.Module', tokenizer: 'PreTrainedTokenizerBase', texts: 'Sequence[str] | None' = None, *, "
                   "scorers: 'Sequence[str] | None' = None, batch_size: 'int | None' = None, progress: 'bool' = True, "
                   "**settings) -> 'HeadScores'",
    "evaluate": "(model: 'nn.Module', tokenizer: 'PreTrainedTokenizerBase', task: 'str' = 'mmlu', *, "
                "heads: 'Heads | None' = None, budget: 'str | float | None' = None, limit: 'int | str | None' = None, "
                "progress: 'bool' = True, **settings) -> 'Evaluation'",
    "find_heads": "(model: 'nn.Module', tokenizer: 'PreTrainedTokenizerBase', budget: 'str | float | None' = '1%', *, "
                  "task: 'str' = 'mmlu', out: 'str | Path | None' = None, force: 'bool' = False, "
                  "progress: 'bool' = True, **settings) -> 'HeadSelection'",
    "ablate": "(model: 'nn.Module', heads: 'Heads') -> 'Iterator[nn.Module]'",
    "prune": "(model: 'nn.Module', heads: 'Heads', *, layout: 'str' = 'auto') -> 'nn.Module'",
}
CLASSES = ("HeadScores", "Evaluation", "HeadSelection", "PruneHeadsError", "UserError", "UnsupportedModel",
           "AlreadyPruned", "HeadIndexError", "NotSliceable", "NonFinite", "DiskFull")


def test_the_public_names_and_their_signatures_are_kept_and_in_the_changelog():
    assert sorted(prune_heads.__all__) == sorted(["__version__", *SIGNATURES, *CLASSES])
    for name, signature in SIGNATURES.items():
        assert str(inspect.signature(getattr(prune_heads, name))) == signature, name
    for name in CLASSES:
        assert inspect.isclass(getattr(prune_heads, name))
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert [name for name in [*SIGNATURES, *CLASSES] if not re.search(rf"`{name}[`(]", changelog)] == []
    assert (ROOT / "prune_heads" / "py.typed").is_file()
    errors = prune_heads
    assert issubclass(errors.UserError, ValueError) and issubclass(errors.HeadIndexError, IndexError)
    assert issubclass(errors.NotSliceable, TypeError) and issubclass(errors.UnsupportedModel, errors.PruneHeadsError)


def test_import_prune_heads_loads_no_api_no_extra_and_neither_torch_nor_transformers():
    code = ("import sys, prune_heads; print(sorted(m for m in ('prune_heads.api', 'peft', 'lm_eval', 'matplotlib', "
            "'prune_heads.pipeline', 'prune_heads_cli', 'torch', 'transformers') if m in sys.modules)); "
            "prune_heads.score_heads; print('prune_heads.api.scores' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    return save_tiny(root / "llama", "llama"), cais_file(root, n_subjects=3, per_subject=9)


def _load(directory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(directory))


def test_score_and_find_equal_the_command_line_on_the_same_inputs(saved, tmp_path, capsys):
    model_dir, mmlu = saved
    model, tok = _load(model_dir)
    scores = prune_heads.score_heads(model, tok, mmlu=str(mmlu), calibration_size=5, progress=False)
    code, _, err = run_cli(["score", "--model", model_dir, "--mmlu", mmlu, "--out", tmp_path / "s",
                            "--calibration-size", "5", "--no-progress"], capsys)
    assert code == 0, err
    cli = json.loads((tmp_path / "s" / "scores.json").read_text())
    assert set(scores.keys()) == set(cli["scores"]) and scores.calibration == cli["calibration"]["source"]
    for key in scores.keys():
        assert torch.allclose(scores[key], torch.tensor(cli["scores"][key], dtype=scores[key].dtype), atol=1e-6), key
    assert scores.ranking("ahon_ln")[0] == min(((layer, h) for layer in range(4) for h in range(6)),
                                               key=lambda p: cli["scores"]["ahon_ln"][p[0]][p[1]])
    assert scores.plot("ahon_ln", UNEVEN, tmp_path / "h.png").axes and (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    flags = {"mmlu": str(mmlu), "calibration_size": 5, "mmlu_per_subject": "all"}
    found = prune_heads.find_heads(model, tok, "2pt", progress=False, out=tmp_path / "f", **flags)
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", tmp_path / "c", "--calibration-size", "5",
                            "--budget", "2pt", "--mmlu-per-subject", "all", "--no-export", "--no-progress"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert found.heads == HeadSet.load(tmp_path / "c" / "heads.json") == HeadSet.load(tmp_path / "f" / "heads.json")
    assert found.report["search_points"] == report["search_points"] == found.points
    worded = worded_json(found.report)  # the command line names options by their flags (--confirm-fraction)
    untimed = lambda guard: {k: v for k, v in guard.items() if k != "seconds"}  # noqa: E731
    assert worded["confirmation"] == report["confirmation"] and untimed(worded["guard"]) == untimed(report["guard"])
    assert found.report["final"] == report["final"] and found.delta.n == report["final"]["n"]
    assert found.as_dict() == {int(k): v for k, v in report["heads"].items()}
    again = prune_heads.find_heads(model, tok, "2pt", progress=False, out=tmp_path / "f", force=True, **flags)
    assert again.heads == found.heads and again.report["cache"]["computed"] == 0  # resumed from out's cache


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "phi3"])
def test_prune_computes_what_ablate_computed_and_ablate_restores_the_model(family):
    lm = tiny_model(family)
    model, ids = lm.model, torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    geometry = lm.arch.geometry(model, 0)
    heads = {layer: [h for h in hs if h < geometry.num_heads] for layer, hs in UNEVEN.items()}
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        base = model(ids).logits
        with pytest.raises(RuntimeError, match="inside"):
            with prune_heads.ablate(model, heads):
                ablated = model(ids).logits
                raise RuntimeError("inside")
        assert torch.equal(model(ids).logits, base)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert prune_heads.prune(model, heads) is model
        assert torch.allclose(model(ids).logits, ablated, atol=1e-5)
    assert model.config.prune_heads["removed"] == HeadSet.of(heads).to_json()


def test_a_pruned_model_saves_and_loads_in_a_fresh_process_and_equals_the_cli_export(saved, tmp_path, capsys):
    model_dir, _ = saved
    model, tok = _load(model_dir)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    heads_file = tmp_path / "heads.json"
    heads_file.write_text(json.dumps(HeadSet.of(UNEVEN).to_json()))
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads_file, "--no-task-eval", "--no-speed",
                            "--dtype", "float32", "--no-progress", "--out", tmp_path / "cli"], capsys)
    assert code == 0, err
    prune_heads.prune(model, UNEVEN)
    model.save_pretrained(tmp_path / "api")
    tok.save_pretrained(tmp_path / "api")
    manifest = json.loads((tmp_path / "cli" / "prune_heads.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == manifest["stats"]["after"]["parameters"]
    assert model.config.prune_heads["plan"] == manifest["plan"]
    script = ("import sys, torch, prune_heads\nfrom transformers import AutoModelForCausalLM\n"
              "ids = torch.tensor([[1, 5, 9, 13, 17, 21]])\n"
              "for d in sys.argv[1:]:\n    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)\n"
              "    torch.save(m(ids).logits.detach(), d + '/logits.pt')\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "api"), str(tmp_path / "cli")], check=True)
    with torch.no_grad():
        mine = model(ids).logits
    assert torch.equal(torch.load(tmp_path / "api" / "logits.pt"), mine)
    assert torch.allclose(torch.load(tmp_path / "cli" / "logits.pt"), mine, atol=1e-5)


def test_a_peft_model_is_pruned_with_its_adapter_as_adapt_slices_it(saved, tmp_path, capsys):
    from helpers import lora_adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from prune_heads.models.adapters import adapter_for
    from prune_heads.models.loading import LoadedModel, ModelSource

    model_dir, _ = saved
    model, tok = _load(model_dir)
    lm = LoadedModel(model, tok, adapter_for("llama"), ModelSource("x", "directory", str(model_dir)), torch.float32,
                     torch.device("cpu"))
    adapter_dir, peft_model = lora_adapter(lm, tmp_path, ["q_proj", "v_proj", "o_proj"])
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps(HeadSet.of(UNEVEN).to_json()))
    assert run_cli(["export", "--model", model_dir, "--heads", heads, "--no-task-eval", "--no-speed", "--dtype",
                    "float32", "--no-progress", "--out", tmp_path / "pruned"], capsys)[0] == 0
    code, _, err = run_cli(["adapt", adapter_dir, "--pruned", tmp_path / "pruned", "--out", tmp_path / "sliced"], capsys)
    assert code == 0, err
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "pruned"), tmp_path / "sliced")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        with prune_heads.ablate(peft_model, UNEVEN):
            ablated = peft_model(ids).logits
        pruned = prune_heads.prune(peft_model, UNEVEN)
        assert torch.allclose(pruned(ids).logits, adapted(ids).logits, atol=1e-5)
        assert torch.allclose(pruned(ids).logits, ablated, atol=1e-5)


def test_evaluate_reads_the_task_as_eval_does_and_judges_the_budget(saved, tmp_path, capsys):
    model_dir, mmlu = saved
    model, tok = _load(model_dir)
    ev = prune_heads.evaluate(model, tok, heads=UNEVEN, budget="2pt", limit=4, mmlu=str(mmlu), progress=False)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps(HeadSet.of(UNEVEN).to_json()))
    code, _, err = run_cli(["eval", "--model", model_dir, "--mmlu", mmlu, "--out", tmp_path / "e", "--ablate", heads,
                            "--no-progress", "--mmlu-per-subject", "4"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "e" / "mmlu.jsonl").read_text().splitlines()]
    assert [r["ablated"]["loglik"] for r in ev.records()] == [r["loglik"] for r in rows]
    assert ev.delta.to_json() == summary["paired_delta"]
    assert ev.within_budget == (ev.delta.delta >= -2.0)


@pytest.mark.lm_eval
def test_evaluate_runs_a_generative_lm_eval_task_as_eval_does(saved, tmp_path, capsys):
    model_dir, _ = saved
    model, tok = _load(model_dir)
    ev = prune_heads.evaluate(model, tok, "lm-eval:ph_gen", heads=UNEVEN, limit=3, progress=False)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps(HeadSet.of(UNEVEN).to_json()))
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", "lm-eval:ph_gen", "--task-limit", "3", "--ablate",
                            heads, "--out", tmp_path / "e", "--no-progress"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert ev.summary["tasks"] == summary["tasks"] and len(ev.records()) == 3
    assert ev.summary["lm_eval"] == summary["lm_eval"]


def _one_line(error: pytest.ExceptionInfo, *words: str) -> None:
    text = str(error.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_each_bad_input_raises_its_documented_exception_in_one_line(saved):
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir, _ = saved
    model, tok = _load(model_dir)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32))
    with pytest.raises(prune_heads.UnsupportedModel) as e:
        prune_heads.prune(gpt2, {0: [0]})
    _one_line(e, "'gpt2' is not supported", "llama")
    with pytest.raises(prune_heads.UnsupportedModel) as e:
        prune_heads.score_heads(torch.nn.Linear(2, 2), tok)
    _one_line(e, "not a transformers model")
    with pytest.raises(prune_heads.HeadIndexError) as e:
        prune_heads.prune(model, {1: [6]})
    _one_line(e, "head 6 of layer 1", "0..5")
    with pytest.raises(IndexError):
        prune_heads.ablate(model, {9: [0]}).__enter__()
    with pytest.raises(TypeError) as e:
        prune_heads.find_heads(model, tok, "1%", calibration_sise=4)
    _one_line(e, "'calibration_sise'", "'calibration_size'")
    with pytest.raises(prune_heads.UserError) as e:
        prune_heads.prune(model, [0, 1])
    _one_line(e, "{layer: [head, ...]}")
    quantised = copy.deepcopy(model)
    attn = quantised.model.layers[2].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.to(torch.int8), requires_grad=False)
    with pytest.raises(prune_heads.NotSliceable) as e:
        prune_heads.prune(quantised, {0: [0]})
    _one_line(e, "model.layers.2.self_attn.k_proj", "quantised", "unquantised")
    other_tool = copy.deepcopy(model)
    for layer in other_tool.model.layers:  # heads 4-5 cut out by hand, the config left as it was
        layer.self_attn.o_proj = torch.nn.Linear(64, layer.self_attn.o_proj.out_features, bias=False)
        layer.self_attn.q_proj = torch.nn.Linear(layer.self_attn.q_proj.in_features, 64, bias=False)
    with pytest.raises(prune_heads.AlreadyPruned) as e:
        prune_heads.score_heads(other_tool, tok)
    _one_line(e, "pruned by another tool", "unpruned checkpoint")
    with pytest.raises(prune_heads.UserError) as e:
        prune_heads.prune(model, {0: [0]}, layout="sideways")
    _one_line(e, "`layout` 'sideways'")
