"""Every score function against a deliberately naive reference: the model's standard attention outputs
(eager), value vectors read off the projection, and explicit loops over heads and tokens; o_i is
recomputed as sum_j A_ij v_j rather than read from the model."""
import math

import pytest
import torch
from tiny import FAMILIES, tiny_model

from prune_heads.heads import BASE_KEYS, SCORE_KEYS
from prune_heads.scoring import attention_stats
from prune_heads.scoring.hooks import eager_attention, score_heads


def _values(lm, ids):
    """[layer] -> [S, KV, D] value vectors, read off the projection outputs by family (independently of the adapter)."""
    cfg = lm.config
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    captured = {}
    handles = []
    for i, layer in enumerate(lm.model.model.layers):
        attn = layer.self_attn
        if hasattr(attn, "qkv_proj"):
            mod, sl = attn.qkv_proj, slice(nh * hd + nkv * hd, nh * hd + 2 * nkv * hd)
        else:
            mod, sl = attn.v_proj, slice(None)

        def hook(m, a, out, i=i, sl=sl):
            captured[i] = out[0, :, sl].reshape(-1, nkv, hd).double()

        handles.append(mod.register_forward_hook(hook))
    with torch.no_grad(), eager_attention(lm):
        out = lm.model(input_ids=torch.tensor([ids]), output_attentions=True)
    for h in handles:
        h.remove()
    return captured, [a[0].double() for a in out.attentions]


def naive_scores(lm, ids):
    cfg = lm.config
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    values, attentions = _values(lm, ids)
    s = len(ids)
    res = {k: torch.zeros(len(values), nh, dtype=torch.float64) for k in BASE_KEYS}
    for layer in range(len(values)):
        w_o = lm.model.model.layers[layer].self_attn.o_proj.weight.double()
        for h in range(nh):
            kv = h // (nh // nkv)
            a = attentions[layer][h]
            v = values[layer][:, kv]
            awft = sum(float(a[i, 0]) for i in range(s)) / s
            ent = 0.0
            for i in range(s):
                ent += -sum(float(a[i, j]) * math.log(float(a[i, j])) for j in range(s) if float(a[i, j]) > 0)
            outputs = []
            for i in range(s):
                o_i = torch.zeros(hd, dtype=torch.float64)
                for j in range(s):
                    o_i += a[i, j] * v[j]
                outputs.append(o_i)
            contrib = [w_o[:, h * hd:(h + 1) * hd] @ o for o in outputs]
            res["awft"][layer, h] = awft
            res["aeqd"][layer, h] = ent / s
            res["ftvvn"][layer, h] = v[0].norm()
            res["avvn"][layer, h] = sum(float(v[j].norm()) for j in range(s)) / s
            res["lthon"][layer, h] = outputs[-1].norm()
            res["ahon"][layer, h] = sum(float(o.norm()) for o in outputs) / s
            res["ahon_wo"][layer, h] = sum(float(c.norm()) for c in contrib) / s
    for k in BASE_KEYS:
        denom = res["ahon" if k == "lthon" else k].mean(dim=1, keepdim=True)
        res[k + "_ln"] = res[k] / denom
    res["lthon_hn"] = res["lthon"] / res["ahon"]
    return res


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "explicit-blocks"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_score_matches_naive_reference_with_padding_and_gqa(family, fused, monkeypatch):
    """Both ways of getting attention statistics (one fused CPU flash call; explicit blocks of queries, which is also
    the path for soft-capped logits and other devices) against the eager weights."""
    monkeypatch.setattr(attention_stats, "use_fused_kernel", fused)
    monkeypatch.setattr(attention_stats, "QUERY_BLOCK", 4)  # several blocks per sequence
    lm = tiny_model(family)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (14, 9, 11)]  # padded batch of 3
    table = score_heads(lm, seqs, batch_size=3, progress=False)
    assert set(table.keys) == set(SCORE_KEYS)
    assert table.token_counts == [14, 9, 11]
    for n, ids in enumerate(seqs):
        ref = naive_scores(lm, ids)
        for key in SCORE_KEYS:
            got = table.per_input[key][n].double()
            assert torch.allclose(got, ref[key], rtol=2e-4, atol=1e-5), (family, key, n, (got - ref[key]).abs().max())


def test_calibration_score_is_mean_of_per_input_values_and_ranking_respects_direction():
    lm = tiny_model("llama")
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    table = score_heads(lm, seqs, batch_size=1, progress=False)
    for key in SCORE_KEYS:
        assert torch.allclose(table.mean(key), (table.per_input[key][0] + table.per_input[key][1]) / 2)
    ranking = table.ranking("awft")  # high = dormant: first in the ranking has the largest awft
    m = table.mean("awft")
    assert m[ranking[0]] == m.max() and m[ranking[-1]] == m.min()
    ranking = table.ranking("ahon_ln")
    m = table.mean("ahon_ln")
    assert m[ranking[0]] == m.min()


def test_scoring_leaves_model_unchanged():
    lm = tiny_model("qwen2")
    ids = torch.tensor([[4, 5, 6, 7]])
    before = lm.model(input_ids=ids).logits
    score_heads(lm, [[4, 5, 6, 7]], progress=False)
    assert lm.config._attn_implementation == "sdpa"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.model.modules())
    assert torch.equal(lm.model(input_ids=ids).logits, before)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "explicit-blocks"])
def test_attention_statistics_without_a_mask_are_causal_and_match_softmax(fused, monkeypatch):
    """Called directly with no mask (plain causal), against softmax weights computed by hand, with GQA."""
    monkeypatch.setattr(attention_stats, "use_fused_kernel", fused)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 7, 8, generator=g) * 2 for h in (4, 2, 2))
    module = torch.nn.Module()
    got = []
    attention_stats.receive(module, got.append)
    try:
        out, _ = attention_stats.attention_with_stats(module, q, k, v, None, scaling=0.3)
    finally:
        attention_stats.receive(module, None)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(2, 3) * 0.3).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    assert torch.allclose(out, (p @ vv).transpose(1, 2), atol=1e-5)
    assert torch.allclose(got[0].first_token_weight, p[..., 0], atol=1e-6)
    assert torch.allclose(got[0].entropy, torch.special.entr(p).sum(-1), atol=1e-5)
