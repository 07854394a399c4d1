"""LoRA adapters trained on the unpruned base keep working on the pruned model (prune-heads adapt)."""
import copy

import pytest
import torch

from exporters.adapter import slice_adapter
from exporters.export import export_pruned
from prune_heads.ablation import ablate
from prune_heads.cli import main
from prune_heads.models.adapters import adapter_for
from prune_heads.models.loading import LoadedModel
from test_export import IDS, UNEVEN, logits
from tiny import tiny_model


def _adapter(lm, tmp_path, targets):
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(lm.model)
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # make the adapter matter
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    d = tmp_path / "adapter"
    peft_model.save_pretrained(d)
    return d, peft_model


@pytest.mark.parametrize("family,layout", [("llama", "per-layer"), ("qwen2", "per-layer"), ("olmo2", "uniform"),
                                           ("phi3", "uniform"), ("qwen3", "masked")])
def test_sliced_adapter_on_pruned_base_equals_ablated_base_with_adapter(family, layout, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lm = tiny_model(family)
    targets = ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter_dir, peft_model = _adapter(lm, tmp_path, targets)
    merged = LoadedModel(peft_model.merge_and_unload(), lm.tokenizer, adapter_for(lm.config.model_type), lm.source,
                         lm.dtype, lm.device)

    pruned_dir = tmp_path / "pruned"
    pruned_dir.mkdir()
    result = export_pruned(lm, UNEVEN, pruned_dir, layout=layout, log=lambda *a: None, progress=False)
    with ablate(merged, result.choice.plan):
        expected = logits(merged.model)

    sliced = slice_adapter(adapter_dir, pruned_dir, tmp_path / "sliced", log=lambda *a: None)
    trust = result.choice.layout == "per-layer"
    base = AutoModelForCausalLM.from_pretrained(pruned_dir, trust_remote_code=trust)
    with_adapter = PeftModel.from_pretrained(base, sliced)
    assert torch.allclose(logits(with_adapter), expected, atol=1e-4), (family, layout)
    assert torch.allclose(logits(with_adapter.merge_and_unload()), expected, atol=1e-4)


def test_adapt_command_and_bad_inputs(tmp_path, capsys):
    lm = tiny_model("llama")
    adapter_dir, _ = _adapter(lm, tmp_path, ["q_proj", "o_proj"])
    pruned_dir = tmp_path / "pruned"
    pruned_dir.mkdir()
    export_pruned(lm, UNEVEN, pruned_dir, log=lambda *a: None, progress=False)
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
