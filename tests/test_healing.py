"""LoRA healing: the loss goes down, a fixed seed reproduces the weights, removed and padding heads stay silent,
and the healed export reloads with transformers and is verified against the healed model."""
import json

import pytest
import torch
from helpers import cais_file
from tiny import CORPUS, run_cli, save_tiny, tiny_model

from prune_heads.heads import HeadSet
from prune_heads.plan.healing import HealConfig, dead_head_slots, heal
from prune_heads.plan.planner import Planner
from prune_heads.plan.slicing import pruned_copy


def pruned_tiny(layout="uniform"):
    lm = tiny_model("llama")
    heads = HeadSet.of({0: [0, 1, 4], 2: [5], 3: [2, 3]})
    layouts = lm.arch.geometries(lm.model)
    plan = Planner(layouts, lm.arch, lm.config, 4).choose(heads, layout).plan
    return lm, plan, pruned_copy(lm.model, lm.arch, plan)


def texts(lm):
    lines = [ln for ln in CORPUS.splitlines() if ln.strip()]
    return [lm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in lines]


def test_healing_lowers_the_loss_is_reproducible_and_keeps_padding_heads_silent():
    lm, plan, model = pruned_tiny("uniform")
    dead = dead_head_slots(model, lm.arch, plan)
    assert dead  # the uniform layout pads some layers with zero heads
    config = HealConfig(steps=30, seed=3, rank=4, alpha=8, learning_rate=3e-3, batch_size=2)
    healed, record = heal(model, texts(lm), config, progress=False, dead_heads=dead)
    assert record["loss_last"] < record["loss_first"] - 0.05
    assert len(record["losses"]) == 30 and "o_proj" in record["targets"] and "down_proj" in record["targets"]
    for name, (d, slots) in dead.items():
        w = healed.get_submodule(name).weight
        assert all(float(w[:, j * d:(j + 1) * d].abs().max()) == 0.0 for j in slots)
    assert not any(p.requires_grad for p in healed.parameters())
    assert not any("lora" in n for n, _ in healed.named_modules())  # merged, no peft layers left
    # Same seed, same weights; another seed, other weights.
    _, plan2, model2 = pruned_tiny("uniform")
    again, record2 = heal(model2, texts(lm), config, progress=False,
                          dead_heads=dead_head_slots(model2, lm.arch, plan2))
    assert record2["losses"] == record["losses"]
    sd, sd2 = healed.state_dict(), again.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    _, plan3, model3 = pruned_tiny("uniform")
    other, _ = heal(model3, texts(lm), HealConfig(**{**config.to_json(), "seed": 4}), progress=False,
                    dead_heads=dead_head_slots(model3, lm.arch, plan3))
    assert not torch.equal(other.state_dict()["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.q_proj.weight"])


def test_merged_weights_compute_what_was_trained_and_silencing_keeps_padding_heads_dead():
    lm, plan, model = pruned_tiny("per-layer")
    dead = dead_head_slots(model, lm.arch, plan)
    config = HealConfig(steps=6, seed=0, rank=4, learning_rate=1e-2, batch_size=2)
    healed, record = heal(model, texts(lm), config, progress=False, dead_heads=dead)
    assert record["merge_max_abs_logit_diff"] < 1e-4  # the merge (and re-zeroing) changes nothing trained
    # Without silencing, LoRA's o_proj update brings the padding heads' columns back to life.
    _, plan2, model2 = pruned_tiny("per-layer")
    revived, _ = heal(model2, texts(lm), config, progress=False, dead_heads={})
    name, (d, slots) = next(iter(dead.items()))
    assert float(revived.get_submodule(name).weight[:, slots[0] * d:(slots[0] + 1) * d].abs().max()) > 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_heal"), "llama")



@pytest.mark.slow
def test_main_command_heals_the_export_and_it_reloads(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    mmlu = cais_file(tmp_path, n_subjects=3, per_subject=14)
    out = tmp_path / "healed"
    base = ["--model", model_dir, "--mmlu", mmlu, "--mmlu-per-subject", "3", "--dtype", "float32", "--no-progress",
            "--calibration-size", "4", "--budget", "100%", "--layout", "uniform"]
    code, _, err = run_cli(base + ["--out", out, "--heal-steps", "12", "--seed", "1"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    meta = json.loads((out / "prune_heads.json").read_text())
    heal_rec = meta["healing"]
    assert heal_rec == report["export"]["healing"] and heal_rec["steps"] == 12 and heal_rec["seed"] == 1
    assert "held-out mmlu questions" in heal_rec["data"] and heal_rec["texts"] == 18  # 3 x (14 - 5 - 3) held out
    assert heal_rec["pruned_before_healing_max_abs_logit_diff"] < 1e-3
    assert meta["verified"] and meta["task_eval"]["before_healing"]["accuracy"] == report["final"]["accuracy"]
    assert "healed model" in (out / "README.md").read_text() and "LoRA" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out)  # stock transformers, no remote code (uniform layout)
    assert model.config.num_attention_heads <= 6
    # The export is the healed model, not the merely pruned one.
    code, _, err = run_cli(base + ["--out", tmp_path / "plain"], capsys)
    assert code == 0, err
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    ids = torch.tensor([[5, 9, 33, 7, 100, 4, 8]])
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)


@pytest.mark.slow
def test_heal_in_search_judges_points_after_healing(model_dir, tmp_path, capsys):
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=14)
    out = tmp_path / "his"
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--mmlu-per-subject", "3", "--dtype", "float32",
                            "--no-progress", "--calibration-size", "4", "--budget", "0.5nat", "--heal-steps", "3",
                            "--heal-in-search", "--out", out], capsys)
    assert code == 0, err
    assert err.count("healing the pruned model for") == len([p for p in json.loads((out / "report.json").read_text())["search_points"]
                                                             if p["num_heads"] > 0])
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["heal_in_search"] and report["export"]["healing"]["steps"] == 3


@pytest.mark.parametrize("extra,message", [
    (["--heal-in-search"], "give the number of steps with --heal-steps N"),
    (["--heal-steps", "5", "--no-export"], "drop --no-export"),
    (["--heal-steps", "5", "--layout", "masked"], "needs a physical layout"),
    (["--heal-steps", "5", "--adapter", "somewhere"], "do not combine"),
])
def test_healing_option_errors(model_dir, tmp_path, capsys, extra, message):
    code, _, err = run_cli(["--model", model_dir, "--out", tmp_path / "x"] + extra, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_healing_gives_every_tensor_its_dtype_back():
    """A bfloat16 model keeps float32 RoPE frequencies; healing trains in float32 and must restore both."""
    lm, plan, model = pruned_tiny("uniform")
    model.to(torch.bfloat16)
    rotary = dict(model.named_buffers())
    rotary = {n: b for n, b in rotary.items() if "inv_freq" in n}
    for b in rotary.values():
        b.data = b.data.float()
    before = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]}
    healed, _ = heal(model, texts(lm), HealConfig(steps=2, batch_size=2), progress=False,
                     dead_heads=dead_head_slots(model, lm.arch, plan))
    after = {n: t.dtype for n, t in [*healed.named_parameters(), *healed.named_buffers()]}
    assert after == before and any(d == torch.float32 for d in after.values())
