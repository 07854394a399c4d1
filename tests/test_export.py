"""Physical pruning equals the masked model for every family, and every export reloads with transformers and
gives the same logits."""
import json

import pytest
import torch
from helpers import EVEN, IDS, UNEVEN, logits
from tiny import FAMILIES, REAL_SHAPES, tiny_model, uneven_heads

from exporters.export import ExportOptions, export_pruned
from exporters.manifest import MANIFEST, read_manifest
from prune_heads.errors import UserError
from prune_heads.heads import HeadSet
from prune_heads.plan.ablation import ablate
from prune_heads.plan.planner import Planner, balanced_selection, plan_exact, plan_masked, plan_uniform
from prune_heads.plan.slicing import pruned_copy


def expected_param_drop(lm, plan) -> int:
    """Rows of q/k/v (+ biases, + cross-head norm weights) and columns of o_proj that the plan removes."""
    drop = 0
    hidden = lm.config.hidden_size
    for i, lp in enumerate(plan.layers):
        attn = lm.arch.attention(lm.model, i)
        d = lp.geometry.head_dim
        q_w, q_b, k_w, k_b, v_w, v_b = lm.arch.qkv_weights(attn)
        dq = (lp.geometry.num_heads - lp.num_heads) * d
        dkv = (lp.geometry.num_kv_heads - lp.num_kv_heads) * d
        drop += dq * hidden * 2 + dkv * hidden * 2
        drop += (dq if q_b is not None else 0) + (2 * dkv if k_b is not None else 0)
        if lm.arch.qk_norm == "across_heads":
            drop += dq + dkv
        if not lp.slots:
            drop += sum(p.numel() for n, p in attn.named_parameters() if "norm" in n and lm.arch.qk_norm == "per_head")
    return drop


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads", [UNEVEN, EVEN], ids=["uneven", "even"])
def test_pruned_logits_equal_masked_model_and_parameters_drop_exactly(family, heads):
    lm = tiny_model(family)
    layouts = lm.arch.geometries(lm.model)
    for make in (plan_exact, plan_uniform, plan_masked):
        plan = make(heads, layouts)
        with ablate(lm, plan):
            reference = logits(lm.model)
        pruned = pruned_copy(lm.model, lm.arch, plan)
        assert torch.allclose(logits(pruned), reference, atol=1e-5), (family, plan.kind)
        before = sum(p.numel() for p in lm.model.parameters())
        after = sum(p.numel() for p in pruned.parameters())
        assert before - after == expected_param_drop(lm, plan), (family, plan.kind)
    assert plan_exact(EVEN, layouts).shapes == [(4, 2)] * 4


def test_exact_plan_copies_kv_heads_to_equalise_uneven_groups():
    lm = tiny_model("llama")
    plan = plan_exact(UNEVEN, lm.arch.geometries(lm.model))
    # layer 0 keeps heads 1, 2 of group 0 and 5 of group 1. Group size 1 (KV head 0 copied: 3 q + 3 KV) and group
    # size 2 (one zero dummy: 4 q + 2 KV) cost the same parameters; the smaller KV cache wins.
    assert plan.layers[0].slots == (1, 2, 5, None) and plan.layers[0].kv_slots == (0, 1)
    assert plan.layers[1].is_identity
    assert plan.layers[2].slots == (3, 4, 5) and plan.layers[2].kv_slots == (1,)
    assert plan.layers[3].slots == () and plan.layers[3].kv_slots == ()
    uniform = plan_uniform(UNEVEN, lm.arch.geometries(lm.model))
    assert uniform.is_uniform and uniform.shapes == [(6, 2)] * 4  # layer 1 keeps everything


def test_exact_plan_copies_a_kv_head_when_that_is_cheapest():
    from prune_heads.models.geometry import HeadGeometry as AttentionLayout

    lay = AttentionLayout(8, 2, 16)  # groups of 4; keep all of group 0 and one head of group 1
    plan = plan_exact(HeadSet.of({0: [4, 5, 6]}), [lay])
    # g'=1: 5 q + 5 KV (cost 20); g'=2: 6 q + 3 KV (18, KV head 0 copied); g'=4: 8 q + 2 KV (20).
    assert plan.layers[0].slots == (0, 1, 2, 3, 7, None) and plan.layers[0].kv_slots == (0, 0, 1)


