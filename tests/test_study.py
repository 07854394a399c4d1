"""Study mode: thresholds, interpolation and AUC by hand, dynamic masks against a naive loop, the ranking, and the
CLI end to end with an interruption and a resumed, larger study; compare's correlation of function rankings."""
import json

import pytest
import torch
from helpers import cais_file
from tiny import run_cli, save_tiny

from prune_heads.data.tasks import Question
from prune_heads.errors import UserError
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.results import EvalResult
from prune_heads.heads import ScoreTable
from prune_heads.report.study import StudyPlan, max_within, normalised_auc, study_curves, thresholds


@pytest.mark.parametrize("direction", ["low", "high"])
def test_thresholds_select_the_requested_percentages(direction):
    scores = torch.randperm(2000).double().view(10, 20, 10) / 7.0  # distinct values, 2000 pooled
    for p, thr in thresholds(scores, direction, [0, 5, 10, 12.5, 30, 100]).items():
        selected = (scores <= thr) if direction == "low" else (scores >= thr)
        assert int(selected.sum()) == round(p / 100 * 2000)
    low = thresholds(scores, "low", [10])[10]
    high = thresholds(scores, "high", [10])[10]
    assert low == pytest.approx(199 / 7.0) and high == pytest.approx(1800 / 7.0)  # the dormant end differs


def test_interpolated_max_within_budget_and_auc_by_hand():
    xs, ys = [0, 5, 10, 20, 30], [50.0, 50.0, 48.0, 49.5, 40.0]
    # target 49: crosses below between 5 and 10 (at 7.5), back above at 20, last crossing between 20 and 30:
    # 20 + (49.5 - 49) / (49.5 - 40) * 10 = 20.526...
    assert max_within(xs, ys, 49.0) == pytest.approx(20 + 0.5 / 9.5 * 10)
    assert max_within(xs, ys, 30.0) == 30  # never below: the whole range
    assert max_within([0, 10], [40.0, 30.0], 45.0) == 0.0  # below from the start
    area = (5 * 100 + 5 * 98 + 10 * 97.5 + 10 * 89.5) / 2
    assert normalised_auc(xs, ys) == pytest.approx(area / 30)


N, L, H = 12, 3, 4


def fake_table(seed):
    g = torch.Generator().manual_seed(seed)
    keys = ["ahon", "awft", "ahon_ln"]
    return ScoreTable({k: torch.rand(N, L, H, generator=g, dtype=torch.float64) for k in keys}, [10] * N)


