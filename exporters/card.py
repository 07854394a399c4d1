"""The model card (README.md with Hub metadata) of an export."""
from __future__ import annotations

import re

import yaml

from exporters.manifest import source_name
from exporters.speed import speedup_text
from prune_heads.report.markdown import code, plain

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _front(meta: dict) -> list[str]:
    """The card's metadata, which the Hub reads: ``base_model`` only where the source is a real Hub repository."""
    hub_id = (meta["source_model"] or {}).get("hub_id")
    front = {
        **({"base_model": hub_id} if hub_id and _HUB_ID.fullmatch(hub_id) else {}),
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["pruned", "attention-head-pruning", "prune-heads", meta["layout"]],
    }
    return ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]


def _summary_table(meta: dict) -> list[str]:
    before, after = meta["stats"]["before"], meta["stats"]["after"]
    lines = [
        "| | before | after |",
        "|---|---|---|",
        f"| query heads | {before['query_heads']} | {after['query_heads']} |",
        f"| KV heads | {before['kv_heads']} | {after['kv_heads']} |",
        f"| parameters{_tied_note(meta)} | {before['parameters']:,} | {after['parameters']:,} |",
        f"| KV cache per token | {before['kv_cache_bytes_per_token']:,} B | {after['kv_cache_bytes_per_token']:,} B |",
    ]
    speed = meta.get("speed") or {}
    if "prefill_speedup" in speed:
        pre, dec = speed["prefill_tokens_per_s"], speed["decode_tokens_per_s"]
        where = f"{speed['device']}, {speed['dtype']}, batch {speed['batch']}"
        rounds = f"median of {speed['rounds']} alternating rounds"
        lines += [f"| prefill tokens/s ({speed['prompt_tokens']}-token prompt; {where}; {rounds}) | "
                  f"{pre['original']:,.1f} | {pre['shipped']:,.1f} ({speedup_text(speed, 'prefill')}; FLOPs predict "
                  f"x{speed['flops_predicted_prefill_speedup']:.2f}) |",
                  f"| decode tokens/s ({where}; {rounds}) | {dec['original']:,.1f} | {dec['shipped']:,.1f} "
                  f"({speedup_text(speed, 'decode')}) |"]
    task = meta.get("task_eval") or {}
    if task:
        ci = task.get("ci95_points", [float("nan")] * 2)
        lines.append(f"| {plain(meta.get('task', 'mmlu'))} accuracy ({task['n']} questions) | "
                     f"{_pct(task['baseline_accuracy'])} | {_pct(task['pruned_accuracy'])} (delta "
                     f"{task['delta_points']:+.2f} pt, 95% CI [{ci[0]:+.2f}, {ci[1]:+.2f}]) |")
        if "kl_answer_nats" in task:
            lines.append(f"| answer KL from the original | 0 | {task['kl_answer_nats']:.4f} nat "
                         f"({_pct(task['agreement_with_unablated'])} same answers) |")
    lines += _confirmation_row(meta.get("confirmation") or {})
    heal = meta.get("healing")
    if heal:
        before_heal = (task.get("before_healing") or {}).get("accuracy")
        after_heal = (f"; {plain(meta.get('task', 'mmlu'))} before healing {_pct(before_heal)}, after "
                      f"{_pct(task['pruned_accuracy'])}" if before_heal is not None else "")
        lines.append(f"| after LoRA healing ({heal['steps']} steps) | training loss {heal['loss_first']:.4f} | "
                     f"{heal['loss_last']:.4f}{after_heal} |")
    return lines


def _confirmation_row(confirmation: dict) -> list[str]:
    """The confirmation on unseen questions (or, for a next-token-KL budget on generations, unseen texts)."""
    if confirmation.get("confirmed") is None:
        return []
    on = (f"{confirmation['texts']} unseen texts" if "texts" in confirmation
          else f"{confirmation['questions']} unseen questions")
    if not confirmation["confirmed"]:
        return [f"| confirmed on {on} | | nothing confirmed: no heads removed |"]
    if "texts" in confirmation:
        ci = confirmation["kl_text_ci95"]
        return [f"| confirmed on {on} | | next-token KL {confirmation['kl_text_nats']:.4f} nat [{ci[0]:.4f}, "
                f"{ci[1]:.4f}] |"]
    ci = confirmation["ci95_points"]
    return [f"| confirmed on {on} | | delta {confirmation['delta_points']:+.2f} pt [{ci[0]:+.2f}, {ci[1]:+.2f}], "
            f"answer KL {confirmation['kl_answer_nats']:.4f} nat |"]


