"""Layer reuse (eval/reuse.py): a point whose head set starts at layer c starts its passes there, from the residual
stream the unablated model computes below it, and gives the numbers of the full forward."""
import pytest
import torch
from helpers import cais_file
from tiny import tiny_model

from prune_heads.data.mmlu import load_mmlu
from prune_heads.data.probes import copy_probe, passkey_probe, text_probe
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.passes import task_loglik, task_loglik_many
from prune_heads.eval.probes import METRIC_FIELDS, probe_pass
from prune_heads.eval.reuse import StartAt, first_changed_layer, read_below
from prune_heads.heads import HeadSet
from prune_heads.plan.ablation import ablate

# Llama; Qwen2 with q/k/v biases; Gemma-3 with sliding windows shorter than the prompts (6 tokens) and its scaled
# embeddings; Gemma-2 with attention and final soft-capping; OLMo-2, whose q/k norms span the heads.
FAMILIES = ("llama", "qwen2", "gemma3_text", "gemma2", "olmo2")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_started_at_layer_c_gives_the_full_forwards_logits_with_and_without_a_cache(family):
    lm = tiny_model(family)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    heads = HeadSet.of({2: [0, 3], 3: [1]})
    with ablate(lm, heads):
        full = lm.model(input_ids=ids).logits
        cache = lm.model(input_ids=ids[:, :12], use_cache=True).cache
        on_cache = lm.model(input_ids=ids[:, 12:], cache=cache, use_cache=True).logits
    from transformers import DynamicCache

    kept = read_below(lm, 2, input_ids=ids)
    below = DynamicCache(config=lm.model.config)
    prefix = read_below(lm, 2, input_ids=ids[:, :12], cache=below, use_cache=True)
    suffix = read_below(lm, 2, input_ids=ids[:, 12:], cache=below, use_cache=True)
    with ablate(lm, heads), StartAt(lm, 2) as start:
        start.feed(kept)
        assert torch.equal(lm.model(input_ids=ids).logits, full)
        start.feed(prefix)
        cache = lm.model(input_ids=ids[:, :12], use_cache=True).cache
        start.feed(suffix)
        assert torch.equal(lm.model(input_ids=ids[:, 12:], cache=cache, use_cache=True).logits, on_cache)
    assert type(lm.arch.decoder_layers(lm.model)[0]).__name__.endswith("DecoderLayer")  # put back


@pytest.mark.parametrize("family", FAMILIES)
def test_task_points_started_above_their_first_changed_layer_equal_full_passes(tmp_path, family):
    lm = tiny_model(family)
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=7))))
    work = Work(lm, None, batch_size=3, progress=False)
    # layer 2 and up; the same layer again (kept, not read twice); a set that touches layer 0 (runs in full)
    sets = [HeadSet.of({2: [0, 3], 3: [5]}), HeadSet.of({2: [1]}), HeadSet.of({0: [2], 3: [0]})]
    for hs in sets:
        full = task_loglik(lm, enc, hs, batch_size=3, progress=False)
        assert torch.allclose(work.task_result(enc, hs).loglik, full.loglik, atol=1e-5, rtol=0)
    starts = work.reuse.summary()["starts"]
    assert [(s["layer"], s["reads"], s["passes"]) for s in starts] == [(2, 1, 2)]
    assert starts[0]["tokens"] * lm.config.hidden_size * 4 == starts[0]["bytes"]
    # several head sets in one pass start at the lowest of their first layers
    together = work.task_results(enc, [HeadSet.of({3: [1]}), HeadSet.of({2: [4]})], ["a", "b"])
    alone = task_loglik_many(lm, enc, [HeadSet.of({3: [1]}), HeadSet.of({2: [4]})], batch_size=3, progress=False)
    for got, want in zip(together, alone):
        assert torch.allclose(got.loglik, want.loglik, atol=1e-5, rtol=0)
    assert work.reuse.summary()["starts"][0]["passes"] == 3


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_probe_reads_started_above_their_first_changed_layer_equal_full_reads(family):
    lm = tiny_model(family)
    work = Work(lm, None, progress=False)
    heads = HeadSet.of({1: [0, 2], 3: [4]})
    texts = ["The quick brown fox jumps over the lazy dog. " * 40]
    for probe in (passkey_probe(lm, (400,), 2, seed=1), copy_probe(lm, (128,), 2, seed=1),
                  text_probe(lm, texts, (96,), 1, "test")):
        full = probe_pass(lm, probe, heads)
        got = work.probe(probe, heads)
        for f in METRIC_FIELDS:
            assert torch.allclose(getattr(got, f), getattr(full, f), atol=1e-6, rtol=0), (probe.name, f)
    assert {s["what"] for s in work.reuse.summary()["starts"]} == {"probe passkey", "probe copy", "probe text"}


def test_first_changed_layer_of_head_sets_plans_and_per_input_masks():
    assert first_changed_layer(HeadSet.of({5: [1], 3: [0]})) == 3
    assert first_changed_layer(HeadSet()) is None and first_changed_layer(None) is None
    assert first_changed_layer(torch.ones(4, 2, 3)) is None  # a mask per input: every pass in full


def test_a_start_larger_than_the_limit_is_never_read_and_its_points_run_in_full(tmp_path):
    lm = tiny_model("llama")
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=8))))
    work = Work(lm, None, batch_size=3, progress=False)
    work.reuse.limit = 1000
    hs = HeadSet.of({2: [0]})
    assert torch.allclose(work.task_result(enc, hs).loglik, task_loglik(lm, enc, hs, 3, False).loglik, atol=1e-5)
    (start,) = work.reuse.summary()["starts"]
    assert (start["kept"], start["reads"], start["passes"]) == (False, 0, 0)


def test_the_unablated_probe_read_keeps_what_the_points_start_from_at_no_read_of_its_own():
    lm = tiny_model("qwen2")
    work = Work(lm, None, progress=False)
    probe = copy_probe(lm, (128,), 3, seed=2)
    heads = HeadSet.of({2: [1], 3: [0, 5]})
    work.keep_layer = 2
    base = work.probe(probe, None)
    (start,) = work.reuse.summary()["starts"]
    assert (start["layer"], start["reads"], start["kept_by"]) == (2, 0, "unablated read")
    assert start["tokens"] == sum(len(it.ids) for it in probe.items)
    got = work.probe(probe, heads)
    (start,) = work.reuse.summary()["starts"]
    assert (start["reads"], start["passes"]) == (0, 1)  # the point started from it, nothing read again
    full = probe_pass(lm, probe, heads)
    for f in METRIC_FIELDS:
        assert torch.allclose(getattr(got, f), getattr(full, f), atol=1e-6, rtol=0)
        assert torch.equal(getattr(base, f), getattr(probe_pass(lm, probe, None), f))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_unablated_task_read_keeps_what_the_points_start_from_at_no_read_of_its_own(tmp_path, family):
    lm = tiny_model(family)
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=9))))
    work = Work(lm, None, batch_size=3, progress=False)
    work.keep_layer = 2
    base = work.task_result(enc, None)
    assert torch.equal(base.loglik, task_loglik(lm, enc, None, 3, False).loglik)  # keeping changes nothing
    (start,) = work.reuse.summary()["starts"]
    assert (start["layer"], start["reads"], start["kept_by"]) == (2, 0, "unablated read")
    heads = HeadSet.of({2: [0, 5], 3: [2]})
    got = work.task_result(enc, heads)
    assert work.reuse.summary()["starts"][0]["passes"] == 1
    assert torch.allclose(got.loglik, task_loglik(lm, enc, heads, 3, False).loglik, atol=1e-5, rtol=0)
