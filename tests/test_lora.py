"""LoRA adapters trained on the unpruned base keep working on the pruned model (prune-heads adapt)."""
import copy

import pytest
import torch
from helpers import UNEVEN, logits, lora_adapter
from tiny import tiny_model

from exporters.export import ExportOptions, export_pruned
from exporters.lora import slice_adapter
from prune_heads.models.adapters import adapter_for
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import ablate
from prune_heads_cli.main import main


@pytest.mark.parametrize("family,layout", [("llama", "per-layer"), ("qwen2", "per-layer"), ("olmo2", "uniform"),
                                           ("phi3", "uniform"), ("qwen3", "masked")])
def test_sliced_adapter_on_pruned_base_equals_ablated_base_with_adapter(family, layout, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lm = tiny_model(family)
    targets = ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter_dir, peft_model = lora_adapter(lm, tmp_path, targets)
    merged = LoadedModel(peft_model.merge_and_unload(), lm.tokenizer, adapter_for(lm.config.model_type), lm.source,
                         lm.dtype, lm.device)

    pruned_dir = tmp_path / "pruned"
    pruned_dir.mkdir()
    result = export_pruned(lm, UNEVEN, pruned_dir, ExportOptions(layout=layout, progress=False, measure_speed=False))
    with ablate(merged, result.choice.plan):
        expected = logits(merged.model)

    sliced = slice_adapter(adapter_dir, pruned_dir, tmp_path / "sliced")
    base = AutoModelForCausalLM.from_pretrained(pruned_dir)
    with_adapter = PeftModel.from_pretrained(base, sliced)
    assert torch.allclose(logits(with_adapter), expected, atol=1e-4), (family, layout)
    assert torch.allclose(logits(with_adapter.merge_and_unload()), expected, atol=1e-4)


def test_adapt_command_and_bad_inputs(tmp_path, capsys):
    lm = tiny_model("llama")
    adapter_dir, _ = lora_adapter(lm, tmp_path, ["q_proj", "o_proj"])
    pruned_dir = tmp_path / "pruned"
    pruned_dir.mkdir()
    export_pruned(lm, UNEVEN, pruned_dir, ExportOptions(progress=False, measure_speed=False))
    with pytest.raises(SystemExit) as e:
        main(["adapt", str(adapter_dir), "--pruned", str(pruned_dir), "--out", str(tmp_path / "a")])
    assert e.value.code == 0 and (tmp_path / "a" / "adapter_model.safetensors").is_file()
    import json

    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(pruned_dir.resolve())
    with pytest.raises(SystemExit) as e:
        main(["adapt", str(tmp_path), "--pruned", str(pruned_dir), "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not a peft adapter" in err
    with pytest.raises(SystemExit) as e:
        main(["adapt", str(adapter_dir), "--pruned", str(tmp_path), "--out", str(tmp_path / "c")])
    assert e.value.code == 2 and "not a prune-heads export" in capsys.readouterr().err


def test_main_command_with_adapter_prunes_base_and_ships_sliced_adapter(tmp_path, capsys):
    import json

    from helpers import cais_file
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lm = tiny_model("qwen2")
    adapter_dir, peft_model = lora_adapter(lm, tmp_path, ["q_proj", "k_proj", "v_proj", "o_proj"])
    model_dir = tmp_path / "base"
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model_dir), "--adapter", str(adapter_dir), "--mmlu", str(cais_file(tmp_path)), "--out", str(out),
              "--calibration-size", "4", "--no-progress", "--budget", "5pt", "--mmlu-per-subject", "all"])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["adapter"]["max_abs_logit_diff"] <= report["adapter"]["tolerance"]
    assert report["adapter"]["task_eval"]["agreement_with_verified"] == 1.0
    # The shipped base is the pruned *base* (no adapter merged in), and base + sliced adapter loads with peft.
    base = AutoModelForCausalLM.from_pretrained(out)
    full = PeftModel.from_pretrained(base, out / "adapter")
    merged = LoadedModel(peft_model.merge_and_unload(), lm.tokenizer, adapter_for("qwen2"), lm.source, lm.dtype, lm.device)
    from prune_heads.heads import HeadSet
    from prune_heads.plan.planner import Planner

    heads = HeadSet.load(out / "heads.json")
    plan = Planner(merged.arch.geometries(merged.model), merged.arch, merged.config, 4).choose(heads, "auto").plan
    with ablate(merged, plan):
        assert torch.allclose(logits(full), logits(merged.model), atol=1e-4)


def test_dora_on_queries_with_zero_padding_heads_is_refused_and_works_without_them(tmp_path):
    """DoRA divides each row of W + BA by its norm: a zero padding head's query rows would give 0 / 0."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from prune_heads.errors import UserError

    lm = tiny_model("mistral")
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(lm.model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                    use_dora=True, init_lora_weights=False))
    adapter_dir = tmp_path / "dora"
    peft_model.save_pretrained(adapter_dir)
    padded = tmp_path / "padded"
    padded.mkdir()
    result = export_pruned(lm, UNEVEN, padded, ExportOptions(layout="uniform", progress=False, measure_speed=False))
    assert any(h is None for lp in result.choice.plan.layers for h in lp.slots)  # zero padding heads exist
    with pytest.raises(UserError, match="DoRA on the query projection.*`layout` masked"):
        slice_adapter(adapter_dir, padded, tmp_path / "s1")
    # The masked layout keeps every row: the DoRA adapter slices and reproduces the ablated merged model.
    masked = tmp_path / "masked"
    masked.mkdir()
    result = export_pruned(lm, UNEVEN, masked, ExportOptions(layout="masked", progress=False, measure_speed=False))
    sliced = slice_adapter(adapter_dir, masked, tmp_path / "s2")
    merged = LoadedModel(peft_model.merge_and_unload(), lm.tokenizer, lm.arch, lm.source, lm.dtype, lm.device)
    with ablate(merged, result.choice.plan):
        expected = logits(merged.model)
    got = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(masked), sliced))
    assert torch.isfinite(got).all() and torch.allclose(got, expected, atol=1e-4)
