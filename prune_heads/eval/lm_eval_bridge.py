"""lm-evaluation-harness's model interface (``lm_eval.api.model.LM``) on the model as it is verified.

lm-eval owns the tasks: documents, prompts, few-shot exemplars, stop sequences, filters and metrics. prune-heads owns
the model: ``VerifiedLM`` is lm-eval's own ``HFLM`` (its tokenisation, batching and rolling windows) over the loaded
model, with the head set or plan applied around every forward pass and every generation, exactly as verification
applies it. Greedy generation runs through ``eval.generation`` (a shared few-shot prefix computed once, an in-place KV
cache, finished documents leaving the batch): the text HFLM generates for each document alone. Unablated, it is stock
lm-eval on the same weights.

Generative tasks are also measured without labels (``generation_agreement``): a model at chance on a task still
changes when heads go, and the change is read against the unablated model's own greedy output of the same document:
whether the whole generation is the same, and, teacher-forced on that output (its tokens as generated), the share of
its tokens at which the ablated model predicts what the unablated model does and the mean KL(unablated || ablated) per
token: the measures a text budget reads (``--metric kl-text``, ``token-agreement``, ``same-generation``).

Imported only where an lm-eval task is asked for (the ``lm-eval`` extra).
"""
from __future__ import annotations

import json
import logging
from contextlib import closing, nullcontext
from pathlib import Path
from typing import Iterator, MutableMapping

from lm_eval.api.model import CachingLM
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from prune_heads.console import say
from prune_heads.data.lm_eval_index import code_of, raised_in_user_code
from prune_heads.errors import UserError
from prune_heads.eval.generation import GreedyRequest, greedy_batches
from prune_heads.eval.textkl import next_token_damage
from prune_heads.io.parallel import LOCAL, Ranks
from prune_heads.models.finite import finite_logits
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import ablate