def test_olmo2_verification_ablation_includes_the_norm_change():
    """OLMo-2's q/k norms span all heads: plain head ablation is not what the pruned model computes; the plan's is."""
    lm = tiny_model("olmo2")
    plan = plan_exact(UNEVEN, lm.arch.geometries(lm.model))
    pruned = logits(pruned_copy(lm.model, lm.arch, plan))
    with ablate(lm, UNEVEN):
        plain = logits(lm.model)
    with ablate(lm, plan):
        planned = logits(lm.model)
    assert (plain - pruned).abs().max() > 1e-3
    assert torch.allclose(planned, pruned, atol=1e-5)


def test_balanced_selection_removes_the_same_number_per_group():
    lm = tiny_model("llama")
    layouts = lm.arch.geometries(lm.model)
    scores = torch.arange(24, dtype=torch.float32).view(4, 6)
    sel = balanced_selection(UNEVEN, layouts, scores, dormant_low=True)
    for i, lay in enumerate(layouts):
        per_group = [sum(1 for h in sel.heads(i) if lay.kv_head_of(h) == k) for k in range(lay.num_kv_heads)]
        assert len(set(per_group)) == 1
    assert sel.heads(0) == (0, 3) and sel.heads(3) == (0, 1, 2, 3, 4, 5) and sel.heads(1) == ()
    assert plan_exact(sel, layouts).layers[0].kv_slots == (0, 1)  # no KV copies needed


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_exports_and_reloads_with_the_same_logits(family, tmp_path):
    """Every family, every layout: plain from_pretrained (no remote code; prune_heads is imported) gives the verified
    ablation's logits; the uneven selection is exported per-layer by auto on every family (Gemma-2/3 and Phi-3
    included) and removes parameters."""
    from transformers import AutoModelForCausalLM

    lm = tiny_model(family)
    for layout in ("auto", "uniform", "per-layer", "masked"):
        out = tmp_path / layout
        out.mkdir()
        result = export_pruned(lm, UNEVEN, out, ExportOptions(layout=layout, progress=False, measure_speed=False))
        cfg = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in cfg and "per_layer_config" not in cfg
        per_layer = result.choice.layout == "per-layer"
        assert result.choice.layout == (layout if layout != "auto" else "per-layer")
        assert ("auto_map" in cfg) == per_layer and ("per_layer_heads" in cfg) == per_layer
        assert cfg["model_type"] == ("pruned_" if per_layer else "") + lm.config.model_type
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        assert type(reloaded).__name__ == cfg["architectures"][0]
        with ablate(lm, result.choice.plan):
            reference = logits(lm.model)
        assert torch.allclose(logits(reloaded), reference, atol=1e-5), (family, layout)
        n_params = sum(p.numel() for p in reloaded.parameters())
        assert n_params == result.stats["after"]["parameters"]
        if result.choice.layout == "per-layer":
            assert n_params < result.stats["before"]["parameters"]
            assert cfg["per_layer_heads"][3] == [0, 0] and cfg["architectures"][0].startswith("Pruned")
            assert "pruned_classes(" in (out / "modeling_pruned.py").read_text()
        if result.choice.layout == "masked":
            assert n_params == result.stats["before"]["parameters"]
        meta = read_manifest(out)
        assert meta["removed_heads"] == UNEVEN.to_json() and meta["layout"] == result.choice.layout
        card = (out / "README.md").read_text()
        assert card.startswith("---\n") and "attention-head-pruning" in card and "library_name: transformers" in card
        assert "base_model" not in card.split("\n---\n")[0]  # a local directory is no Hub repository


@pytest.mark.parametrize("family", sorted(REAL_SHAPES))
def test_real_shaped_uneven_selections_export_per_layer_and_load_without_remote_code(family, tmp_path):
    """Families shaped like their real checkpoints (hidden_size != heads x head_dim, one KV head, no grouping):
    an uneven selection with a whole KV group removed and a layer emptied ships per-layer, removes parameters, and
    stock from_pretrained (no trust_remote_code) gives the verified ablation's logits."""
    from transformers import AutoModelForCausalLM

    shape = REAL_SHAPES[family]
    lm = tiny_model(family, **shape)
    heads = uneven_heads(shape["num_attention_heads"], shape["num_key_value_heads"])
    result = export_pruned(lm, heads, tmp_path, ExportOptions(layout="auto", progress=False, measure_speed=False))
    assert result.choice.layout == "per-layer"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == f"pruned_{family}" and cfg["per_layer_heads"][3] == [0, 0]
    assert cfg["num_attention_heads"] == shape["num_attention_heads"]  # the global counts stay the original's
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with ablate(lm, result.choice.plan):
        reference = logits(lm.model)
    assert torch.allclose(logits(reloaded), reference, atol=1e-5)
    removed = result.stats["before"]["parameters"] - sum(p.numel() for p in reloaded.parameters())
    assert removed > 0 and removed == result.stats["before"]["parameters"] - result.stats["after"]["parameters"]


