import pytest

from prune_heads.errors import UserError
from prune_heads.recipes import builtin_recipes, load_recipe, recipe_for


def test_builtin_recipes_exist_and_fill_from_default():
    assert {"default", "llama3", "smollm2", "qwen2.5", "olmo2"} <= set(builtin_recipes())
    r = load_recipe("smollm2")
    assert r.get("scorer") == "ahon_ln" and r.get("dtype") == "bfloat16"
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

    from prune_heads.settings import resolve_settings

    lm = tiny_model("llama")
    model = tmp_path / "m"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    from test_mmlu import _cais_file

    mmlu = str(_cais_file(tmp_path))
    recipe = tmp_path / "kl.yaml"
    recipe.write_text("name: kl\nmetric: kl\nbudget: 0.02nat\n")
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu).metric == "kl"
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu, budget="1%").metric == "accuracy"
    assert resolve_settings(str(model), str(recipe), mmlu=mmlu, budget="0.1").metric == "kl"
    with pytest.raises(UserError, match="but --metric is kl"):
        resolve_settings(str(model), str(recipe), mmlu=mmlu, budget="1%", metric="kl")
