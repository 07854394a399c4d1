"""The expensive steps of a run (scoring, task evaluations, next-token damage on text), each cached by everything it
depends on, so an interrupted or changed run repeats no finished work (see cache.py). Under torchrun each step is
shared out across the ranks and gathered back in order (parallel.py); rank 0 alone reads and writes the cache."""
from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import torch

from prune_heads.console import say
from prune_heads.data.probes import ProbeSet
from prune_heads.eval.encoding import EncodedTask, task_span
from prune_heads.eval.passes import task_loglik, task_loglik_many
from prune_heads.eval.probes import METRIC_FIELDS, ProbeResult, probe_pass
from prune_heads.eval.results import EvalResult
from prune_heads.eval.reuse import (
    Keep,
    ResidualStore,
    TaskStart,
    first_changed_layer,
    keeping,
    read_task,
    read_texts,
    reuse_limit,
    task_bytes,
    texts_bytes,
)
from prune_heads.eval.textkl import HeldOutText, TextDamage, next_token_damage
from prune_heads.heads import HeadSet, ScoreTable
from prune_heads.io.cache import ResultCache, digest, tokens_digest
from prune_heads.io.parallel import LOCAL, Ranks
from prune_heads.io.staging import StagedDirectory
from prune_heads.models.batching import text_batches
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.planner import PrunePlan
from prune_heads.scoring.hooks import score_heads


