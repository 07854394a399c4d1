"""Removal units (units.py): every prefix the search can choose is removed for real in the export, for groups of
2, 4, 6 and 7 query heads per KV head; the objective picks what ships; the uniform search ships a stock config."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import cais_file
from tiny import FnEvaluator, run_cli, save_tiny, tiny_model

from prune_heads.heads import HeadSet
from prune_heads.plan.planner import Planner, plan_masked
from prune_heads.search.budget import Budget
from prune_heads.search.budget_search import SearchOptions, search_budget
from prune_heads.search.units import UnitRanking, gqa_units


def _planner(lm):
    return Planner(lm.arch.geometries(lm.model), lm.arch, lm.config, 4)


def _scores(lm, seed=0):
    geo = lm.arch.geometries(lm.model)
    return torch.rand(len(geo), geo[0].num_heads, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group", [2, 4, 6, 7])
@pytest.mark.parametrize("uniform", [False, True])
def test_every_prefix_of_gqa_units_ships_what_it_zeroes(group, uniform):
    lm = tiny_model("mistral", num_attention_heads=2 * group, num_key_value_heads=2)
    planner = _planner(lm)
    units = gqa_units(_scores(lm, group), True, planner.geometries, uniform=uniform)
    ranking = UnitRanking(units, sum(g.num_heads for g in planner.geometries))
    layout = "uniform" if uniform else "per-layer"
    for k in range(1, len(ranking) + 1):
        heads = ranking.heads(k)
        s = planner.savings(heads, layout)
        assert s["deployment_efficiency"] >= 0.999, (k, s)
        shapes = planner.choose(heads, layout).plan.shapes
        assert all(h > 0 and kv > 0 and h % kv == 0 for h, kv in shapes)
        if uniform:
            assert len(set(shapes)) == 1


def test_per_head_selections_waste_what_units_do_not():
    """The old failure: two heads out of one group of six save nothing in the export."""
    lm = tiny_model("llama", num_attention_heads=12, num_key_value_heads=2)
    planner = _planner(lm)
    two_of_one_group = HeadSet.of({0: [0, 1]})
    assert planner.savings(two_of_one_group, "per-layer")["attention_params_removed"] == 0
    slice_ = HeadSet.of({0: [0, 6]})  # one head from each of the two groups
    assert planner.savings(slice_, "per-layer")["deployment_efficiency"] == 1.0
    group = HeadSet.of({0: list(range(6))})
    s = planner.savings(group, "per-layer")
    assert s["deployment_efficiency"] == 1.0 and s["kv_cache_removed"] > 0


def test_unit_order_respects_layers_and_scores():
    lm = tiny_model("llama")
    planner = _planner(lm)
    scores = _scores(lm)
    units = gqa_units(scores, True, planner.geometries)
    assert [u.score for u in units] == sorted(u.score for u in units)
    for layer in range(len(planner.geometries)):
        slices = [u for u in units if u.kind == "slice" and u.members[0][0] == layer]
        assert len(slices) == 2 and all(len(u.members) == 2 for u in slices)  # groups of 3: two slices of 2 heads
        for a, b in zip(slices, slices[1:]):
            assert units.index(a) < units.index(b)
    groups_only = gqa_units(scores, True, planner.geometries, slices=False)
    assert {u.kind for u in groups_only} == {"group"} and all(len(u.members) == 3 for u in groups_only)


def test_objective_picks_the_passing_point_that_ships_the_most():
    """A per-head ranking whose larger prefix saves less in the export than a smaller one: --objective params picks
    the smaller, --objective heads (the paper's) the larger."""
    from prune_heads.eval.results import EvalResult

    lm = tiny_model("llama")
    planner = _planner(lm)
    ranking = [(0, 0), (0, 3), (1, 0), (1, 1)]  # two heads from different groups, then two from one group

    def evaluate(heads, label):
        return base

    from prune_heads.data.tasks import Question

    q = Question("s", 0, "q", ("a", "b", "c", "d"), 0)
    base = EvalResult([q], torch.tensor([[0.0, -1.0, -1.0, -1.0]], dtype=torch.float64))
    describe = lambda heads: planner.savings(heads, "per-layer")  # noqa: E731
    by_params = search_budget(ranking, FnEvaluator(evaluate, base, Budget(1.0), describe), SearchOptions(grid=(0.025, 0.05, 0.1), patience=1, refine_steps=3, objective="params"))
    by_heads = search_budget(ranking, FnEvaluator(evaluate, base, Budget(1.0), describe), SearchOptions(grid=(0.025, 0.05, 0.1), patience=1, refine_steps=3, objective="heads"))
    assert by_heads.best.num_heads >= by_params.best.num_heads
    assert by_params.best.savings["attention_params_removed"] >= by_heads.best.savings["attention_params_removed"]
    assert all("shipped" in p.to_json() for p in by_params.points)


@pytest.fixture
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("units"), "llama")