QS = [Question("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(N)]


def result_from_mask(mask):
    """A synthetic model: accuracy falls with the number of heads of layer 0 zeroed (the important layer)."""
    m = mask if mask.dim() == 3 else mask.expand(N, L, H)
    ll = torch.zeros(N, 4, dtype=torch.float64)
    wrong = (m[:, 0] == 0).sum(-1) >= 2  # an input with 2+ heads of layer 0 zeroed answers wrong
    ll[wrong, 1] = 1.0
    ll[~wrong, 0] = 1.0
    return EvalResult(QS, ll)


def test_study_curves_dynamic_masks_equal_a_naive_loop_and_the_ranking_follows_the_curves():
    table, calls = fake_table(0), []

    class Evaluator:
        baseline = result_from_mask(torch.ones(L, H))

        inputs, unit, measure = N, "questions", "accuracy"

        def evaluate(self, mask, label):
            calls.append((label, mask.clone()))
            return result_from_mask(mask)

        def measures(self, result):
            return {"agreement": float((result.pred == self.baseline.pred).double().mean())}

    plan = StudyPlan(["ahon", "awft"], (0, 25, 50), ("dynamic", "static", "random"), budget_points=10.0)
    study = study_curves(Evaluator(), table, table, plan)
    dyn = [(label, m) for label, m in calls if "dynamic" in label]
    assert len(dyn) == 4 and all(m.shape == (N, L, H) for _, m in dyn)
    for label, mask in dyn:
        function, _, p = label.split()
        direction = "high" if function == "awft" else "low"
        thr = thresholds(table.per_input[function], direction, [float(p.rstrip("%"))])[float(p.rstrip("%"))]
        for i in range(N):
            for layer in range(L):
                for h in range(H):
                    s = float(table.per_input[function][i, layer, h])
                    dormant = s <= thr if direction == "low" else s >= thr
                    assert mask[i, layer, h] == (0.0 if dormant else 1.0)
    static = [m for label, m in calls if "static" in label]
    assert all(m.shape == (L, H) for m in static) and [int((m == 0).sum()) for m in static] == [3, 6, 3, 6]
    rows = {(r["function"], r["mode"]): r for r in study["curves"]}
    assert set(study["ranking"]) == {"dynamic", "static", "random"}
    assert study["best"]["dynamic"] == study["ranking"]["dynamic"][0]
    for mode in ("dynamic", "static"):
        ordered = [rows[(f, mode)] for f in study["ranking"][mode]]
        keys = [(r["max_percent_within_budget"], r["auc"]) for r in ordered]
        assert keys == sorted(keys, reverse=True) and [r["rank"] for r in ordered] == [1, 2]
    # The dynamic % zeroed is the mean over inputs of the mask's zeros.
    pt = [p for p in rows[("ahon", "dynamic")]["points"] if p["percent"] == 25][0]
    assert pt["zeroed_percent"] == pytest.approx(25.0, abs=100 / (N * L * H))


def test_study_curves_refuses_unknown_functions_and_modes():
    t = fake_table(1)
    with pytest.raises(UserError, match="unknown score function"):
        study_curves(None, t, t, StudyPlan(["nope"], (0, 5), ("dynamic",), 1.0))
    with pytest.raises(UserError, match="unknown study mode"):
        study_curves(None, t, t, StudyPlan(["ahon"], (0, 5), ("sideways",), 1.0))


# --- CLI end to end ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_mistral"), "mistral")



@pytest.mark.slow
def test_study_cli_interrupted_resumed_and_extended(model_dir, tmp_path, capsys, monkeypatch):
    import prune_heads.eval.cached_steps as work

    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=9)
    out = tmp_path / "study"
    args = ["study", "--model", model_dir, "--mmlu", mmlu, "--out", out, "--no-progress", "--percents", "0,10,30",
            "--budget", "5%", "--calibration-size", "4"]
    real, calls = work.task_loglik, []

    def interrupting(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(work, "task_loglik", interrupting)
    code, _, err = run_cli(args + ["--functions", "ahon,awft"], capsys)
    assert code == 130 and "rerun the same command to resume" in err and not out.exists()
    monkeypatch.setattr(work, "task_loglik", real)
    code, _, err = run_cli(args + ["--functions", "ahon,awft"], capsys)
    assert code == 0, err
    study = json.loads((out / "study.json").read_text())
    # baseline + 2 functions x (2 dynamic + 2 static) + 2 random = 11 evaluations; 5 finished before the interrupt
    assert study["cache"]["loaded"] >= 5 + 1 and study["cache"]["computed"] == 11 - 5 + 0
    assert study["ranking"]["dynamic"] and set(study["best"]) == {"dynamic", "static"}
    assert (out / "study.md").read_text().startswith("# Score functions on")
    for png in ("study_curves.png", "study_ranking.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A larger study of the same model reuses every finished point.
    code, _, err = run_cli(args + ["--functions", "ahon,awft,ahon_ln", "--resume"], capsys)
    assert code == 0, err
    bigger = json.loads((out / "study.json").read_text())
    assert bigger["cache"]["computed"] == 4  # only ahon_ln's dynamic and static points
    assert len(bigger["ranking"]["dynamic"]) == 3

    # compare: the same model and its own study twice -> identical rankings (Spearman 1), zero distances.
    code, _, err = run_cli(["compare", model_dir, model_dir, "--mmlu", mmlu, "--out", tmp_path / "cmp", "--no-progress",
                            "--calibration-size", "3", "--study-a", out, "--study-b", out / "study.json"], capsys)
    assert code == 0, err
    cmp = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert cmp["study_rankings"]["dynamic"]["spearman"] == 1.0 and cmp["study_rankings"]["static"]["functions"] == 3
    assert all(r["ks"] == 0 for r in cmp["functions"].values())
    code, _, err = run_cli(["compare", model_dir, model_dir, "--out", tmp_path / "c2", "--study-a", out], capsys)
    assert code == 2 and "--study-a and --study-b go together" in err


def test_study_ranking_correlation_by_hand():
    from prune_heads.report.compare import study_ranking_correlation

    a = {"ranking": {"dynamic": ["x", "y", "z", "w"], "random": ["random"]}}
    b = {"ranking": {"dynamic": ["y", "x", "z", "v"]}}
    r = study_ranking_correlation(a, b)["dynamic"]
    # common x, y, z with ranks (0, 1, 2) and (1, 0, 2): rho = 1 - 6 * 2 / (3 * 8) = 0.5
    assert r["functions"] == 3 and r["spearman"] == pytest.approx(0.5)


def test_study_on_another_task(model_dir, tmp_path, capsys):
    from helpers import write_rows

    out = tmp_path / "piqa-study"
    code, _, err = run_cli(["study", "--model", model_dir, "--task", "piqa", "--task-data", write_rows(tmp_path, "piqa"),
                            "--functions", "ahon_ln,awft", "--percents", "0,25,50", "--modes", "dynamic,random",
                            "--out", out, "--no-progress"], capsys)
    assert code == 0, err
    study = json.loads((out / "study.json").read_text())
    assert study["task"] == "piqa" and study["inputs"] == 2 and set(study["ranking"]) == {"dynamic", "random"}
    assert study["baseline"]["chance"] == 0.5
    assert "piqa, 2 questions" in (out / "study.md").read_text()


def _curve(function: str, correct_by_zeroed: dict[float, torch.Tensor]):
    from prune_heads.report.study import Curve, StudyPoint

    points = [StudyPoint(function, "static", x, None, x, float(c.mean()), {}, {}, c.double())
              for x, c in correct_by_zeroed.items()]
    return (function, "static"), Curve(function, "static", points)


def test_bootstrap_interval_equals_a_naive_resample_and_says_which_functions_tie():
    from prune_heads.report.study import bootstrap_max_within, markdown, summarise

    g = torch.Generator().manual_seed(0)
    n = 600
    base = (torch.rand(n, generator=g) < 0.6).double()

    def worse(share):  # the baseline with ``share`` of its right answers turned wrong
        return base * (torch.rand(n, generator=g) >= share).double()

    strong = {0.0: base, 10.0: worse(0.0), 20.0: worse(0.01), 30.0: worse(0.3)}
    twin = {k: v.clone() for k, v in strong.items()}
    weak = {0.0: base, 10.0: worse(0.3), 20.0: worse(0.5), 30.0: worse(0.6)}
    curves = dict([_curve("ahon", strong), _curve("ahon_ln", twin), _curve("awft", weak)])
    boot = bootstrap_max_within(curves, base, 2.0, resamples=200, seed=3)
    # Resample 0 by hand: the same draws, the curve re-measured on them, then max_within.
    draws = torch.randint(n, (200, n), generator=torch.Generator().manual_seed(3))[0]
    xs = [0.0, 10.0, 20.0, 30.0]
    ys = [100 * float(strong[x][draws].mean()) for x in xs]
    assert float(boot[("ahon", "static")][0]) == pytest.approx(max_within(xs, ys, 100 * float(base[draws].mean()) - 2))

    study = summarise(curves, float(base.mean()), 2.0, n, base, seed=3)
    rows = {r["function"]: r for r in study["curves"]}
    lo, hi = rows["ahon"]["max_percent_ci"]
    assert lo <= rows["ahon"]["max_percent_within_budget"] <= hi and hi > lo
    assert rows["ahon"]["indistinguishable_from"] == ["ahon_ln"] and rows["awft"]["indistinguishable_from"] == []
    table = markdown(study, "m", "mmlu")
    assert "(~ 2)" in table and "bootstrap over questions" in table


# --- a long-context probe as the study's task ---------------------------------------------------------------------


def test_a_probe_read_with_one_mask_per_prompt_equals_each_prompt_read_alone_with_its_own():
    from tiny import tiny_model

    from prune_heads.data.probes import ProbeSet, copy_probe, passkey_probe
    from prune_heads.eval.probes import METRIC_FIELDS, probe_pass

    lm = tiny_model("llama")
    geo = lm.arch.geometries(lm.model)
    layers, heads = len(geo), geo[0].num_heads
    for probe in (passkey_probe(lm, (256,), 3, seed=1), copy_probe(lm, (128,), 3, seed=1)):
        masks = (torch.rand(len(probe.items), layers, heads, generator=torch.Generator().manual_seed(2)) > 0.4).float()
        together = probe_pass(lm, probe, masks)
        for i, item in enumerate(probe.items):
            alone = probe_pass(lm, ProbeSet(probe.name, (item,), probe.metric), masks[i])
            for f in METRIC_FIELDS:
                assert getattr(together, f)[i] == getattr(alone, f)[0], (probe.name, i, f)
        assert not torch.equal(together.nll, probe_pass(lm, probe, None).nll)  # the masks did zero something


def test_study_on_a_probe_judges_each_point_by_the_probe_read_under_its_masks(model_dir, tmp_path, capsys):
    from tiny import tiny_model

    from prune_heads.data.probes import copy_probe
    from prune_heads.eval.probes import probe_pass
    from prune_heads.plan.ablation import dynamic_masks

    out = tmp_path / "copy-study"
    code, _, err = run_cli(["study", "--model", model_dir, "--probe", "copy", "--probe-max-length", "128",
                            "--probe-prompts", "3", "--functions", "ahon,awft", "--percents", "0,20,40", "--modes",
                            "dynamic,static,random", "--dtype", "float32", "--out", out, "--no-progress"], capsys)
    assert code == 0, err
    study = json.loads((out / "study.json").read_text())
    assert study["task"] == "probe:copy" and study["inputs"] == 3 and study["unit"] == "prompts"
    assert study["measure"] == "repeated tokens predicted" and study["baseline"]["prompts"] == {"128": 3}
    assert study["calibration"] == "the probe's 3 prompts (without their targets)"
    assert study["settings"]["guard"] == ["copy"] and set(study["ranking"]) == {"dynamic", "static", "random"}
    # A random model copies nothing: the study says it cannot tell functions apart, on the terminal and in the file.
    assert "cannot tell the score functions apart" in err and len(study["warnings"]) == 1
    assert "--probe-max-length" in study["warnings"][0]
    md = (out / "study.md").read_text()
    assert "the copy probe, 3 prompts; unablated repeated tokens predicted" in md and "bootstrap over prompts" in md
    # Every dynamic point equals the probe read prompt by prompt under the masks its own scores give.
    lm = tiny_model("mistral")
    probe = copy_probe(lm, (128,), 3, seed=0)
    per_input = Work(lm, None, progress=False).scores([list(it.ids[:-it.target]) for it in probe.items])
    curve = next(r for r in study["curves"] if r["function"] == "ahon" and r["mode"] == "dynamic")
    for point in curve["points"][1:]:
        masks = dynamic_masks(per_input.per_input["ahon"], point["threshold"], "low")
        ref = probe_pass(lm, probe, masks)
        assert point["accuracy"] == pytest.approx(float(ref.token_accuracy.mean()), abs=1e-6)
        assert point["nll_nats"] == pytest.approx(float(ref.nll.mean()), abs=1e-5)
        assert point["accuracy_by_length"] == {"128": pytest.approx(float(ref.token_accuracy.mean()), abs=1e-6)}


@pytest.mark.parametrize("flags, expect", [
    (["--probe-prompts", "4"], "go with --probe; add --probe passkey, copy or text"),
    (["--probe", "text"], "probe text reads your own long documents; pass them with --guard-texts FILE"),
    (["--probe", "passkey", "--guard-texts", "README.md"], "feeds the probe text, not passkey; pass --probe text"),
    (["--probe", "keys"], "Invalid value for '--probe'"),
    (["--probe", "copy", "--probe-prompts", "1"], "Invalid value for '--probe-prompts'"),
])
def test_bad_probe_flags_of_a_study_are_one_line_errors(model_dir, tmp_path, capsys, flags, expect):
    code, _, err = run_cli(["study", "--model", model_dir, "--out", tmp_path / "s", *flags], capsys)
    assert code == 2 and expect in err and not (tmp_path / "s").exists()
