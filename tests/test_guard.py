"""The long-context guard: probes built from the tokenizer (data/probes.py), read with heads ablated (eval/probes.py),
judged paired per prompt (search/guard.py) and walked by confirmation (search/confirmation.py), through the main
command on tiny models, and on the embedded model where zeroing its retrieval heads must be refused."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import cais_file
from tiny import run_cli, save_tiny, tiny_model

from prune_heads.data.probes import FILLER, ProbeItem, ProbeSet, copy_probe, passkey_probe, probe_lengths, text_probe
from prune_heads.errors import UserError
from prune_heads.eval.probes import METRIC_FIELDS, ProbeResult
from prune_heads.search.guard import compare, parse_tolerance


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("guard"), "llama")


# -- the probes -----------------------------------------------------------------------------------------------------


def test_passkey_prompts_fill_their_length_hide_the_key_at_spread_depths_and_read_back(lm):
    probe = passkey_probe(lm, (400, 1024), 4, seed=3)
    assert probe.lengths == (400, 1024) and probe.metric == "match" and len(probe.items) == 8
    filler = len(lm.tokenizer(FILLER, add_special_tokens=False).input_ids)
    for n in (400, 1024):
        items = [it for it in probe.items if it.length == n]
        assert all(n - 2 * filler <= len(it.ids) <= n for it in items)  # filled to within one filler sentence
        depths = [it.depth for it in items]
        assert depths == sorted(set(depths)) and depths[-1] - depths[0] > 0.4  # after the intro, spread over the rest
        for it in items:
            key = lm.tokenizer.decode(list(it.ids[-it.target:])).strip()
            assert len(key) == 5 and key.isdigit()
            text = lm.tokenizer.decode(list(it.ids))
            assert f"The pass key is {key}." in text and text.endswith(f"The pass key is {key}")
            start, end = it.needle
            assert list(it.ids[start:end]) == list(it.ids[-it.target:])  # the key inside the needle, as read back
    assert len({lm.tokenizer.decode(list(it.ids[-it.target:])) for it in probe.items}) == 8  # a fresh key each
    again = passkey_probe(lm, (400, 1024), 4, seed=3)
    assert again == probe and passkey_probe(lm, (400, 1024), 4, seed=4) != probe


def test_a_passkey_length_shorter_than_the_prompt_is_refused(lm):
    with pytest.raises(UserError, match="shorter than the pass-key prompt"):
        passkey_probe(lm, (64,), 1, seed=0)


def test_copy_prompts_repeat_a_random_sequence_and_score_the_repeat(lm):
    probe = copy_probe(lm, (128, 300), 2, seed=1)
    assert probe.metric == "token_accuracy" and [it.length for it in probe.items] == [128, 128, 300, 300]
    special = set(lm.tokenizer.all_special_ids)
    for it in probe.items:
        start = len(it.ids) % 2  # the BOS this tokenizer adds, if any
        half = (len(it.ids) - start) // 2
        first, second = it.ids[start:start + half], it.ids[start + half:]
        assert first == second and len(it.ids) <= it.length and it.target == half - 1
        assert list(it.ids[-it.target:]) == list(first[1:]) and not special & set(first)


def test_text_probe_cuts_documents_to_the_longest_length_they_fill_and_scores_the_last_quarter(lm):
    long_doc = " ".join(f"word{i}" for i in range(400))
    probe = text_probe(lm, [long_doc, "too short", long_doc], (64, 128), 1, "file docs.txt")
    assert [it.length for it in probe.items] == [64, 128] and probe.metric == "kl"
    assert [len(it.ids) for it in probe.items] == [64, 128] and [it.target for it in probe.items] == [16, 32]
    with pytest.raises(UserError, match="no text in file docs.txt is at least 64 tokens long"):
        text_probe(lm, ["too short"], (64, 128), 4, "file docs.txt")


@pytest.mark.parametrize("lengths, context, cap, expect", [
    ((512, 2048), 4096, None, (512, 2048)),
    ((512, 2048), 512, None, (512,)),
    ((512, 2048), 8192, 1000, (512,)),
    ((512, 2048), 300, None, (300,)),  # none fits: the context itself
])
def test_probe_lengths_fit_the_context_and_the_cap(lengths, context, cap, expect):
    assert probe_lengths(lengths, context, cap) == expect


def test_probe_lengths_below_64_tokens_are_refused():
    with pytest.raises(UserError, match="probe_max_length"):
        probe_lengths((512,), 4096, 32)


# -- the paired statistics ------------------------------------------------------------------------------------------


def _result(probe: ProbeSet, **values) -> ProbeResult:
    n = len(probe.items)
    zeros = torch.zeros(n, dtype=torch.float64)
    got = {f: torch.tensor(values[f], dtype=torch.float64) if f in values else zeros for f in METRIC_FIELDS}
    return ProbeResult(probe, **got)


def _probe(metric: str) -> ProbeSet:
    items = tuple(ProbeItem((1, 2, 3), 1, n) for n in (256, 256, 256, 256, 1024, 1024))
    return ProbeSet("copy" if metric != "kl" else "text", items, metric)


def test_each_length_is_judged_on_the_paired_change_with_its_interval():
    probe = _probe("match")
    original = _result(probe, match=[1, 1, 1, 1, 0, 0])
    pruned = _result(probe, match=[1, 0, 1, 1, 1, 1])
    rows = compare(original, pruned, tolerance=30.0, rule="point")
    short, long = rows
    assert (short.length, short.prompts, short.original, short.pruned) == (256, 4, 1.0, 0.75)
    # the per-prompt losses are 0, 100, 0, 0 points: mean 25, standard deviation 50, standard error 25
    assert short.change == pytest.approx(25.0) and short.ci_low == pytest.approx(25 - 1.96 * 25)
    assert short.ci_high == pytest.approx(25 + 1.96 * 25) and short.ok  # the mean is within 30 pt
    assert long.change == pytest.approx(-100.0) and long.ok  # a gain is never a loss
    confident = compare(original, pruned, tolerance=20.0, rule="confident")
    assert confident[0].ok and confident[1].ok  # 25 pt lost, but [-24, +74] does not say it is beyond 20
    assert not compare(original, pruned, tolerance=20.0, rule="point")[0].ok  # the mean alone is
    sure = _result(probe, match=[0, 0, 0, 0, 0, 0])
    assert not compare(original, sure, tolerance=20.0, rule="confident")[0].ok  # every key lost: [100, 100]
    assert not compare(original, pruned, tolerance=5.0, rule="point")[0].ok
    assert "copy at 256 tokens: 100.0% -> 75.0%, +25 pt" in short.describe()


def test_text_probes_are_judged_by_their_kl_in_nats():
    probe = _probe("kl")
    base = _result(probe)
    pruned = _result(probe, kl=[0.01, 0.03, 0.02, 0.02, 0.2, 0.2])
    short, long = compare(base, pruned, tolerance=0.05, rule="point")
    assert short.unit == "nat" and short.change == pytest.approx(0.02) and short.ok
    assert long.change == pytest.approx(0.2) and not long.ok and long.pruned == pytest.approx(0.2)


@pytest.mark.parametrize("name, text, value", [("passkey", "5pt", 5.0), ("copy", "2.5%", 2.5), ("copy", 10, 10.0),
                                               ("text", "0.05nat", 0.05), ("text", "0.1 nats", 0.1)])
def test_tolerances_read_as_the_recipe_writes_them(name, text, value):
    assert parse_tolerance(name, text) == value


@pytest.mark.parametrize("name, text", [("passkey", "lots"), ("copy", "-1pt"), ("passkey", "120%"), ("text", "nan")])
def test_a_tolerance_that_is_not_one_is_refused(name, text):
    with pytest.raises(UserError, match="is not a tolerance"):
        parse_tolerance(name, text)


# -- through the main command ---------------------------------------------------------------------------------------


def _run(model_dir, tmp_path, capsys, *extra, code=0):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=14)
    got, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", out, "--calibration-size", "4",
                           "--dtype", "float32", "--no-progress", "--no-speed", "--mmlu-per-subject", "3", "--budget", "100%",
                           *extra], capsys)
    assert got == code, err
    return (json.loads((out / "report.json").read_text()) if code == 0 else None), err


def _failing_first(monkeypatch, failures: int | None):
    """The guard's comparison with the first ``failures`` checks refused (None: every check)."""
    import prune_heads.search.guard as guard

    real, checks = guard.compare, []

    def compare(original, pruned, tolerance, rule, *measure):
        rows = real(original, pruned, tolerance, rule, *measure)
        if original.probe.name == "copy":  # the cheapest probe: read first in every check
            checks.append(1)
        refuse = failures is None or len(checks) <= failures
        return [r.__class__(**{**r.__dict__, "ok": r.ok and not refuse}) for r in rows]

    monkeypatch.setattr(guard, "compare", compare)


