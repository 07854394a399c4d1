import json

import pytest
import torch
from helpers import cais_file
from tiny import tiny_model

from prune_heads.report.compare import ks_distance, selected, spearman, wasserstein_distance
from prune_heads_cli.main import main


def test_distances_by_hand():
    a, b = torch.tensor([0.0, 1, 2, 3]), torch.tensor([1.0, 2, 3, 4])
    assert ks_distance(a, b) == pytest.approx(0.25)
    assert wasserstein_distance(a, b) == pytest.approx(1.0)  # every unit of mass moves by 1
    assert wasserstein_distance(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 2.0])) == pytest.approx(1.0)
    assert ks_distance(a, a) == 0 and wasserstein_distance(a, a) == 0


def test_spearman_with_ties_and_selection():
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    # x ranks 1, 2.5, 2.5, 4; y ranks 1..4: rho = Pearson of the ranks = 0.9486...
    assert spearman(torch.tensor([1.0, 2, 2, 3]), torch.tensor([1.0, 2, 3, 4])) == pytest.approx(0.9486833, abs=1e-6)
    scores = torch.tensor([[0.5, 0.1], [0.9, 0.2]])
    assert selected(scores, "ahon", 0.5) == {1, 3}  # low = dormant
    assert selected(scores, "awft", 0.25) == {2}  # high = dormant


def _saved(tmp_path, name, seed):
    lm = tiny_model("llama", seed=seed)
    d = tmp_path / name
    lm.model.save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return d


def test_compare_a_model_with_itself_and_with_another(tmp_path, capsys):
    a, b = _saved(tmp_path, "a", 0), _saved(tmp_path, "b", 1)
    mmlu = cais_file(tmp_path)
    common = ["--mmlu", str(mmlu), "--calibration-size", "4", "--no-progress", "--mmlu-per-subject", "all"]
    with pytest.raises(SystemExit) as e:
        main(["compare", str(a), str(a), "--out", str(tmp_path / "same"), *common])
    assert e.value.code == 0, capsys.readouterr().err
    same = json.loads((tmp_path / "same" / "compare.json").read_text())
    assert same["same_head_grid"] and same["texts"] == 4
    for key, row in same["functions"].items():
        assert row["ks"] == 0 and row["wasserstein"] == 0 and row["iou_at_10pct"] == 1.0, key
        assert row["spearman_heads"] == pytest.approx(1.0), key
    assert (tmp_path / "same" / "score_cdfs.png").read_bytes()[:4] == b"\x89PNG"
    assert "| `ahon_ln` |" in (tmp_path / "same" / "compare.md").read_text()
    with pytest.raises(SystemExit) as e:
        main(["compare", str(a), str(b), "--out", str(tmp_path / "diff"), *common])
    assert e.value.code == 0
    diff = json.loads((tmp_path / "diff" / "compare.json").read_text())
    assert max(r["ks"] for r in diff["functions"].values()) > 0