PROBE_WORDS = {
    "passkey": "a 5-digit key hidden in filler text at depths spread over the prompt, read back greedily",
    "copy": "a random token sequence repeated: the share of the repeat predicted token by token",
    "text": "your documents (--guard-texts): next-token KL from the original on the last quarter of each",
}


def _probe_row(probe: str, length: str, r: dict) -> str:
    if r["unit"] == "nat":
        original, pruned = "0 (reference)", f"KL {r['pruned']:.4f} nat"
    elif r.get("measure") == "probability":  # judged by the probability; the read rate beside it
        original, pruned = (f"{_pct(r[f'read_{side}'])} read, probability {_pct(r[side])}"
                            for side in ("original", "pruned"))
    else:
        original, pruned = _pct(r["original"]), _pct(r["pruned"])
    return (f"| {probe} | {length} | {r['prompts']} | {original} | {pruned} | {r['change']:+.3g} {r['unit']} "
            f"[{r['ci_low']:+.3g}, {r['ci_high']:+.3g}] | {r['tolerance']:g} {r['unit']} |")


def _long_context(meta: dict) -> list[str]:
    """The long-context guard's table: each probe, original against this model, per length."""
    g = meta.get("long_context")
    if not g:
        return []
    lines = ["## Long context", ""]
    if not g.get("enabled"):
        return lines + ["Not checked: the long-context guard was off (`--no-guard`). MMLU-style budgets do not see "
                        "heads that retrieve or copy from far back in a long context.", ""]
    chosen = g.get("chosen")
    if not chosen:
        return lines + ["Nothing was removed (no point of the search both confirmed and kept every long-context probe "
                        "within its tolerance), so the probes have nothing to compare.", ""]
    when = " before healing" if g.get("before_healing") else ""
    lines += [f"Long-context probes built from the tokenizer, each prompt paired with itself on the original "
              f"({g['rule']} rule: the " + ("mean" if g["rule"] == "point" else "95% interval's upper end")
              + f" change must stay within the tolerance), measured on the verified ablation{when}, which the export "
              "equals (see Verification):", ""]
    lines += [f"- **{name}**: {PROBE_WORDS[name]}" for name in chosen["per_length"]]
    if any(r.get("measure") == "probability" for rows in chosen["per_length"].values() for r in rows.values()):
        lines += ["", "Pass key and copy are judged by the probability the model gives the key and each copied token "
                  "(teacher-forced), which every token's log-likelihood moves; the read rates (what greedy decoding "
                  "writes) are shown beside it."]
    lines += ["", "| probe | tokens | prompts | original | this model | lost (text: KL) [95% CI] | tolerance |",
              "|---|---|---|---|---|---|---|"]
    for probe, rows in chosen["per_length"].items():
        lines += [_probe_row(probe, n, r) for n, r in rows.items()]
    return lines + [""]


