"""The model card (README.md with Hub metadata) of an export."""
from __future__ import annotations

import yaml


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def model_card(meta: dict) -> str:
    src = meta["source_model"]
    base = src.get("hub_id") or src.get("spec")
    front = {
        "base_model": base,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["pruned", "attention-head-pruning", "prune-heads", meta["layout"]],
    }
    v = meta["verification"]
    before, after = meta["stats"]["before"], meta["stats"]["after"]
    mmlu = meta.get("mmlu") or {}
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {base}, {meta['heads_removed']} attention heads removed",
        "",
        f"Pruned with [prune-heads](https://github.com/prune-heads/prune-heads) {meta['prune_heads_version']}: "
        f"heads ranked by `{meta['scorer']}`, the largest set within a budget of {meta['budget']} verified"
        + (f" ({meta['budget_definition']})" if meta.get("budget_definition") else "")
        + ", then their q/k/v rows and o_proj columns removed.",
        "",
        "| | before | after |",
        "|---|---|---|",
        f"| query heads | {before['query_heads']} | {after['query_heads']} |",
        f"| KV heads | {before['kv_heads']} | {after['kv_heads']} |",
        f"| parameters | {before['parameters']:,} | {after['parameters']:,} |",
        f"| KV cache per token | {before['kv_cache_bytes_per_token']:,} B | {after['kv_cache_bytes_per_token']:,} B |",
    ]
    if mmlu:
        ci = mmlu.get("ci95_points", [float("nan")] * 2)
        lines.append(f"| {meta.get('task', 'mmlu')} accuracy ({mmlu['n']} questions) | {_pct(mmlu['baseline_accuracy'])} | "
                     f"{_pct(mmlu['pruned_accuracy'])} (delta {mmlu['delta_points']:+.2f} pt, 95% CI [{ci[0]:+.2f}, {ci[1]:+.2f}]) |")
        if "kl_answer_nats" in mmlu:
            lines.append(f"| answer KL from the original | 0 | {mmlu['kl_answer_nats']:.4f} nat "
                         f"({_pct(mmlu['agreement_with_unablated'])} same answers) |")
    heal = meta.get("healing")
    if heal:
        before_heal = (mmlu.get("before_healing") or {}).get("accuracy")
        lines.append(f"| after LoRA healing ({heal['steps']} steps) | training loss {heal['loss_first']:.4f} | "
                     f"{heal['loss_last']:.4f}" + (f"; MMLU before healing {_pct(before_heal)}, after "
                                                    f"{_pct(mmlu['pruned_accuracy'])}" if before_heal is not None else "") + " |")
    lines += ["", f"Layout: **{meta['layout']}** ({meta['layout_reason']}).", ""]
    if heal:
        lines += [f"Healed: LoRA (rank {heal['rank']}, {', '.join(heal['targets'])}) trained for {heal['steps']} steps on "
                  f"{heal['texts']} held-out texts (seed {heal['seed']}), merged into the weights; removed and padding "
                  "heads were kept silent during training and stay removed.", ""]
    for w in meta.get("warnings", []):
        lines += [f"> **Warning:** {w}", ""]
    lines += ["## Load it", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    trust = ", trust_remote_code=True" if meta["layout"] == "per-layer" else ""
    lines += [f'model = AutoModelForCausalLM.from_pretrained("<this repo or directory>"{trust})',
              'tokenizer = AutoTokenizer.from_pretrained("<this repo or directory>")', "```", ""]
    if meta["layout"] == "per-layer":
        lines += ["Layers keep different numbers of heads, recorded in `config.json` under `per_layer_config`; the small "
                  "`modeling_pruned.py` shipped here builds each layer from it, hence `trust_remote_code=True`.", ""]
    lines += ["## Verification", "",
              "Reloaded from these files in the same run: max |logit difference| against "
              + ("the healed model" if heal else "the ablated original") + " "
              f"{v['max_abs_logit_diff']:.3g} on {v['prompts']} prompts (computed in {v.get('compared_in', v['dtype'])}, "
              f"tolerance {v['tolerance']:g}).", "",
              "## Removed heads", "", "`prune_heads.json` lists the removed heads per layer (original indices), the plan "
              "(which original head sits in each new slot), the scorer, budget and source model hash.", ""]
    return "\n".join(lines)