class VerifiedLM(HFLM):
    """lm-eval's HFLM on ``lm`` with ``target`` (a HeadSet, a PrunePlan, or None) ablated in every pass."""

    def __init__(self, lm: LoadedModel, target=None, batch_size: int = 8, progress: bool = True,
                 ranks: Ranks = LOCAL):
        said = logging.getLogger("lm_eval.models.huggingface")
        level, _ = said.level, said.setLevel(logging.ERROR)  # its warnings about a model passed as an object
        try:
            super().__init__(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=batch_size,
                             add_bos_token=True if lm.arch.add_bos_for_eval else None)
        finally:
            said.setLevel(level)
        # Under torchrun every rank runs lm-eval on every document (lm-eval sees one process) and the greedy
        # generations are shared out batch by batch: each rank generates the batches one process would, dealt
        # round-robin, and every rank gets them all (the same numbers as one process).
        self.loaded, self.target, self.progress, self.ranks = lm, target, progress, ranks
        # json [context, generation arguments] -> the prompt's token ids and the tokens generated for it, as
        # generated (a dict, or with a cache the table beside lm-eval's own: ``evaluate_tasks``)
        self.generated: MutableMapping[str, tuple[list[int], list[int]]] = {}

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self._finite(requests):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        with self._finite(requests):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _finite(self, requests):
        """Non-finite logits in any pass for ``requests`` stop the evaluation (``models.finite``), naming their
        tasks."""
        names = sorted({str(getattr(r, "task_name", None) or "an lm-eval task") for r in requests})
        return finite_logits(self.loaded, "lm-eval " + ", ".join(names), self.target)

    def generate_until(self, requests, disable_tqdm: bool = False):
        """lm-eval's greedy requests through ``eval.generation`` (the same text HFLM generates for each document alone,
        faster); anything else (sampling, a thinking-token setting, a model whose generation config processes
        logits, sliding-window attention) through HFLM's own ``generate_until``."""
        quiet = disable_tqdm or not self.progress
        empty = next((r for r in requests if not str(r.args[0]).strip()), None)
        if empty is not None:  # nothing to condition on: transformers cannot generate from zero tokens
            where = f"lm-eval task {getattr(empty, 'task_name', '?')}, document {getattr(empty, 'doc_id', '?')}"
            raise UserError(f"{where}: its prompt is empty (doc_to_text gave no text), so there is nothing to "
                            "generate from; fix the task's doc_to_text or drop the document")
        with self._finite(requests):
            return self._generate_until(requests, quiet)

    def _generate_until(self, requests, quiet: bool) -> list[str]:
        if not (all(_greedy(r.args[1]) for r in requests) and _plain_generation(self.model, self.think_end_token)
                and self.loaded.arch.full_attention(self.model.config)):
            return super().generate_until(requests, disable_tqdm=quiet)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):  # as HFLM: one group per set of generation arguments
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str] = [""] * len(requests)
        with (tqdm(total=len(requests), disable=quiet or not self.ranks.root, desc="Running generate_until requests")
              as bar, self.ablated()):
            for key, idx in groups.items():
                for i, text in self._generate_group([requests[i] for i in idx], key):
                    results[idx[i]] = text
                    bar.update(1)
        return results

    def _generate_group(self, requests: list, key: str) -> Iterator[tuple[int, str]]:
        """(index in ``requests``, generated text) as each batch finishes, each handed to lm-eval's cache hook (a
        ``CachingLM`` keeps it: an interrupted evaluation resumes from the last finished batch)."""
        contexts, gen_kwargs = [r.args[0] for r in requests], requests[0].args[1]
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id,
                                                                                     skip_special_tokens=False))
        max_new = kwargs.pop("max_gen_toks")
        prompts = []
        for c in contexts:  # HFLM's encoding of each context, left-truncated to leave room for the generation
            ids, mask = self.tok_batch_encode([c], left_truncate_len=self.max_length - max_new,
                                              truncation=self.truncation)
            prompts.append(ids[0][mask[0].bool()].tolist())
        eos = self.model.generation_config.eos_token_id
        request = GreedyRequest(max_new, tuple(until), frozenset([eos] if isinstance(eos, int) else eos or []))
        def finished(i: int, g: list[int]) -> tuple[int, str]:
            self.generated[json.dumps([contexts[i], key])] = (prompts[i], g)
            text = postprocess_generated_text(self.tok_decode(g), until, self.think_end_token)
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
            return i, text

        mine = {}
        for chunk, generated in greedy_batches(self.loaded, prompts, request, self.batch_size, self.ranks):
            if self.ranks.size == 1:
                yield from (finished(i, g) for i, g in zip(chunk, generated))
            else:
                mine.update(zip(chunk, generated))
        if self.ranks.size > 1:  # every rank's batches, on every rank
            shared = {i: g for part in self.ranks.gather(mine) for i, g in part.items()}
            yield from (finished(i, shared[i]) for i in sorted(shared))

    def generated_ids(self, sample: dict) -> tuple[list[int], list[int]]:
        """(prompt ids, generated ids) of a generative sample this model generated: the tokens exactly as generated
        (the one that ended the generation included) where ``eval.generation`` generated them, else the logged text
        encoded after its prompt (HFLM's own generation)."""
        context, gen_kwargs = sample["arguments"][0]
        raw = self.generated.get(json.dumps([context, json.dumps(gen_kwargs, sort_keys=True, default=str)]))
        if raw is not None:
            return raw
        generated = sample["resps"][0][0]
        return self._encode_pair(context, generated) if generated else (self.tok_encode(context), [])

    def ablated(self):
        return ablate(self.loaded, self.target) if self.target is not None else nullcontext()



    def _model_call(self, inps, attn_mask=None, labels=None):
        with self.ablated():
            return super()._model_call(inps, attn_mask, labels)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        with self.ablated():
            return super()._model_generate(context, max_length, stop, **generation_kwargs)