def _vllm_section(meta: dict) -> list[str]:
    v = meta.get("vllm")
    if not v:
        return []
    if not v.get("verified"):
        return [f"Not run in vLLM when written ({v.get('why_not')}).", ""]
    rt, sp = v["unpruned"], v.get("speed") or {}
    lines = [f"Run in vLLM {v['vllm']} when written: prompt log-probabilities within {v['max_abs_logprob_diff']:.3g} "
             f"of the verified model's on {v['prompts']} prompts (tolerance {v['tolerance']:.3g}, from the unpruned "
             f"model's own vLLM-vs-transformers difference {rt['max_abs_logprob_diff']:.3g}); greedy continuations "
             f"of {v['greedy_tokens']} tokens equal on {v['greedy_equal']} of {v['prompts']} prompts"
             + ("." if v["greedy_equal"] == v["prompts"] else f" (elsewhere vLLM's tokens are near-ties of the "
                f"verified model's, within {v['greedy_max_margin']:.3g} in log-probability).")
             + f" vLLM's class: `{v['architecture']}`.", ""]
    if sp:
        lines += [f"vLLM throughput ({sp['device']}, {sp['dtype']}, batch of {sp['batch']} prompts of "
                  f"{sp['prompt_tokens']} tokens, {sp['decode_tokens']} decoded each, against the unpruned model): "
                  f"prefill {sp['pruned_prefill_tokens_per_s']:,.0f} vs {sp['original_prefill_tokens_per_s']:,.0f} "
                  f"tokens/s (x{sp['prefill_speedup']:.2f}), decode {sp['pruned_decode_tokens_per_s']:,.0f} vs "
                  f"{sp['original_decode_tokens_per_s']:,.0f} tokens/s (x{sp['decode_speedup']:.2f}).", ""]
    return lines


def _gguf_section(meta: dict) -> list[str]:
    g = meta.get("gguf")
    if not g:
        return []
    heads = g["head_counts"]
    counts = f"{heads[0]} query / {g['kv_head_counts'][0]} KV heads in every layer" if len(set(heads)) == 1 else (
        f"per-layer heads {heads} (KV {g['kv_head_counts']})")
    lines = ["## Run it in llama.cpp", "", f"`{g['file']}` ({g['tensor_type']}, llama.cpp architecture "
             f"`{g['architecture']}`, {counts}; tokenizer {g['tokenizer']}):", "", "```sh",
             f"llama-cli -m {g['file']} -p \"The capital of France is\"", "```", ""]
    if not g.get("verified_in_llama_cpp"):
        return lines + [f"Not run in llama.cpp when written ({g.get('why_not')}).", ""]
    rt, speed = g["unpruned_round_trip"], g.get("speed") or {}
    lines += [f"Run in llama.cpp (llama-cpp-python {g['llama_cpp_python']}) when written: max |logit difference| "
              f"{g['max_abs_logit_diff']:.3g} against the verified model on {g['prompts']} prompts (tolerance "
              f"{g['tolerance']:.3g}; the unpruned model's own GGUF round trip: {rt['max_abs_logit_diff']:.3g}), "
              f"argmax agreement {_pct(g['argmax_agreement'])}.", ""]
    if "prompt_speedup" in speed:
        sp = speed
        lines += [f"llama.cpp speed ({sp['threads']} threads, against the unpruned GGUF at {g['tensor_type']}): "
                  f"prompt {sp['pruned_prompt_tokens_per_s']:,.0f} vs {sp['original_prompt_tokens_per_s']:,.0f} "
                  f"tokens/s (x{sp['prompt_speedup']:.2f}), generation {sp['pruned_generation_tokens_per_s']:,.0f} "
                  f"vs {sp['original_generation_tokens_per_s']:,.0f} tokens/s (x{sp['generation_speedup']:.2f}).", ""]
    return lines


def _how_to_load(meta: dict) -> list[str]:
    if "safetensors" not in meta.get("formats", ["safetensors"]):
        return _gguf_section(meta)
    per_layer = meta["layout"] == "per-layer"
    lines = ["## Load it", "", "```python"] + (["import prune_heads  # registers the per-layer classes"] if per_layer
                                              else []) + [
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        'model = AutoModelForCausalLM.from_pretrained("<this repo or directory>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this repo or directory>")', "```", ""]
    if per_layer:
        lines += ["Layers keep different numbers of heads, listed in `config.json` under `per_layer_heads` "
                  "(`[query heads, KV heads]` per layer; `[0, 0]`: no attention). With `pip install prune-heads` the "
                  "import above is all transformers needs; without it, `modeling_pruned.py` shipped here builds the "
                  "same model: `from_pretrained(..., trust_remote_code=True)`. vLLM serves it through prune-heads' "
                  "plugin (installed with prune-heads in vLLM's environment): `vllm serve <this repo or directory>`.",
                  ""]
    return lines + _vllm_section(meta) + _gguf_section(meta)


