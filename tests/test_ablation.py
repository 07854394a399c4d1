import copy

import pytest
import torch
from tiny import FAMILIES, tiny_model

from prune_heads.heads import HeadSet
from prune_heads.plan.ablation import ablate

IDS = torch.tensor([[3, 17, 45, 99, 120, 7, 250, 33, 61]])


def logits(lm, ids=IDS):
    with torch.no_grad():
        return lm.model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_ablating_nothing_changes_nothing_and_hooks_go_away(family):
    lm = tiny_model(family)
    before = logits(lm)
    with ablate(lm, HeadSet()):
        assert torch.equal(logits(lm), before)
    with ablate(lm, HeadSet.of({0: [1]})):
        assert not torch.allclose(logits(lm), before)
    assert all(not m._forward_pre_hooks for m in lm.model.modules())
    assert torch.equal(logits(lm), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_ablating_heads_equals_zeroing_their_o_proj_input_columns(family):
    lm = tiny_model(family)
    heads = HeadSet.of({0: [1], 2: [0, 3, 5]})
    with ablate(lm, heads):
        ablated = logits(lm)
    zeroed = copy.deepcopy(lm.model)
    d = lm.config.head_dim
    with torch.no_grad():
        for layer, h in heads.pairs():
            zeroed.model.layers[layer].self_attn.o_proj.weight[:, h * d:(h + 1) * d] = 0
        reference = zeroed(input_ids=IDS).logits
    assert torch.allclose(ablated, reference, atol=1e-5)


def test_per_row_mask_ablates_each_row_independently():
    lm = tiny_model("llama")
    heads = HeadSet.of({1: [2, 4]})
    with ablate(lm, heads):
        static = logits(lm)
    plain = logits(lm)
    mask = torch.ones(2, 4, 6)
    mask[0] = heads.mask(4, 6)
    with ablate(lm, mask):
        both = logits(lm, IDS.repeat(2, 1))
    assert torch.allclose(both[0], static[0], atol=1e-6)
    assert torch.allclose(both[1], plain[0], atol=1e-6)


def test_head_set_is_canonical_hashable_and_validated():
    a = HeadSet.of({2: [3, 1, 1], 0: [], "1": [0]})
    b = HeadSet.from_pairs([(1, 0), (2, 1), (2, 3)])
    assert a == b and hash(a) == hash(b) and len(a) == 3
    assert a.to_json() == {"1": [0], "2": [1, 3]}
    from prune_heads.errors import UserError

    with pytest.raises(UserError, match="layer 5"):
        HeadSet.of({5: [0]}).validate(3, [6, 6, 6])
    with pytest.raises(UserError, match="head 6 of layer 0"):
        HeadSet.of({0: [6]}).validate(3, [6, 6, 6])


def test_dynamic_masks_select_exactly_the_heads_past_threshold_per_input():
    from prune_heads.plan.ablation import dynamic_masks

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(5, 3, 4, generator=g)
    low = dynamic_masks(scores, 0.3, "low")
    high = dynamic_masks(scores, 0.7, "high")
    for n in range(5):  # against a naive loop
        for layer in range(3):
            for h in range(4):
                assert low[n, layer, h] == (0.0 if scores[n, layer, h] <= 0.3 else 1.0)
                assert high[n, layer, h] == (0.0 if scores[n, layer, h] >= 0.7 else 1.0)
