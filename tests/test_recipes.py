import pytest
import torch

from prune_heads.errors import UserError
from prune_heads.pipeline.recipes import builtin_recipes, load_recipe, recipe_for


def test_builtin_recipes_exist_and_fill_from_default():
    assert {"default", "llama3", "smollm2", "qwen2.5", "olmo2"} <= set(builtin_recipes())
    r = load_recipe("smollm2")
    assert r.get("scorer") == "ahon_ln" and r.get("dtype") == "auto"
    assert r.get("mmlu_per_subject", "cpu") == 6 and r.get("mmlu_per_subject", "cuda") is None
    assert len(r.get("mmlu_subjects", "cpu")) == 19 and r.get("mmlu_subjects", "cuda") is None  # all 57 on a GPU
    # SmolLM2-135M answers MMLU at chance: its recipe budgets the answer KL, which has signal there.
    assert (r.get("metric"), r.get("budget")) == ("kl", "0.02nat")
    assert load_recipe("default").get("metric") == "accuracy" and load_recipe("default").get("task") == "mmlu"


def test_recipe_matching():
    assert recipe_for("HuggingFaceTB/SmolLM2-360M", "llama").name == "smollm2"
    assert recipe_for("meta-llama/Llama-3.2-1B", "llama").name == "llama3"
    assert recipe_for("Qwen/Qwen2.5-0.5B", "qwen2").name == "qwen2.5"
    assert recipe_for("allenai/OLMo-2-0425-1B", "olmo2").name == "olmo2"
    assert recipe_for("someone/model", "phi3").name == "default"


def test_user_recipe_file_overrides_and_bad_keys_fail(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\nscorer: awft\nbudget: 2pt\n")
    r = load_recipe(str(p))
    assert r.name == "mine" and r.get("scorer") == "awft" and r.get("calibration_size") == 128
    p.write_text("scorr: awft\n")
    with pytest.raises(UserError, match="unknown keys"):
        load_recipe(str(p))
    with pytest.raises(UserError, match="neither a file nor a built-in"):
        load_recipe("nope")


def test_budget_unit_beats_recipe_metric_but_explicit_metric_conflicts(tmp_path):
    from tiny import tiny_model

    from prune_heads.pipeline.merging import resolve_settings

    lm = tiny_model("llama")
    model = tmp_path / "m"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    from helpers import cais_file

    mmlu = str(cais_file(tmp_path))
    recipe = tmp_path / "kl.yaml"
    recipe.write_text("name: kl\nmetric: kl\nbudget: 0.02nat\n")
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu).metric == "kl"
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu, budget="1%").metric == "accuracy"
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu, budget="0.1").metric == "kl"
    with pytest.raises(UserError, match="but `metric` is kl"):
        resolve_settings(str(model), str(recipe), mmlu=mmlu, budget="1%", metric="kl")
    # near chance, a generative lm-eval task named as the text makes generation the budget (the recipe's own)
    recipe.write_text("name: kl\nmetric: kl\nbudget: 0.02nat\ngeneration_budget: 0.05nat\n")
    generation = resolve_settings(str(model), str(recipe), mmlu=mmlu, kl_text="lm-eval:ph_gen")
    assert (generation.metric, generation.budget.limit) == ("kl-text", 0.05)
    given = resolve_settings(str(model), str(recipe), mmlu=mmlu, kl_text="lm-eval:ph_gen", budget="0.02nat")
    assert given.metric == "kl"
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu, kl_text="lm-eval:ph_gen",
                            metric="token-agreement", budget="5pt").metric == "token-agreement"


def test_dtype_auto_measures_the_cpu_and_memory_can_overrule(monkeypatch):
    """bfloat16 only where this CPU computes it faster than float32 (as measured), or where float32 would not fit."""
    import prune_heads.models.dtypes as dtypes

    cpu = torch.device("cpu")
    monkeypatch.setattr(dtypes, "cpu_matmul_speeds", lambda: (133.0, 31.0))  # a Xeon without AVX512_BF16/AMX
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: [])
    choice = dtypes.auto_dtype(cpu, 4 << 30, 64 << 30)
    assert choice.dtype == torch.float32 and "bf16 matmul 31 GFLOP/s vs float32 133" in choice.reason
    low = dtypes.auto_dtype(cpu, 40 << 30, 32 << 30)  # float32 weights of a 10B model, 32 GiB free
    assert low.dtype == torch.bfloat16 and "would not fit" in low.reason
    monkeypatch.setattr(dtypes, "cpu_matmul_speeds", lambda: (120.0, 400.0))  # AVX512_BF16 / AMX
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    fast = dtypes.auto_dtype(cpu, 4 << 30, 64 << 30)
    assert fast.dtype == torch.bfloat16 and "avx512_bf16" in fast.reason


@pytest.mark.real_dtype_measurement
def test_dtype_auto_on_this_machine_follows_its_measurement():
    import prune_heads.models.dtypes as dtypes

    f32, bf16 = dtypes.cpu_matmul_speeds()
    choice = dtypes.auto_dtype(torch.device("cpu"))
    assert choice.dtype == (torch.bfloat16 if bf16 > dtypes.FASTER * f32 else torch.float32)