def _tied_note(meta: dict) -> str:
    return " (the embedding is tied to the LM head: counted once)" if meta["stats"].get("tied_embeddings") else ""


def _title(meta: dict, base: str) -> str:
    """What the weights lose: query heads and parameters, or that the heads were only silenced."""
    stats = meta["stats"]
    removed = stats.get("removed") or {}
    if stats.get("padded_to_original_shape"):
        return (f"# {code(base)}, {stats['heads_silenced']} attention heads silenced (padded to the original shape: "
                "no parameters removed)")
    heads, parameters = removed.get("query_heads", 0), removed.get("parameters", 0)
    return f"# {code(base)}, {heads} query heads and {parameters:,} parameters removed"


def _what_the_weights_hold(meta: dict) -> str:
    """What the export did to the weights, from its layout and the shapes it wrote: cut, padded or masked."""
    stats = meta["stats"]
    if not meta.get("heads_removed"):
        return "No heads were removed: the weights are the original's."
    if meta["layout"] == "masked":
        return ("The removed heads are zeroed in place (their o_proj columns are zero); every tensor keeps the "
                "original shape, so nothing is smaller: this layout is for runtimes that need the stock shape.")
    if stats.get("padded_to_original_shape"):
        return ("The removed heads are silenced, and each layer is padded back to the original head count with zero "
                "heads so that one head count fits every layer: the shapes, and the parameter count, are unchanged.")
    return "The removed heads' q/k/v rows and o_proj columns are cut from the weights."


def _provenance(meta: dict) -> str:
    """Where the heads came from and how the export was verified."""
    checked = "logits of the reloaded export against the ablated original" + (
        f", and {plain(meta.get('task') or 'the task')} on the reloaded export" if meta.get("task_eval") else "")
    source = meta.get("heads_file")
    if source:
        return (f"the heads listed in {code(source['name'])} (sha256 `{source['sha256'][:16]}`), removed as given "
                f"(no budget search); verified: {checked}")
    return (f"heads ranked by `{meta['scorer']}`, the largest set within a budget of {code(meta['budget'])} verified"
            + (f" ({meta['budget_definition']})" if meta.get("budget_definition") else "")
            + f"; then checked: {checked}")


def model_card(meta: dict) -> str:
    base = source_name(meta)
    v, heal = meta["verification"], meta.get("healing")
    lines = _front(meta) + [
        _title(meta, base), "",
        f"Pruned with prune-heads {meta['prune_heads_version']} from {code(base)}: {_provenance(meta)}. "
        f"{_what_the_weights_hold(meta)}", ""]
    lines += _summary_table(meta)
    lines += ["", f"Layout: **{meta['layout']}** ({meta['layout_reason']}).", ""]
    if heal:
        lines += [f"Healed: LoRA (rank {heal['rank']}, {', '.join(heal['targets'])}) trained for {heal['steps']} steps "
                  f"on {heal['texts']} held-out texts (seed {heal['seed']}), merged into the weights; removed and "
                  "padding heads were kept silent during training and stay removed.", ""]
    for w in meta.get("warnings", []):
        lines += [f"> **Warning:** {plain(w)}", ""]
    lines += _how_to_load(meta)
    lines += _long_context(meta)
    lines += ["## Verification", "",
              ("Reloaded from these files in the same run" if v.get("reloaded", True)
               else "The pruned model, in memory") + ": max |logit difference| against "
              + ("the healed model" if heal else "the ablated original") + " "
              f"{v['max_abs_logit_diff']:.3g} on {v['prompts']} prompts (computed in "
              f"{v.get('compared_in', v['dtype'])}, tolerance {v['tolerance']:g}).", "",
              "## Removed heads", "", "`prune_heads.json` lists the removed heads per layer (original indices), the "
              "plan (which original head sits in each new slot), the scorer, budget and source model hash.", ""]
    return "\n".join(lines)