class Work:
    """The expensive steps of a run (scoring, evaluations), each cached by everything it depends on, so an
    interrupted run resumes without repeating finished work (cache.py)."""

    def __init__(self, lm: LoadedModel, staged: StagedDirectory | None, batch_size: int = 8, progress: bool = True,
                 ranks: Ranks = LOCAL):
        self.lm, self.batch_size, self.progress, self.ranks = lm, batch_size, progress, ranks
        self.cache = ResultCache(staged.cache_dir if staged is not None else None)
        self._enc_digests: dict[int, str] = {}
        self.reuse = ResidualStore(reuse_limit(lm))
        self.keep_layer: int | None = None  # where the points to come start: unablated reads keep it (reuse.py)
        import transformers

        self.model_key = {"model": lm.source.fingerprint or lm.source.spec, "revision": lm.source.revision,
                          "dtype": str(lm.dtype), "device": lm.device.type, "torch": torch.__version__,
                          "transformers": transformers.__version__, "format": 2}
        if staged is not None and staged.resumed:
            say(f"resuming: finished work is reused from {staged.cache_dir}")

    def _get(self, kind: str, key: dict) -> dict | None:
        """A cache entry as rank 0 reads it, on every rank."""
        return self.ranks.broadcast(self.cache.get(kind, key) if self.ranks.root else None)

    def finish_alone(self) -> None:
        """From here on this process works alone (rank 0 after the other ranks have left)."""
        self.ranks = LOCAL

    def _enc_digest(self, enc: EncodedTask) -> str:
        if id(enc) not in self._enc_digests:
            seqs = [it.context + [t for c in it.continuations for t in c] for it in enc.items]
            self._enc_digests[id(enc)] = tokens_digest(seqs)
        return self._enc_digests[id(enc)]

    def recall(self, what: str, key: dict) -> dict | None:
        """A decision the run made before (``remember``), as rank 0 reads it from the cache: a resumed run takes it
        again instead of making it anew from reads the cache answered in no time."""
        return self._get(what, {**self.model_key, "what": what, **key})

    def remember(self, what: str, key: dict, value: dict) -> dict:
        """Rank 0's ``value`` (every rank then acts on the same decision), cached for ``recall``."""
        value = self.ranks.broadcast(value if self.ranks.root else None)
        if self.ranks.root:
            self.cache.put(what, {**self.model_key, "what": what, **key}, value)
        return value

    def scores(self, seqs: list[list[int]]) -> ScoreTable:
        key = {**self.model_key, "what": "scores", "tokens": tokens_digest(seqs), "batch": self.batch_size}
        hit = self._get("scores", key)
        if hit is not None:
            counts = hit.pop("_token_counts").tolist()
            return ScoreTable(hit, counts)
        table = self._score_shared(seqs)
        self.cache.put("scores", key, {**table.per_input, "_token_counts": torch.tensor(table.token_counts)})
        return table

    @staticmethod
    def ablation_key(target) -> dict | None:
        if target is None or (isinstance(target, HeadSet) and not target):
            return None
        if isinstance(target, PrunePlan):
            return {"plan": target.to_json()}
        if isinstance(target, torch.Tensor):  # a [L, H] or per-question [N, L, H] mask (study's dynamic ablation)
            m = target.detach().to(torch.float32).cpu().contiguous()
            return {"masks": hashlib.sha256(m.numpy().tobytes()).hexdigest(), "shape": list(m.shape)}
        return {"heads": target.to_json()}

    def _eval_key(self, enc, target, model_key=None):
        ablation = self.ablation_key(target)
        return ablation, {**(model_key or self.model_key), "what": "task", "task": enc.task,
                          "tokens": self._enc_digest(enc), "ablation": ablation, "batch": self.batch_size}

    def text_damage(self, texts: HeldOutText, target) -> TextDamage:
        """The next-token damage of each held-out text (KL(unablated || ablated) in nats, greedy agreement, all
        agreeing; only each text's ``scored`` last tokens where given, textkl.next_token_damage); cached like
        evaluations."""
        ablation = self.ablation_key(target)
        if ablation is None:
            return TextDamage.empty(len(texts))
        sequences, scored = texts.sequences, texts.scored
        key = {**self.model_key, "what": "text_damage", "tokens": tokens_digest(sequences), "ablation": ablation,
               "batch": self.batch_size, **({"scored": tokens_digest([scored])} if scored is not None else {})}
        hit = self._get("textdamage", key)
        if hit is None:
            hit = self._damage_shared(sequences, target, scored, texts.source).to_tensors()
            self.cache.put("textdamage", key, hit)
        return TextDamage(**hit)

    def lm_eval_cache(self, target) -> Path | None:
        """Where lm-eval's own request cache of this model with ``target`` ablated lives (an SQLite file beside the
        other entries, ``lm_eval_bridge.evaluate_tasks``), None without a cache directory (or off rank 0)."""
        if self.cache.directory is None or not self.ranks.root:
            return None
        key = {**self.model_key, "what": "lm_eval", "ablation": self.ablation_key(target), "batch": self.batch_size,
               "generation": self._generation_inputs()}
        return self.cache.directory / f"lm-eval-{digest(key)[:32]}.sqlite"

    def _generation_inputs(self) -> str:
        """A digest of what lm-eval's responses depend on beside the weights and each request (which lm-eval's
        cache hashes): the generation config (end-of-sequence tokens, ...) and the tokenizer (its vocabulary,
        merges, normalisation, special tokens and chat template)."""
        if not hasattr(self, "_generation_digest"):
            tok = self.lm.tokenizer
            backend = getattr(tok, "backend_tokenizer", None)
            parts = [self.lm.model.generation_config.to_json_string(use_diff=False),
                     backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items())),
                     str(getattr(tok, "chat_template", None)), repr(sorted(tok.special_tokens_map.items())),
                     type(tok).__name__]
            self._generation_digest = digest({"generation_inputs": parts})
        return self._generation_digest

    def probe(self, probe: ProbeSet, target, label: str = "") -> ProbeResult:
        """A long-context probe with ``target`` ablated (None: unablated), cached like evaluations. Every rank reads
        every item (probes are a few dozen prompts)."""
        key = {**self.model_key, "what": "probe", "probe": probe.name, "metric": probe.metric, "fields": METRIC_FIELDS,
               "tokens": tokens_digest([list(it.ids) + [it.target, it.length] for it in probe.items]),
               "ablation": self.ablation_key(target)}
        hit = self._get("probe", key)
        if hit is not None:
            return ProbeResult(probe, *(hit[f] for f in METRIC_FIELDS))
        texts, what = [it.ids for it in probe.items], f"probe {probe.name}"
        size = texts_bytes(self.lm, texts)
        if key["ablation"] is None and self.reuse.wants(key["tokens"], self.keep_layer, size):
            with keeping(self.lm, self.keep_layer) as kept:  # the unablated read leaves the points' start
                result = probe_pass(self.lm, probe, None, self.progress, label)
            self.reuse.put(what, key["tokens"], TaskStart(self.keep_layer, texts=[k[0] for k in kept]))
        else:
            layer = first_changed_layer(target)
            start = self.reuse.start(what, key["tokens"], layer, size, lambda: read_texts(self.lm, texts, layer))
            result = probe_pass(self.lm, probe, target, self.progress, label, start)
        self.cache.put("probe", key, result.to_tensors())
        return result

    def task_results(self, enc: EncodedTask, head_sets: list[HeadSet], labels: list[str]) -> list[EvalResult]:
        """Several static head sets at once (task_loglik_many); cached per set like ``task_result``."""
        questions = [it.question for it in enc.items]
        results: dict[int, EvalResult] = {}
        todo = []
        for i, hs in enumerate(head_sets):
            hit = self._get("eval", self._eval_key(enc, hs)[1])
            if hit is not None:
                results[i] = EvalResult(questions, hit["loglik"], labels[i])
            else:
                todo.append(i)
        if todo:
            label = f"{len(todo)} head sets together ({', '.join(labels[i] for i in todo)})"
            todo_sets = [head_sets[i] for i in todo]
            layers = [first_changed_layer(hs) for hs in todo_sets]
            layer = None if None in layers else min(layers)
            many = self._on_task_share(enc, None, lambda part, _: task_loglik_many(
                self.lm, part, todo_sets, self.batch_size, self.progress, label, self._task_start(part, layer)))
            for i, res in zip(todo, many):
                self.cache.put("eval", self._eval_key(enc, head_sets[i])[1], {"loglik": res.loglik})
                res.label = labels[i]
                results[i] = res
        return [results[i] for i in range(len(head_sets))]

    def task_result(self, enc: EncodedTask, target: "HeadSet | PrunePlan | None", label: str = "",
                 lm: LoadedModel | None = None, model_key: dict | None = None) -> EvalResult:
        ablation, key = self._eval_key(enc, target, model_key)
        hit = self._get("eval", key)
        questions = [it.question for it in enc.items]
        if hit is not None:
            return EvalResult(questions, hit["loglik"], label)
        result = self._on_task_share(enc, target if ablation else None, lambda part, masks: [self._task_pass(
            part, masks, label, lm, first_changed_layer(target) if ablation else None)])[0]
        self.cache.put("eval", key, {"loglik": result.loglik})
        return result

    def _task_pass(self, enc: EncodedTask, masks, label: str, lm: LoadedModel | None, layer: int | None
                   ) -> EvalResult:
        """One task read: started at ``layer`` where a kept start serves it, or (unablated) leaving the start of the
        points to come (``keep_layer``) when it is wanted. Another model's passes (``lm``) do neither."""
        if lm is not None:
            return task_loglik(lm, enc, masks, self.batch_size, self.progress, label=label)
        key, size = self._task_key(enc), task_bytes(self.lm, enc)
        keep = Keep(self.keep_layer) if masks is None and self.reuse.wants(key, self.keep_layer, size) else None
        start = None if keep is not None else self._task_start(enc, layer)
        result = task_loglik(self.lm, enc, masks, self.batch_size, self.progress, label, start, keep)
        if keep is not None:
            self.reuse.put(enc.task, key, keep.start())
        return result

    def task_result_of(self, enc: EncodedTask, lm: LoadedModel, identity: str, label: str = "") -> EvalResult:
        """The task on another model than the run's (an export reloaded, a healed or adapter-sliced model), cached
        by ``identity``: what that model is (e.g. ``export:<sha256 of its files>``)."""
        return self.task_result(enc, None, label, lm=lm, model_key={**self.model_key, "model": identity})

    def cached_task_result_of(self, enc: EncodedTask, identity: str, label: str = "") -> EvalResult | None:
        """``evaluate_model``'s result when it is cached (a model expensive to build is then never built)."""
        hit = self._get("eval", self._eval_key(enc, None, {**self.model_key, "model": identity})[1])
        return None if hit is None else EvalResult([it.question for it in enc.items], hit["loglik"], label)

    def _task_start(self, enc: EncodedTask, layer: int | None) -> TaskStart | None:
        """Where ``enc``'s passes start for a point whose first changed layer is ``layer`` (reuse.py), None for a
        full pass."""
        if not layer:
            return None
        return self.reuse.start(enc.task, self._task_key(enc), layer, task_bytes(self.lm, enc),
                                lambda: read_task(self.lm, enc, layer, self.batch_size))

    @staticmethod
    def _task_key(enc: EncodedTask) -> str:
        return tokens_digest([it.context for it in enc.items] + [[len(s.prefix)] for s in enc.subjects])

    # -- sharing a step out across ranks (one rank: the step as it is) ---------------------------------------------

    def _score_shared(self, seqs: list[list[int]]) -> ScoreTable:
        """Head scores, each rank scoring its deal of the longest-first batches."""
        if self.ranks.size == 1:
            return score_heads(self.lm, seqs, self.batch_size, self.progress)
        tables: dict[str, torch.Tensor] = {}
        def step(mine):
            return score_heads(self.lm, [seqs[i] for i in mine], self.batch_size, self.progress).per_input

        for idx, part in self._on_text_share(seqs, False, step):
            for key, value in part.items():
                tables.setdefault(key, value.new_empty((len(seqs), *value.shape[1:])))[idx] = value
        return ScoreTable(tables, [len(s) for s in seqs])

    def _damage_shared(self, sequences: list[list[int]], target, scored: list[int] | None,
                       source: str) -> TextDamage:
        """Next-token damage per text, each rank taking its deal of the longest-first batches."""
        if self.ranks.size == 1:
            return next_token_damage(self.lm, sequences, target, self.batch_size, scored, source)
        out = TextDamage.empty(len(sequences))
        per_row = isinstance(target, torch.Tensor) and target.dim() == 3  # one mask per text

        def step(mine):
            return next_token_damage(self.lm, [sequences[i] for i in mine], target[mine] if per_row else target,
                                     self.batch_size, None if scored is None else [scored[i] for i in mine],
                                     source).to_tensors()

        for idx, part in self._on_text_share(sequences, True, step):
            for name, values in part.items():
                getattr(out, name)[idx] = values
        return out

    def _on_text_share(self, sequences: list[list[int]], full_logits: bool, step) -> list[tuple[list[int], object]]:
        """``step(indices)`` on this rank's deal of the single-process batches (batching.text_batches: ``step``
        cuts this rank's share of ``sequences`` into the same batches); every rank's (indices, result) back, ranks
        with no batch left out."""
        batches = text_batches(self.lm, sequences, self.batch_size, full_logits)
        mine = [i for batch in self.ranks.deal(batches) for i in batch]
        parts = self.ranks.gather((mine, step(mine) if mine else None))
        return [(idx, part) for idx, part in parts if idx]

    def _on_task_share(self, enc: EncodedTask, masks, step) -> list[EvalResult]:
        """``step(task part, its masks) -> [EvalResult, ...]`` on this rank's span of whole subjects (cut inside a
        subject only when there are fewer subjects than ranks), gathered into results on every question in order."""
        if self.ranks.size == 1:
            return step(enc, masks)
        sizes = [len(s.items) for s in enc.subjects]
        cuts = list(itertools.accumulate(sizes)) if len(sizes) >= self.ranks.size else None
        lo, hi = self.ranks.span(sizes, cuts)
        if isinstance(masks, torch.Tensor) and masks.dim() == 3:  # a mask per question
            masks = masks[lo:hi]
        results = step(task_span(enc, lo, hi), masks)
        width = enc.num_choices
        parts = self.ranks.gather([torch.nn.functional.pad(r.loglik, (0, width - r.loglik.shape[-1]),
                                                           value=float("-inf")) for r in results])
        questions = [it.question for it in enc.items]
        return [EvalResult(questions, torch.cat([p[s] for p in parts]), r.label) for s, r in enumerate(results)]