def _greedy(gen_kwargs: dict) -> bool:
    kwargs = normalize_gen_kwargs(gen_kwargs)
    return not kwargs.get("do_sample") and not ({"max_length", "num_beams", "num_return_sequences"} & set(kwargs))


LOGITS_PROCESSING = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                     "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                     "sequence_bias", "encoder_repetition_penalty")


def _plain_generation(model, think_end_token) -> bool:
    """Whether greedy ``model.generate`` is a plain argmax per token (no logits processor from the model's
    generation config) and lm-eval keeps the whole generation (no thinking-token cut by token id)."""
    config = model.generation_config
    defaults = {"repetition_penalty": 1.0, "min_length": 0, "min_new_tokens": None, "no_repeat_ngram_size": 0}
    return not isinstance(think_end_token, int) and all(
        getattr(config, k, None) in (None, defaults.get(k)) for k in LOGITS_PROCESSING)


class DataCachingLM(CachingLM):
    """lm-eval's ``CachingLM`` (its request hashing, lookups and cache hook), its SQLite values stored as JSON rather
    than pickles: a cache is data the tool wrote, and reading it can never run code. Responses are JSON's own types
    (numbers, booleans, strings, lists)."""

    def __init__(self, lm: HFLM, cache_db: Path):
        self.lm, self.cache_db = lm, str(cache_db)
        self.dbdict = data_table(cache_db, "unnamed")  # the table CachingLM uses
        lm.set_cache_hook(self.get_cache_hook())


def data_table(path: Path, table: str):
    """An SQLite table of JSON values (``sqlitedict`` with JSON coding), checked whole before it is opened: a file
    that is not SQLite, or holds a value that is not JSON (a pickle among them: never unpickled), was not written by
    this tool as it stands; it is said in one line, discarded and its requests computed again. A directory that
    cannot be written is refused in one line."""
    import tempfile

    from sqlitedict import SqliteDict

    try:
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise UserError(f"lm-eval's request cache {path} cannot be written ({e.strerror}); make {path.parent} "
                        "writable, or choose another `out`") from None
    if not _json_or_absent(path):
        say(f"lm-eval's request cache {path.name} is damaged or was not written by prune-heads; it is discarded "
            "and its requests are computed again")
        path.unlink()
    return SqliteDict(str(path), tablename=table, autocommit=True, encode=_json_bytes, decode=json.loads)


def _json_or_absent(path: Path) -> bool:
    """Whether ``path`` is absent, or an SQLite file whose every table holds JSON values only: read with the standard
    library, read-only, every value parsed as JSON (nothing is unpickled). The whole file is judged before any of its
    tables is opened (a file discarded under an open table would leave that table writing nowhere)."""
    import sqlite3

    if not path.exists():
        return True
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                for (value,) in db.execute(f'SELECT value FROM "{table}"'):
                    json.loads(value)
        return True
    except (sqlite3.DatabaseError, ValueError, UnicodeDecodeError, TypeError):
        return False


def _json_bytes(value) -> bytes:
    return json.dumps(value).encode("utf-8")