def test_without_vllm_the_export_ships_marked_not_verified_in_vllm_with_the_install_hint(tmp_path, monkeypatch, caplog):
    """No vLLM found (none named, none in this Python): written, recorded and carded as not run in vLLM, the hint
    printed; a per-layer OLMo-2 export (no vLLM class the plugin builds) says so without starting vLLM; a named Python
    that cannot run vLLM is recorded as such."""
    import logging
    import sys

    import exporters.runtimes.vllm_check as vllm_check

    caplog.set_level(logging.INFO, "prune_heads")
    find_spec = vllm_check.importlib.util.find_spec
    monkeypatch.setattr(vllm_check.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else
                        find_spec(name, *a))
    lm = tiny_model("llama")
    result = export_pruned(lm, HeadSet.of({0: [1]}), tmp_path, ExportOptions(progress=False, measure_speed=False))
    assert result.vllm == {"verified": False, "why_not": "no vLLM found (--vllm-python, $PRUNE_HEADS_VLLM_PYTHON)"}
    assert read_manifest(tmp_path)["vllm"] == result.vllm
    assert "Not run in vLLM when written (no vLLM found" in (tmp_path / "README.md").read_text()
    assert "not verified in vLLM; install vLLM in an environment of its own" in caplog.text

    found = vllm_check.vllm_python
    monkeypatch.setattr(vllm_check, "vllm_python", lambda named=None: "/path/to/vllm-env/bin/python")
    (tmp_path / "olmo2").mkdir()
    result = export_pruned(tiny_model("olmo2"), uneven_heads(4, 2), tmp_path / "olmo2",
                           ExportOptions(layout="per-layer", progress=False, measure_speed=False))
    assert result.vllm == {"verified": False, "why_not": "vLLM has no olmo2 class the plugin builds per layer"}

    # A Python named for vLLM that cannot run it (this one has no vLLM): the one worker process fails, the export
    # ships marked not verified, naming both models it was to run and vLLM's last words.
    monkeypatch.setattr(vllm_check, "vllm_python", found)
    (tmp_path / "broken").mkdir()
    result = export_pruned(lm, HeadSet.of({0: [1]}), tmp_path / "broken",
                           ExportOptions(progress=False, measure_speed=False, vllm_python=sys.executable))
    why = result.vllm["why_not"]
    assert not result.vllm["verified"] and why.startswith("vLLM could not run ") and " and " in why
    assert "No module named 'vllm'" in why and read_manifest(tmp_path / "broken")["vllm"] == result.vllm
    assert "the export is written, not verified in vLLM" in caplog.text