@pytest.mark.slow
def test_the_guard_refuses_a_point_and_confirmation_steps_back(model_dir, tmp_path, capsys, monkeypatch):
    _failing_first(monkeypatch, 1)
    report, err = _run(model_dir, tmp_path, capsys)
    g = report["guard"]
    assert g["enabled"] and [p["within_tolerance"] for p in g["judged"]] == [False, True]
    assert g["judged"][1]["num_heads"] < g["judged"][0]["num_heads"] and "reason" in g["judged"][0]
    assert report["final"]["num_heads_removed"] == g["judged"][1]["num_heads"] == g["chosen"]["num_heads"]
    # The guard reads a point before its confirmation: the refused point spent no confirmation question.
    assert [p["num_heads"] for p in report["confirmation"]["tried"]] == [g["judged"][1]["num_heads"]]
    assert err.index("refused: copy at 512 tokens") < err.index("confirmation of")
    refused = [p for p in report["search_points"] if p.get("refused")]  # what the plots draw as refused, with the reason
    assert [(p["num_heads"], p["refused"]["by"]) for p in refused] == [(g["judged"][0]["num_heads"], "guard")]
    assert "copy at 512 tokens" in refused[0]["refused"]["reason"]
    assert set(g["chosen"]["per_length"]) == {"passkey", "copy"}
    assert list(g["chosen"]["per_length"]["passkey"]) == ["512"]  # the tiny model's context caps 2048
    sized = g["sizing"]["prompts"]  # sizing auto: the prompts that resolve each tolerance
    assert set(g["original"]) == {"passkey", "copy"} and g["probes"][0]["prompts"] == {"512": sized["passkey"]}
    assert "long-context guard" in err and "refused: copy at 512 tokens" in err
    assert [r["probe"] for r in g["judged"][0]["probes"]] == ["copy"]  # a refused point stops at its first failure
    meta = json.loads((tmp_path / "run" / "prune_heads.json").read_text())
    assert meta["long_context"]["chosen"] == g["chosen"]
    card = (tmp_path / "run" / "README.md").read_text()
    assert "## Long context" in card and f"| passkey | 512 | {sized['passkey']} |" in card
    assert f"| copy | 512 | {sized['copy']} |" in card