def _run(model_dir, tmp_path, capsys, *extra, speed=False):
    """The main command; the export timed against the original only where the test reads the speed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=9)
    budget = [] if "--budget" in extra else ["--budget", "100%"]
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", out, "--calibration-size", "4",
                            "--dtype", "float32", "--no-progress", *budget, *extra, *([] if speed else ["--no-speed"])],
                           capsys)
    assert code == 0, err
    return out, json.loads((out / "report.json").read_text())


def test_default_search_ships_what_it_zeroes(model_dir, tmp_path, capsys):
    out, report = _run(model_dir, tmp_path, capsys, speed=True)
    final = report["final"]
    assert report["search"] == {"units": "gqa", "objective": "params", "layout": "auto"}
    assert final["num_heads_removed"] > 0 and final["shipped"]["deployment_efficiency"] >= 0.95
    assert all(p["shipped"]["deployment_efficiency"] >= 0.95 for p in report["search_points"])
    meta = json.loads((out / "prune_heads.json").read_text())
    assert meta["stats"]["after"]["query_heads"] == final["shipped"]["query_slots"]
    assert (out / "budget_vs_shipped.png").is_file()
    speed = report["export"]["speed"]  # measured in the run: the export against the original, alternating rounds
    assert speed == meta["speed"] and speed["rounds"] == 5 and speed["prefill_speedup"] > 0
    assert speed["prefill_tokens_per_s"]["shipped"] > 0 and speed["decode_tokens_per_s"]["original"] > 0
    assert speed["flops_predicted_prefill_speedup"] > 1 and speed["weight_bytes"]["shipped"] < speed["weight_bytes"]["original"]
    assert speed["kv_cache_bytes"]["shipped"] < speed["kv_cache_bytes"]["original"]  # whole groups left the cache
    assert "prefill tokens/s" in (out / "README.md").read_text()


def test_confident_decision_is_recorded_and_never_chooses_more_than_the_point_rule(model_dir, tmp_path, capsys):
    _, confident = _run(model_dir, tmp_path / "c", capsys, "--decision", "confident", "--budget", "2pt", "--no-export")
    _, point = _run(model_dir, tmp_path / "p", capsys, "--budget", "2pt", "--no-export")
    assert confident["budget"]["decision"] == "confident" and point["budget"]["decision"] == "point"
    assert all(p["ci95_points"][0] >= -2 for p in confident["search_points"] if p["within_budget"])
    assert confident["final"]["num_heads_removed"] <= point["final"]["num_heads_removed"]


def test_kv_cache_objective_removes_whole_groups(model_dir, tmp_path, capsys):
    _, report = _run(model_dir, tmp_path, capsys, "--objective", "kv-cache")
    final = report["final"]
    assert final["shipped"]["kv_cache_removed"] > 0 and final["shipped"]["deployment_efficiency"] == 1.0


def test_uniform_search_ships_a_stock_config_equal_to_the_verified_ablation(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from prune_heads.plan.ablation import ablate

    out, report = _run(model_dir, tmp_path, capsys, "--layout", "uniform")
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and "per_layer_heads" not in config and not (out / "modeling_pruned.py").exists()
    assert config["num_attention_heads"] < 6  # fewer heads than the original in every layer
    heads = HeadSet.of({int(k): v for k, v in report["heads"].items()})
    assert len(heads.layers()) == 4  # the same units in every layer
    lm = tiny_model("llama")
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    lm.model = reference
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, lm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ablate(lm, heads):
        expected = reference(input_ids=ids).logits
    with torch.no_grad():
        got = exported(input_ids=ids).logits
    assert torch.allclose(expected, got, atol=1e-4)


@pytest.mark.parametrize("args,expect", [
    (["--units", "gqa", "--gqa", "balanced"], "--gqa balanced"),
    (["--units", "heads", "--objective", "kv-cache"], "--objective kv-cache"),
    (["--objective", "speed"], "--objective"),
    (["--units", "layers"], "--units"),
    (["--decision", "sure"], "--decision"),
])
def test_bad_unit_and_objective_flags(model_dir, tmp_path, capsys, args, expect):
    code, _, err = run_cli(["--model", model_dir, "--out", tmp_path / "x", *args], capsys)
    assert code == 2 and expect in err and len(err.strip().splitlines()) == 1


def test_masked_layout_ships_nothing():
    lm = tiny_model("llama")
    planner = _planner(lm)
    heads = HeadSet.of({0: [0, 3]})
    s = planner.savings(heads, "masked")
    assert s["attention_params_removed"] == 0 and s["deployment_efficiency"] == 0.0
    assert plan_masked(heads, planner.geometries).kind == "masked"