def evaluate_tasks(lm: LoadedModel, tasks: dict, target=None, batch_size: int = 8, limit: int | None = None,
                   progress: bool = True, cache_db: Path | None = None, ranks: Ranks = LOCAL) -> dict:
    """lm-eval's ``evaluate`` of ``tasks`` (fresh lm-eval Task objects: lm-eval builds their requests) on ``lm`` with
    ``target`` ablated: its results, its groups' aggregates (where ``tasks`` keeps lm-eval's tree and a group
    aggregates), per-document samples and the model it ran (for teacher forcing).

    ``cache_db``: lm-eval's request cache (``DataCachingLM``, an SQLite file of JSON values) for this model and
    ``target``: each request's response is kept as it is computed, so an interrupted evaluation resumes and a later
    one with more documents computes only the new ones; the generated token ids are kept beside it (table
    ``generated_ids``).
    ``ranks``: under torchrun, the greedy generations are shared out batch by batch (``VerifiedLM``)."""
    model = VerifiedLM(lm, target, batch_size, progress, ranks)
    runs = model
    if cache_db is not None:
        model.generated = data_table(cache_db, "generated_ids")
        runs = DataCachingLM(model, cache_db)
    said = logging.getLogger("lm_eval.api.model")
    level, _ = said.level, said.setLevel(logging.WARNING)  # CachingLM's per-call info lines
    try:
        out = evaluate(lm=runs, task_dict=getattr(tasks, "tree", tasks), limit=limit, log_samples=True,
                       verbosity="ERROR")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (the task's own code may raise anything: name it)
        raised_in_user_code(e, code_of(tasks), ", ".join(tasks))
        raise
    finally:
        said.setLevel(level)
    return {"results": out["results"], "groups": out.get("groups", {}), "samples": out["samples"], "model": model}


def generation_agreement(model: VerifiedLM, reference: VerifiedLM, samples: list[dict],
                         reference_samples: list[dict]) -> list[dict]:
    """Per document of a generative task: whether ``model``'s generation (text) equals ``reference``'s (the unablated
    model's), and, teacher-forced on ``reference``'s generation (``reference_ids``), the share of its tokens at which
    ``model`` predicts (greedy) what the unablated model predicts and the mean KL(unablated || model) per token:
    ``textkl.next_token_damage``, what a text budget reads. Documents whose reference generated nothing count as
    agreeing."""
    ids = [reference_ids(reference, s) for s in reference_samples]
    read = [i for i, (_, n) in enumerate(ids) if n > 0]
    where = {i: j for j, i in enumerate(read)}  # document -> its row in ``damage``
    damage = next_token_damage(model.loaded, [ids[i][0] for i in read], model.target, model.batch_size,
                               [ids[i][1] for i in read]) if model.target is not None and read else None
    rows = []
    for i, (mine, theirs) in enumerate(zip(samples, reference_samples)):
        row = {"doc_id": theirs["doc_id"], "same_generation": mine["resps"][0][0] == theirs["resps"][0][0],
               "tokens": ids[i][1], "token_agreement": 1.0, "kl_per_token": 0.0}
        if damage is not None and i in where:
            j = where[i]
            row.update(token_agreement=float(damage.agreement[j]), kl_per_token=float(damage.kl[j]))
        rows.append(row)
    return rows


def reference_ids(model: VerifiedLM, sample: dict) -> tuple[list[int], int]:
    """(prompt + generation as token ids, the last ``model.max_length``; how many of them were generated)."""
    prompt, generated = model.generated_ids(sample)
    ids = (prompt + generated)[-model.max_length:]
    return ids, min(len(generated), len(ids) - 1)


def reference_generations(lm: LoadedModel, tasks: dict, limit: int, batch_size: int = 8,
                          progress: bool = True, ranks: Ranks = LOCAL) -> list[dict]:
    """The unablated model's own greedy generation of each of the first ``limit`` documents of each generative task
    (lm-eval's prompts, few-shot exemplars, stop sequences and ``max_gen_toks``: stock lm-eval on these weights), as
    token ids: ``{"task", "doc_id", "ids": prompt + generation (the last ``model.max_length`` tokens), "generated":
    how many of them the model generated}``, in lm-eval's document order, task by task. What ``generation_agreement``
    teacher-forces on, and the text a next-token-KL budget on generation reads (only its generated tokens)."""
    out = evaluate_tasks(lm, tasks, None, batch_size, limit, progress, ranks=ranks)
    rows = []
    for name in tasks:
        for sample in sorted(out["samples"][name], key=lambda s: s["doc_id"]):
            ids, generated = reference_ids(out["model"], sample)
            rows.append({"task": name, "doc_id": sample["doc_id"], "ids": ids, "generated": generated})
    return rows