@pytest.mark.slow
def test_a_per_layer_export_loads_with_remote_code_where_prune_heads_is_not_installed(tmp_path):
    """Without the package (its import blocked in a fresh process), the shipped modeling_pruned.py builds the same
    model under trust_remote_code=True: its logits equal the verified ablation's."""
    import subprocess
    import sys

    shape = REAL_SHAPES["gemma3_text"]
    lm = tiny_model("gemma3_text", **shape)
    (tmp_path / "out").mkdir()
    result = export_pruned(lm, uneven_heads(4, 1), tmp_path / "out", ExportOptions(layout="per-layer", progress=False, measure_speed=False))
    with ablate(lm, result.choice.plan):
        torch.save(logits(lm.model), tmp_path / "reference.pt")
    script = f"""
import sys
sys.modules["prune_heads"] = None  # not installed
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True).eval()
ids = torch.tensor({IDS.tolist()})
with torch.no_grad():
    got = model(input_ids=ids).logits
print(type(model).__module__, (got - torch.load({str(tmp_path / "reference.pt")!r})).abs().max().item())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    module, diff = done.stdout.split()
    assert module.startswith("transformers_modules") and float(diff) < 1e-5


def test_llama_head_counts_llamaconfig_refuses_export_as_architecture_identical_mistral(tmp_path):
    from transformers import AutoModelForCausalLM

    lm = tiny_model("llama", hidden_size=90)  # 6 heads of 16 (explicit head_dim); 4 kept heads: 90 % 4 != 0
    heads = HeadSet.of({i: [0, 3] for i in range(4)})  # groups keep (2, 2): 4 query heads, 2 KV heads per layer
    result = export_pruned(lm, heads, tmp_path, ExportOptions(layout="auto", progress=False, measure_speed=False))
    assert result.choice.layout == "uniform" and result.choice.plan.shapes == [(4, 2)] * 4
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "mistral" and cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["architectures"] == ["MistralForCausalLM"]
    assert cfg["sliding_window"] is None and cfg["head_dim"] == 16
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded).__name__ == "MistralForCausalLM"
    with ablate(lm, result.choice.plan):
        assert torch.allclose(logits(reloaded), logits(lm.model), atol=1e-5)


def test_sharded_export_has_an_index_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    lm = tiny_model("qwen2")
    export_pruned(lm, EVEN, tmp_path, ExportOptions(layout="auto", max_shard_size="100KB", progress=False, measure_speed=False))
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with ablate(lm, HeadSet.of(EVEN.as_dict())):
        assert torch.allclose(logits(reloaded), logits(lm.model), atol=1e-5)


def test_auto_layout_picks_uniform_only_when_nothing_is_left_on_the_table():
    lm = tiny_model("qwen2")
    layouts = lm.arch.geometries(lm.model)
    even = Planner(layouts, lm.arch, lm.config, 4).choose(EVEN, "auto")
    assert even.layout == "uniform" and "stock config" in even.reason
    uneven = Planner(layouts, lm.arch, lm.config, 4).choose(UNEVEN, "auto")
    assert uneven.layout == "per-layer" and "different head counts" in uneven.reason
    opts = uneven.options
    assert opts["per-layer"]["attention_params"] < opts["uniform"]["attention_params"] <= opts["masked"]["attention_params"]
    assert opts["per-layer"]["kv_cache_bytes_per_token"] == 4 * 2 * 16 * (2 + 2 + 1 + 0)


def test_manifest_guards_incomplete_or_modified_exports(tmp_path):
    lm = tiny_model("llama")
    export_pruned(lm, EVEN, tmp_path, ExportOptions(progress=False, measure_speed=False))
    read_manifest(tmp_path)
    (tmp_path / "README.md").write_text("edited")
    with pytest.raises(UserError, match="modified after export"):
        read_manifest(tmp_path)
    (tmp_path / "README.md").unlink()
    with pytest.raises(UserError, match="incomplete"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(UserError, match="not a prune-heads export"):
        read_manifest(tmp_path)


def test_a_per_layer_export_is_refused_as_input_with_a_clear_error(tmp_path):
    from prune_heads.models.loading import LoadOptions, load_model

    lm = tiny_model("qwen2")
    export_pruned(lm, UNEVEN, tmp_path, ExportOptions(layout="per-layer", progress=False, measure_speed=False))
    with pytest.raises(UserError, match="different attention head counts per layer"):
        load_model(str(tmp_path), options=LoadOptions())


def _bf16(family: str):
    """A tiny model in bfloat16 (parameters only: RoPE's inv_freq stays float32, as when transformers loads bf16)."""
    import dataclasses

    lm = tiny_model(family)
    for p in lm.model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return dataclasses.replace(lm, dtype=torch.bfloat16)


def test_bf16_export_is_verified_in_float32_and_leaves_both_models_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    from exporters.checkpoint import reload_export

    lm = _bf16("llama")
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    result = export_pruned(lm, EVEN, tmp_path, ExportOptions(layout="uniform", progress=False, measure_speed=False))
    v = result.verification
    assert v["compared_in"] == "float32" and v["dtype"] == "bfloat16"
    assert v["max_abs_logit_diff"] <= v["tolerance"] and v["argmax_agreement"] == 1.0
    # The original came back bit for bit, in bf16.
    for n, p in lm.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[n]), n
    # The reloaded model handed on for evaluation is the bf16 model a user gets from from_pretrained.
    handed_on = reload_export(lm, result.choice, tmp_path, None)  # what export_pruned evaluates the task on
    assert all(p.dtype == torch.bfloat16 for p in handed_on.parameters())
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(logits(handed_on), logits(fresh))


