"""Finite or refused (models/finite.py): a float16 model whose finite weights overflow in a layer computes NaN logits.
No figure is measured from them: every command that reads the model stops with one line naming the task, the head
set (or "unablated") and the dtype, and nothing is exported. The same checkpoint in float32 is finite and runs."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import cais_file
from tiny import run_cli, tiny_model

from prune_heads.errors import NonFinite
from prune_heads.models.finite import described, finite_logits

pytestmark = pytest.mark.lm_eval


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A tiny Llama saved in float16 whose layer-2 MLP (finite weights: 100 and 60,000) overflows float16."""
    lm = tiny_model("llama")
    with torch.no_grad():
        lm.model.model.layers[2].mlp.up_proj.weight.fill_(100.0)
        lm.model.model.layers[2].mlp.down_proj.weight.fill_(60000.0)
    d = tmp_path_factory.mktemp("finite") / "model"
    lm.model.to(torch.float16).save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return d


def _one_line(code, err, *expected):
    errors = [ln for ln in err.strip().splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in errors[0], errors[0]


@pytest.mark.parametrize("task", [pytest.param("lm-eval:ph_gen", marks=pytest.mark.slow),
                                  pytest.param("lm-eval:ph_mc", marks=pytest.mark.slow),
                                  pytest.param("lm-eval:ph_rolling", marks=pytest.mark.slow), "mmlu"])
def test_eval_refuses_nan_logits_on_every_kind_of_task(overflowing, tmp_path, capsys, task):
    mmlu = cais_file(tmp_path)
    code, _, err = run_cli(["eval", "--model", overflowing, "--task", task, "--task-limit", "4", "--mmlu", mmlu,
                            "--dtype", "float16", "--out", tmp_path / "e", "--no-progress"], capsys)
    _one_line(code, err, "are not finite", "float16", "(unablated)", "float32")
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
@pytest.mark.parametrize("budget", [["--metric", "token-agreement", "--budget", "5pt", "--kl-text", "lm-eval:ph_gen"],
                                    ["--metric", "same-generation", "--budget", "10pt", "--kl-text",
                                     "lm-eval:ph_gen"],
                                    ["--task", "lm-eval:ph_mc", "--metric", "kl", "--budget", "0.05nat"]])
def test_the_main_command_never_verifies_or_exports_nan(overflowing, tmp_path, capsys, budget):
    out = tmp_path / "p"
    code, _, err = run_cli(["--model", overflowing, *budget, "--task-limit", "8", "--calibration-size", "3",
                            "--dtype", "float16", "--no-guard", "--out", out, "--no-progress"], capsys)
    _one_line(code, err, "are not finite", "float16")
    assert not out.exists() and not (out / "prune_heads.json").exists()


def test_the_same_checkpoint_in_float32_is_finite_and_evaluates(overflowing, tmp_path, capsys):
    code, _, err = run_cli(["eval", "--model", overflowing, "--task", "lm-eval:ph_gen", "--task-limit", "3",
                            "--dtype", "float32", "--out", tmp_path / "e", "--no-progress"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["tasks"]["ph_gen"]


def test_the_hook_names_the_head_set_and_leaves_the_model_as_it_was():
    from prune_heads.heads import HeadSet

    lm = tiny_model("llama")
    head = lm.model.get_output_embeddings()
    with pytest.raises(NonFinite, match=r"on mmlu \(with 2 heads ablated\) are not finite .* in float32"):
        with finite_logits(lm, "mmlu", HeadSet.of({0: [1, 2]})):
            with torch.no_grad():
                lm.model.model.norm.weight.fill_(float("nan"))
                lm.model(input_ids=torch.tensor([[3, 4, 5]]))
    assert not head._forward_hooks  # removed on the way out
    assert described(None) == "unablated" and described(HeadSet.of({})) == "unablated"
