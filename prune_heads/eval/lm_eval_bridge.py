"""lm-evaluation-harness's model interface (``lm_eval.api.model.LM``) on the model as it is verified.

lm-eval owns the tasks: documents, prompts, few-shot exemplars, stop sequences, filters and metrics. prune-heads owns
the model: ``VerifiedLM`` is lm-eval's own ``HFLM`` (its tokenisation, batching, rolling windows and greedy generation
with a KV cache and left padding) over the loaded model, with the head set or plan applied around every forward pass
and every generation, exactly as verification applies it. Unablated, it is stock lm-eval on the same weights.

Generative tasks are also measured without labels (``generation_agreement``): a model at chance on a task still
changes when heads go, and the change is read against the unablated model's own greedy output of the same document:
whether the whole generation is the same, and, teacher-forced on that output, the share of its tokens the ablated
model predicts and the mean KL(unablated || ablated) per token.

Imported only where an lm-eval task is asked for (the ``lm-eval`` extra).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM

from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import ablate


class VerifiedLM(HFLM):
    """lm-eval's HFLM on ``lm`` with ``target`` (a HeadSet, a PrunePlan, or None) ablated in every pass."""

    def __init__(self, lm: LoadedModel, target=None, batch_size: int = 8, progress: bool = True):
        said = logging.getLogger("lm_eval.models.huggingface")
        level, _ = said.level, said.setLevel(logging.ERROR)  # its warnings about a model passed as an object
        try:
            super().__init__(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=batch_size,
                             add_bos_token=True if lm.arch.add_bos_for_eval else None)
        finally:
            said.setLevel(level)
        self.loaded, self.target, self.progress = lm, target, progress

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not self.progress)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=disable_tqdm or not self.progress)

    def ablated(self):
        return ablate(self.loaded, self.target) if self.target is not None else nullcontext()

    def _model_call(self, inps, attn_mask=None, labels=None):
        with self.ablated():
            return super()._model_call(inps, attn_mask, labels)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        with self.ablated():
            return super()._model_generate(context, max_length, stop, **generation_kwargs)


def evaluate_tasks(lm: LoadedModel, tasks: dict, target=None, batch_size: int = 8, limit: int | None = None,
                   progress: bool = True) -> dict:
    """lm-eval's ``evaluate`` of ``tasks`` (fresh lm-eval Task objects: lm-eval builds their requests) on ``lm`` with
    ``target`` ablated: its results, per-document samples and the model it ran (for teacher forcing)."""
    model = VerifiedLM(lm, target, batch_size, progress)
    out = evaluate(lm=model, task_dict=tasks, limit=limit, log_samples=True, verbosity="ERROR")
    return {"results": out["results"], "samples": out["samples"], "model": model}


@torch.no_grad()
def generation_agreement(model: VerifiedLM, reference: VerifiedLM, samples: list[dict],
                         reference_samples: list[dict]) -> list[dict]:
    """Per document of a generative task: whether ``model``'s generation equals ``reference``'s (the unablated
    model's), and, teacher-forced on ``reference``'s generation, the share of its tokens ``model`` predicts (greedy)
    and the mean KL(reference || model) per token. Documents whose reference generated nothing count as agreeing."""
    rows = []
    for mine, theirs in zip(samples, reference_samples):
        context, generated = theirs["arguments"][0][0], theirs["resps"][0][0]
        same = mine["resps"][0][0] == generated
        ctx, cont = model._encode_pair(context, generated) if generated else (model.tok_encode(context), [])
        if not cont:
            rows.append({"doc_id": theirs["doc_id"], "same_generation": same, "tokens": 0, "token_agreement": 1.0,
                         "kl_per_token": 0.0})
            continue
        ids = torch.tensor([(ctx + cont)[-(model.max_length + 1):][:-1]], device=model.loaded.device)
        n = len(cont)
        with reference.ablated():
            p = torch.log_softmax(reference.loaded.model(input_ids=ids).logits[0, -n:].float(), dim=-1)
        with model.ablated():
            q = torch.log_softmax(model.loaded.model(input_ids=ids).logits[0, -n:].float(), dim=-1)
        target = torch.tensor(cont, device=q.device)
        kl = (p.exp() * (p - q)).sum(-1).clamp(min=0.0)
        rows.append({"doc_id": theirs["doc_id"], "same_generation": same, "tokens": n,
                     "token_agreement": float((q.argmax(-1) == target).double().mean()),
                     "kl_per_token": float(kl.mean())})
    return rows


def reference_generations(lm: LoadedModel, tasks: dict, limit: int, batch_size: int = 8,
                          progress: bool = True) -> list[dict]:
    """The unablated model's own greedy generation of each of the first ``limit`` documents of each generative task
    (lm-eval's prompts, few-shot exemplars, stop sequences and ``max_gen_toks``: stock lm-eval on these weights), as
    token ids: ``{"task", "doc_id", "ids": prompt + generation (the last ``model.max_length`` tokens), "generated":
    how many of them the model generated}``, in lm-eval's document order, task by task. What ``generation_agreement``
    teacher-forces on, and the text a next-token-KL budget on generation reads (only its generated tokens)."""
    out = evaluate_tasks(lm, tasks, None, batch_size, limit, progress)
    model = out["model"]
    rows = []
    for name in tasks:
        for sample in sorted(out["samples"][name], key=lambda s: s["doc_id"]):
            context, generated = sample["arguments"][0][0], sample["resps"][0][0]
            ctx, cont = model._encode_pair(context, generated) if generated else (model.tok_encode(context), [])
            ids = (ctx + cont)[-model.max_length:]
            rows.append({"task": name, "doc_id": sample["doc_id"], "ids": ids,
                         "generated": min(len(cont), len(ids) - 1)})
    return rows