def test_float32_comparison_catches_a_one_percent_error_in_one_head_and_falls_back_when_memory_is_short(monkeypatch):
    import copy

    from exporters import logits as ex

    lm = _bf16("qwen2")
    wrong = copy.deepcopy(lm.model)
    with torch.no_grad():
        wrong.model.layers[1].self_attn.o_proj.weight[:, :16] *= 1.01  # head 0 of layer 1, 1% off
    with pytest.raises(RuntimeError, match="does not reproduce"):
        ex.compare_models(lm.model, wrong, IDS, torch.bfloat16, "the wrong copy")
    right = copy.deepcopy(lm.model)
    assert ex.compare_models(lm.model, right, IDS, torch.bfloat16, "a copy")["max_abs_logit_diff"] == 0.0
    monkeypatch.setattr(ex, "available_bytes", lambda device: 1 << 10)  # 1 KiB free: no room for float32 copies
    check = ex.compare_models(lm.model, right, IDS, torch.bfloat16, "a copy")
    assert check["compared_in"] == "bfloat16" and check["tolerance"] == pytest.approx(
        ex.LOGIT_RTOL[torch.bfloat16] * max(1.0, float(logits(lm.model).float().abs().max())), rel=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])  # tied; untied; scaled embedding
def test_float32_comparison_never_upcasts_a_whole_vocabulary_matrix(family):
    """The embedding upcasts only the rows looked up and the output projection a block of rows at a time (on a small
    model the vocabulary matrix in float32 is the largest tensor of the check); the logits are the float32 model's."""
    import copy

    from exporters import logits as ex

    lm = _bf16(family)
    vocab = lm.config.vocab_size
    want = logits(copy.deepcopy(lm.model).float())
    seen = []
    embed, head = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    probes = [m.register_forward_hook(lambda m, a, out: seen.append((m.weight.dtype, m.weight.shape[0], out.dtype)))
              for m in (embed, head)]  # registered first: they see the weights before they are given back
    with ex.float32_parameters(lm.model):
        got = logits(lm.model)
    for probe in probes:
        probe.remove()
    assert len(IDS.unique()) < vocab
    assert seen == [(torch.float32, len(IDS.unique()), torch.float32), (torch.bfloat16, vocab, torch.float32)]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert embed.weight.shape[0] == vocab and embed.weight.dtype == torch.bfloat16  # given back as it was
    assert "forward" not in vars(head)  # the class's forward again


def test_float32_comparison_of_one_token_beside_a_padding_index_it_does_not_look_up():
    """An embedding with a padding index (SmolLM2's is 2) looked up for one token (a generation step, the vLLM check's
    greedy continuations) upcasts that one row; the padding index is the full table's again afterwards."""
    import copy

    from exporters import logits as ex

    lm = _bf16("llama")
    embed = lm.model.get_input_embeddings()
    embed.padding_idx = 5
    ids = torch.tensor([[9]])
    with torch.no_grad():
        want = copy.deepcopy(lm.model).float()(input_ids=ids).logits
        with ex.float32_parameters(lm.model):
            got = lm.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert embed.padding_idx == 5 and embed.weight.shape[0] == lm.config.vocab_size


def test_reference_logits_go_to_disk_come_back_equal_and_are_removed_once_the_reload_is_checked(tmp_path,
                                                                                                monkeypatch):
    """The export holds its reference logits (full vocabulary, float32) on disk from before its files are written
    until the reload is checked, not in memory; read back they are the in-memory ones bit for bit."""
    from exporters.export import REFERENCE_DIR
    from exporters.logits import SpilledLogits, reference_logits, sample_prompts

    lm = tiny_model("llama")
    ids = sample_prompts(lm, None)
    kept, precision = reference_logits(lm.model, ids, lm.dtype)
    spilled, same = reference_logits(lm.model, ids, lm.dtype, into=SpilledLogits(tmp_path / "ref"))
    assert same == precision and len(spilled) == len(kept) == ids.shape[0]
    assert all(torch.equal(a, b) for a, b in zip(spilled, kept))
    assert sorted(p.name for p in (tmp_path / "ref").iterdir()) == [f"prompt-{i}.pt" for i in range(len(kept))]
    written, real_append = [], SpilledLogits.append
    monkeypatch.setattr(SpilledLogits, "append", lambda self, t: (written.append(self.directory),
                                                                  real_append(self, t))[1])
    out = tmp_path / "export"
    out.mkdir()
    export_pruned(lm, UNEVEN, out, ExportOptions(progress=False, measure_speed=False))
    assert written == [out / REFERENCE_DIR] * ids.shape[0] and not (out / REFERENCE_DIR).exists()
    assert read_manifest(out)["verified"]