def test_below_the_search_the_guard_steps_back_along_the_ranking(model_dir, tmp_path, capsys, monkeypatch):
    """The guard refuses every point of more than 3 heads: the search's points all have more, so the walk goes on to
    shorter prefixes of the same ranking, each evaluated on the search's questions first."""
    import prune_heads.search.guard as guard

    real = guard.Guard.check

    def at_most_three(self, target, label):
        verdict = real(self, target, label)
        if int(label.split()[0]) <= 3:
            return verdict
        return guard.GuardVerdict(tuple(r.__class__(**{**r.__dict__, "ok": False}) for r in verdict.rows))

    monkeypatch.setattr(guard.Guard, "check", at_most_three)
    recipe = tmp_path / "grid.yaml"
    recipe.write_text("search: {grid: [0.5, 0.75], patience: 1, refine_steps: 0}\n")
    report, _ = _run(model_dir, tmp_path, capsys, "--recipe", recipe, "--no-export")
    searched = [p for p in report["search_points"] if p["phase"] == "grid"]
    stepped = [p for p in report["search_points"] if p["phase"] == "step-back"]
    assert searched and min(p["num_heads"] for p in searched) > 3
    units = sorted((p["units"] for p in stepped), reverse=True)  # one unit fewer than the search's smallest, then halving
    assert units[0] == min(p["units"] for p in searched) - 1 and units[1:] == [u // 2 for u in units[:-1]]
    assert report["final"]["num_heads_removed"] == report["guard"]["chosen"]["num_heads"] <= 3
    assert report["final"]["num_heads_removed"] in [p["num_heads"] for p in stepped]
    assert report["confirmation"]["confirmed"] is True


def test_nothing_within_the_guard_removes_nothing(model_dir, tmp_path, capsys, monkeypatch):
    _failing_first(monkeypatch, None)
    report, err = _run(model_dir, tmp_path, capsys)
    assert report["final"]["num_heads_removed"] == 0 and "chosen" not in report["guard"]
    assert [p["units"] for p in report["search_points"] if p["phase"] == "step-back"] == []  # the search started at 1 unit
    assert report["guard"]["judged"] and not any(p["within_tolerance"] for p in report["guard"]["judged"])
    assert "keeps the long-context probes within tolerance: no heads are removed" in err
    card = (tmp_path / "run" / "README.md").read_text()
    assert "Nothing was removed" in card


def test_no_guard_is_said_in_the_report_and_the_card(model_dir, tmp_path, capsys):
    report, err = _run(model_dir, tmp_path, capsys, "--no-guard")
    assert report["guard"] == {"enabled": False} and "long-context" not in err
    assert "guard was off (`--no-guard`)" in (tmp_path / "run" / "README.md").read_text()


def test_own_texts_join_the_guard_and_probes_join_the_calibration(model_dir, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": " ".join(f"w{i}x{j}" for j in range(300))}) for i in range(3)))
    report, _ = _run(model_dir, tmp_path, capsys, "--guard-texts", docs, "--guard", "copy", "--calibrate-probes",
                     "--probe-max-length", "256", "--no-export")
    g = report["guard"]
    assert [p["name"] for p in g["probes"]] == ["copy", "text"] and g["tolerance"] == {"copy": 5.0, "text": 0.05}
    assert g["probes"][1]["prompts"] == {"256": 3} and g["probes"][0]["lengths"] == [256]
    assert "passkey probe prompts" in report["calibration"]["source"]


@pytest.mark.parametrize("flags, expect", [
    (["--guard", "needle"], "--guard needle is not a long-context probe"),
    (["--guard", "copy", "--no-guard"], "--guard and --no-guard contradict"),
    (["--guard", "text"], "pass them with --guard-texts FILE"),
    (["--guard-texts", "DOCS", "--no-guard"], "--guard-texts feeds the long-context guard, which is off"),
    (["--guard-texts", "missing.jsonl"], "guard text file missing.jsonl does not exist"),
    (["--probe-max-length", "10"], "--probe-max-length"),
    (["--recipe", "RECIPE"], "is not a tolerance"),
])
def test_bad_guard_flags_are_one_line_errors(model_dir, tmp_path, capsys, flags, expect):
    docs = tmp_path / "docs.txt"
    docs.write_text("a long document\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("guard:\n  tolerance: {passkey: lots}\n")
    flags = [str(docs) if f == "DOCS" else str(recipe) if f == "RECIPE" else f for f in flags]
    _, err = _run(model_dir, tmp_path, capsys, *flags, code=2)
    assert expect in err and len(err.strip().splitlines()) == 1, err


# -- the embedded model ---------------------------------------------------------------------------------------------


@pytest.mark.embedded
@pytest.mark.slow
def test_zeroing_the_heads_the_probes_find_retrieving_is_refused_on_the_embedded_model():
    """SmolLM2-135M retrieves a key from 256 tokens of filler; the 13 heads that attend most from the question to the
    key (on other prompts) carry it: zeroed, retrieval collapses and the guard refuses them."""
    from prune_heads.eval.cached_steps import Work
    from prune_heads.heads import HeadSet
    from prune_heads.models.loading import load_model
    from prune_heads.scoring.retrieval import retrieval_scores
    from prune_heads.search.guard import Guard, GuardSetup

    lm = load_model("smollm2-135m", "float32", "cpu")
    scores = retrieval_scores(lm, passkey_probe(lm, (256,), 8, seed=1))
    top = torch.topk(scores.flatten(), 13).indices.tolist()
    heads = HeadSet.from_pairs([(i // scores.shape[1], i % scores.shape[1]) for i in top])
    guard = Guard.measured(Work(lm, None, progress=False), GuardSetup((passkey_probe(lm, (256,), 8, seed=0),),
                                                                      (("passkey", 5.0),)))
    assert guard.baselines[0].match.mean() >= 0.75  # the original retrieves
    verdict = guard.check(heads, "13 retrieval heads")
    assert not verdict.ok and verdict.rows[0].pruned <= 0.25 and "passkey at 256 tokens" in verdict.reason
    assert guard.check(HeadSet(), "no heads").ok


def test_eval_runs_the_probes_unablated_and_ablated(model_dir, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 1], "1": [3]}))
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=8)
    out = tmp_path / "eval"
    code, _, err = run_cli(["eval", "--model", model_dir, "--mmlu", mmlu, "--out", out, "--dtype", "float32",
                            "--no-progress", "--ablate", heads, "--probes", "passkey,copy", "--probe-max-length",
                            "256"], capsys)
    assert code == 0, err
    probes = json.loads((out / "probes.json").read_text())
    assert set(probes) == {"passkey", "copy"} and json.loads((out / "summary.json").read_text())["probes"] == probes
    for name, prompts in (("passkey", 4), ("copy", 2)):
        p = probes[name]
        assert p["lengths"] == [256] and p["original"]["256"]["prompts"] == prompts
        assert set(p["ablated"]["256"]) >= {"nll", "token_accuracy", "match"} and p["change"][0]["length"] == 256
    assert "passkey unablated: keys retrieved" in err
    code, _, err = run_cli(["eval", "--model", model_dir, "--mmlu", mmlu, "--out", tmp_path / "e2",
                            "--guard-texts", heads], capsys)
    assert code == 2 and "add --probes text" in err


# -- resolution and sizing (search/guard_sizing.py) -----------------------------------------------------------------


def test_a_binary_probe_resolves_no_finer_than_its_edge_allows():
    """Losing 5 points of pass-key matches needs 5% of the keys to flip: sd >= 100 sqrt(0.05 x 0.95) = 21.8 pt, so
    4 prompts resolve +/-21.4 pt and 73 are needed for +/-5, whatever a pilot that moved nothing showed."""
    from prune_heads.search.guard_sizing import edge_sd, resolutions

    probe = _probe("match")
    base = _result(probe, match=[1, 1, 1, 1, 1, 1])
    assert edge_sd(base.at_length(256), base.at_length(256), 5.0) == pytest.approx(100 * (0.05 * 0.95) ** 0.5)
    rows = resolutions((base,), (base,), {"copy": 5.0})
    short = rows[0]
    assert (short.length, short.prompts) == (256, 4) and not short.resolves
    assert short.half_width() == pytest.approx(1.96 * 21.794 / 2, rel=1e-3)
    assert short.prompts_for(5.0) == 73 and short.at(73).resolves and not short.at(72).resolves
    assert short.to_json()["prompts_to_resolve"] == 73 and "4 prompts resolve +/-21.4 pt" in short.describe()


def test_a_share_per_prompt_resolves_no_finer_than_a_concentrated_loss_allows():
    """Copy prompts score a share of their repeat: a 5-point loss concentrated in the prompts that lose everything
    (a = 0.9: 5.6% of them) gives sd 90 sqrt(0.056 x 0.944) = 20.6 pt, above what a pilot's few prompts showed."""
    from prune_heads.search.guard_sizing import edge_sd

    probe = _probe("token_accuracy")
    base = _result(probe, token_accuracy=[0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    pilot = _result(probe, token_accuracy=[0.7, 0.8, 0.5, 0.6, 0.9, 0.9])  # lost 20, 10, 40, 30 points: sd 12.9
    b = 5 / 90
    assert edge_sd(base.at_length(256), pilot.at_length(256), 5.0) == pytest.approx(90 * (b * (1 - b)) ** 0.5)
    wild = _result(probe, token_accuracy=[0.0, 0.9, 0.0, 0.9, 0.9, 0.9])  # lost 90, 0, 90, 0: sd 52
    assert edge_sd(base.at_length(256), wild.at_length(256), 5.0) == pytest.approx(51.96, rel=1e-3)
    text = _probe("kl")
    kls = _result(text, kl=[0.1, 0.3, 0.2, 0.2, 0.1, 0.1])
    assert edge_sd(kls.at_length(256), kls.at_length(256), 0.05) == pytest.approx(0.0816 / 0.2 * 0.05, rel=1e-2)


def test_sizing_buys_the_prompts_each_tolerance_needs_within_the_time_cap():
    from prune_heads.search.guard_sizing import ProbeResolution, Sizing, size

    rows = [ProbeResolution("passkey", 512, 4, 21.79, 5.0, "pt"), ProbeResolution("passkey", 2048, 4, 21.79, 5.0, "pt"),
            ProbeResolution("copy", 512, 2, 4.0, 5.0, "pt"), ProbeResolution("copy", 2048, 2, 8.0, 5.0, "pt"),
            ProbeResolution("text", 2048, 3, 0.01, 0.05, "nat")]
    current = {"passkey": 4, "copy": 2, "text": 3}
    free = size(rows, current, max_tokens=1 << 30, max_prompts=256)
    assert free.prompts == {"passkey": 73, "copy": 10} and free.capped_by is None  # copy: its 2048 row needs 10
    assert free.wanted == free.prompts and "text" not in free.prompts  # the user's texts are as many as they gave
    # text costs 3 x 2048 x 2 = 12,288 tokens of the 30,000; the generated probes share the rest
    capped = size(rows, current, max_tokens=30_000, max_prompts=256)
    # share (30,000 - 12,288) / 212,480 tokens of what they want: passkey 6 of 73, copy never below the pilot's 2
    assert capped.capped_by == "max_tokens" and capped.prompts == {"passkey": 6, "copy": 2}
    assert capped.tokens_per_point == 12_288 + 8 * 2_560
    few = size(rows, current, 1 << 30, max_prompts=16)
    assert few.prompts == {"passkey": 16, "copy": 10} and few.capped_by == "max_prompts"
    again = Sizing.from_tensors(["passkey", "copy"], capped.to_tensors())
    assert again == capped  # what a resumed run reads back from the cache


@pytest.mark.slow
def test_an_unresolved_guard_warns_and_sizes_itself_through_the_main_command(model_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """Under the default (sizing auto) the run predicts each probe's half-width, sizes passkey and copy up to resolve
    their tolerances, and records it; with sizing fixed and too few prompts it warns, with the count that would. (The
    tiny random model retrieves nothing, so it can lose nothing: its edge sd is that of a model that retrieves every
    key, 21.8 points at a 5-point tolerance.)"""
    import prune_heads.search.guard_sizing as sizing

    monkeypatch.setattr(sizing, "edge_sd", lambda base, pilot, tolerance: 100 * (0.05 * 0.95) ** 0.5)
    monkeypatch.setattr(sizing, "probability_edge_sd", lambda base, pilot: 100 * (0.05 * 0.95) ** 0.5)
    report, err = _run(model_dir, tmp_path / "auto", capsys)
    g = report["guard"]
    assert g["sizing"]["prompts"]["passkey"] > 4 and "long-context guard sized to resolve its tolerances" in err
    assert g["sizing"]["prompts_to_resolve"] == {"copy": 73, "passkey": 73}
    rows = {r["probe"]: r for r in g["resolution"]}
    assert g["probes"][0]["prompts"]["512"] == rows["passkey"]["prompts"] == g["sizing"]["prompts"]["passkey"]
    assert all(r["predicted_half_width"] > 0 for r in g["resolution"])
    assert {"load", "scoring", "search", "guard", "export"} <= set(report["timings"]["stages"])
    assert report["timings"]["total"] >= sum(report["timings"]["stages"].values()) - 0.1 and "done in" in err
    recipe = tmp_path / "fixed.yaml"
    recipe.write_text("guard:\n  sizing: fixed\n")
    report, err = _run(model_dir, tmp_path / "fixed", capsys, "--recipe", str(recipe))
    g = report["guard"]
    assert g["sizing"] is None and g["probes"][0]["prompts"] == {"512": 4}
    passkey = next(r for r in g["resolution"] if r["probe"] == "passkey")
    assert not passkey["resolves_tolerance"] and passkey["prompts_to_resolve"] == 73
    assert "the long-context guard cannot resolve its tolerance for passkey at 512 tokens: 4 prompts" in err
    assert "73 prompts would" in err


# -- the default measure: probabilities, the read rates beside them -------------------------------------------------


def test_pass_key_and_copy_are_judged_by_probabilities_with_the_read_rates_beside():
    probe = ProbeSet("passkey", _probe("match").items, "match")
    original = _result(probe, match=[1, 1, 1, 1, 1, 1], p_match=[0.8, 0.7, 0.9, 0.6, 0.5, 0.5])
    pruned = _result(probe, match=[1, 1, 1, 0, 1, 1], p_match=[0.7, 0.7, 0.8, 0.4, 0.5, 0.5])
    short, _ = compare(original, pruned, tolerance=5.0, rule="point", measure="probability")
    # per prompt 10, 0, 10, 20 points of key probability: mean 10, sd 8.165, se 4.08
    assert short.change == pytest.approx(10.0) and short.ci_low == pytest.approx(10 - 1.96 * 8.165 / 2, rel=1e-3)
    assert (short.original, short.pruned) == (pytest.approx(0.75), pytest.approx(0.65)) and not short.ok
    assert (short.read_original, short.read_pruned, short.measure) == (1.0, 0.75, "probability")
    assert "keys retrieved 100.0% -> 75.0%, key probability 75.0% -> 65.0%, +10 pt" in short.describe()
    assert short.to_json()["read_pruned"] == 0.75
    rates = compare(original, pruned, tolerance=5.0, rule="point", measure="rate")[0]
    assert rates.change == pytest.approx(25.0) and "read_original" not in rates.to_json()
    copy = _probe("token_accuracy")
    soft = compare(_result(copy, p_token=[0.3] * 6), _result(copy, p_token=[0.28] * 6), 5.0, "point", "probability")
    assert soft[0].change == pytest.approx(2.0) and soft[0].ok


def test_a_probability_probes_edge_sd_is_the_pilots_pooled_sd_at_its_upper_confidence_limit():
    """Lengths 256 (4 prompts) and 1024 (2): changes 0, 2, 4, 6 and 1, 3 points: pooled variance (20/3 x 3 + 2 x 1)
    / 4 = 5.5 on 4 degrees of freedom; the 95% upper limit of the sd is sqrt(4 x 5.5 / 0.7107) = 5.56 points."""
    from prune_heads.search.guard_sizing import chi2_05, probability_edge_sd, resolutions

    probe = _probe("match")
    base = _result(probe, p_match=[0.5] * 6)
    pilot = _result(probe, p_match=[0.5, 0.48, 0.46, 0.44, 0.49, 0.47])
    assert probability_edge_sd(base, pilot) == pytest.approx((4 * 5.5 / 0.7107) ** 0.5, rel=1e-4)
    rows = resolutions((base,), (pilot,), {"copy": 5.0}, measure="probability")
    assert [r.edge_sd for r in rows] == [pytest.approx(5.564, rel=1e-3)] * 2
    assert rows[0].prompts_for(5.0) == 5 and rows[0].resolves is False  # 4 prompts: +/-5.45
    one = ProbeSet("copy", (ProbeItem((1, 2, 3), 1, 256),), "match")
    assert probability_edge_sd(_result(one, p_match=[1.0]), _result(one, p_match=[0.5])) == float("inf")
    assert chi2_05(30) == pytest.approx(18.4927) and chi2_05(40) == pytest.approx(26.5093, rel=1e-3)


def test_a_probes_probabilities_are_those_of_the_target_tokens():
    from tiny import tiny_model

    from prune_heads.eval.probes import probe_pass

    lm = tiny_model("llama")
    probe = copy_probe(lm, (128,), 2, seed=3)
    result = probe_pass(lm, probe, None)
    for i, item in enumerate(probe.items):
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([item.ids])).logits[0, -item.target - 1 : -1]
        gold = torch.tensor(item.ids[-item.target:])
        p = torch.softmax(logits.double(), -1).gather(-1, gold[:, None])[:, 0]
        assert float(result.p_token[i]) == pytest.approx(float(p.mean()), rel=1e-4)
        assert float(result.p_match[i]) == pytest.approx(float(p.prod()), rel=1e-3, abs=1e-300)
        assert float(result.nll[i]) == pytest.approx(float(-p.log().mean()), rel=1e-4)
