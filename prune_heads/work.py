"""The expensive steps of a run (scoring, task evaluations, text KL), each cached by everything it depends on, so an
interrupted or changed run repeats no finished work (see cache.py)."""
from __future__ import annotations

import hashlib

import click
import torch

from .cache import ResultCache, tokens_digest
from .evaluation import EncodedTask, EvalResult, evaluate, evaluate_many, in_order_of, next_token_kl, restricted
from .fileio import StagedDirectory
from .heads import HeadSet, ScoreTable
from .models.loading import LoadedModel
from .planning import PrunePlan
from .scoring import score_heads


class Work:
    """The expensive steps of a run (scoring, evaluations), each cached by everything it depends on, so an
    interrupted run resumes without repeating finished work (cache.py)."""

    def __init__(self, lm: LoadedModel, stage: StagedDirectory, batch_size: int = 8, progress: bool = True):
        self.lm, self.batch_size, self.progress = lm, batch_size, progress
        self.cache = ResultCache(stage.cache_dir)
        self._enc_digests: dict[int, str] = {}
        import transformers

        self.model_key = {"model": lm.source.fingerprint or lm.source.spec, "revision": lm.source.revision,
                          "dtype": str(lm.dtype), "device": lm.device.type, "torch": torch.__version__,
                          "transformers": transformers.__version__, "format": 2}
        if stage.resumed:
            click.secho(f"resuming: finished work is reused from {stage.cache_dir}", err=True)

    def _enc_digest(self, enc: EncodedTask) -> str:
        if id(enc) not in self._enc_digests:
            seqs = [it.context + [t for c in it.continuations for t in c] for it in enc.items]
            self._enc_digests[id(enc)] = tokens_digest(seqs)
        return self._enc_digests[id(enc)]

    def scores(self, seqs: list[list[int]]) -> ScoreTable:
        key = {**self.model_key, "what": "scores", "tokens": tokens_digest(seqs), "batch": self.batch_size}
        hit = self.cache.get("scores", key)
        if hit is not None:
            counts = hit.pop("_token_counts").tolist()
            return ScoreTable(hit, counts)
        table = score_heads(self.lm, seqs, self.batch_size, self.progress)
        self.cache.put("scores", key, {**table.per_input, "_token_counts": torch.tensor(table.token_counts)})
        return table

    @staticmethod
    def _ablation_key(target) -> dict | None:
        if target is None or (isinstance(target, HeadSet) and not target):
            return None
        if isinstance(target, PrunePlan):
            return {"plan": target.to_json()}
        if isinstance(target, torch.Tensor):  # a [L, H] or per-question [N, L, H] mask (study's dynamic ablation)
            m = target.detach().to(torch.float32).cpu().contiguous()
            return {"masks": hashlib.sha256(m.numpy().tobytes()).hexdigest(), "shape": list(m.shape)}
        return {"heads": target.to_json()}

    def _eval_key(self, enc, target, model_key=None):
        ablation = self._ablation_key(target)
        return ablation, {**(model_key or self.model_key), "what": "task", "task": enc.task,
                          "tokens": self._enc_digest(enc), "ablation": ablation, "batch": self.batch_size}

    def text_kl(self, sequences: list[list[int]], target) -> float:
        """Mean next-token KL(unablated || ablated) over held-out texts, nats; cached like evaluations."""
        return float(self.text_kls(sequences, target).mean())

    def text_kls(self, sequences: list[list[int]], target) -> torch.Tensor:
        """Next-token KL(unablated || ablated) of each held-out text, nats; cached like evaluations."""
        ablation = self._ablation_key(target)
        if ablation is None:
            return torch.zeros(len(sequences), dtype=torch.float64)
        key = {**self.model_key, "what": "kl_text", "tokens": tokens_digest(sequences), "ablation": ablation,
               "batch": self.batch_size}
        hit = self.cache.get("kltext", key)
        if hit is None:
            hit = {"kl": next_token_kl(self.lm, sequences, target, self.batch_size)}
            self.cache.put("kltext", key, hit)
        return hit["kl"]

    def evaluate_group(self, enc: EncodedTask, head_sets: list[HeadSet], labels: list[str]) -> list[EvalResult]:
        """Several static head sets at once (evaluate_many); cached per set like ``evaluate``."""
        questions = [it.question for it in enc.items]
        results: dict[int, EvalResult] = {}
        todo = []
        for i, hs in enumerate(head_sets):
            hit = self.cache.get("eval", self._eval_key(enc, hs)[1])
            if hit is not None:
                results[i] = EvalResult(questions, hit["loglik"], labels[i])
            else:
                todo.append(i)
        if todo:
            label = f"{len(todo)} head sets together ({', '.join(labels[i] for i in todo)})"
            for i, res in zip(todo, evaluate_many(self.lm, enc, [head_sets[i] for i in todo], self.batch_size,
                                                  self.progress, label)):
                self.cache.put("eval", self._eval_key(enc, head_sets[i])[1], {"loglik": res.loglik})
                res.label = labels[i]
                results[i] = res
        return [results[i] for i in range(len(head_sets))]

    def evaluate(self, enc: EncodedTask, target: "HeadSet | PrunePlan | None", label: str = "",
                 lm: LoadedModel | None = None, model_key: dict | None = None) -> EvalResult:
        ablation, key = self._eval_key(enc, target, model_key)
        hit = self.cache.get("eval", key)
        questions = [it.question for it in enc.items]
        if hit is not None:
            return EvalResult(questions, hit["loglik"], label)
        result = evaluate(lm or self.lm, enc, target if ablation else None, self.batch_size,
                          self.progress, label=label)
        self.cache.put("eval", key, {"loglik": result.loglik})
        return result

    def evaluate_sequential(self, blocks: list[EncodedTask], target, label: str, baseline: EvalResult,
                            stop) -> EvalResult:
        """Evaluate ``target`` block by block (each block cached on its own) and stop as soon as ``stop(partial,
        baseline on the same questions)`` says the point is decided. Returns the questions evaluated so far, in
        block order, with ``meta["stopped_early"]``; the full result in the baseline's order when every block ran."""
        done: list[EvalResult] = []
        for b, block in enumerate(blocks):
            done.append(self.evaluate(block, target, f"{label} [{b + 1}/{len(blocks)}]"))
            width = max(r.loglik.shape[1] for r in done)
            partial = EvalResult([q for r in done for q in r.questions], torch.cat(
                [torch.nn.functional.pad(r.loglik, (0, width - r.loglik.shape[1]), value=float("-inf")) for r in done]),
                label)
            if b + 1 == len(blocks):
                return in_order_of(baseline, partial)
            if stop(partial, restricted(baseline, partial)):
                partial.meta.update(stopped_early=True, questions_evaluated=len(partial.questions))
                return partial
        raise AssertionError("no blocks")

    def evaluate_built(self, enc: EncodedTask, build, model_key: dict, label: str = "") -> EvalResult:
        """Evaluate a model that is expensive to make (a healed one): ``build()`` runs only on a cache miss."""
        _, key = self._eval_key(enc, None, model_key)
        hit = self.cache.get("eval", key)
        if hit is not None:
            return EvalResult([it.question for it in enc.items], hit["loglik"], label)
        return self.evaluate(enc, None, label, lm=build(), model_key=model_key)

    def exported_evaluator(self, enc: EncodedTask):
        """Evaluate a reloaded export, cached by the content of the files it was loaded from."""

        def run(reloaded: LoadedModel, files_digest: str) -> EvalResult:
            key = {**self.model_key, "model": f"export:{files_digest}"}
            return self.evaluate(enc, None, "exported model", lm=reloaded, model_key=key)

        return run
