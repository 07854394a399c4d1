"""What a study judges its curves by: a multiple-choice task (the paper's MMLU), a long-context probe (pass-key
retrieval, copying, the user's own texts) or a generative lm-eval task (the unablated model's own generations, read
teacher-forced), behind one interface (``StudyTask``): the unablated ``baseline``,
``evaluate(mask, label)`` under a ``[L, H]`` mask (one head set for every input) or a ``[N, L, H]`` mask (one per
input), and ``measures(result)``, the point's other figures against the baseline. Both are cached by the run's work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from prune_heads.data.probes import ProbeSet
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.encoding import EncodedTask
from prune_heads.eval.probes import ProbeResult
from prune_heads.eval.results import EvalResult, Judged, accuracy_summary, agreement, answer_kl
from prune_heads.eval.textkl import HeldOutText, TextDamage

# What each probe's study accuracy is: a greedy key match, or the share of target tokens predicted.
PROBE_ACCURACY = {"passkey": "match", "copy": "token_accuracy", "text": "token_accuracy"}
PROBE_MEASURE = {"passkey": "keys retrieved", "copy": "repeated tokens predicted", "text": "next tokens predicted"}


class StudyTask(Protocol):
    baseline: Judged
    inputs: int  # how many questions or prompts
    unit: str  # what they are called ("questions", "prompts")
    measure: str  # what the accuracy counts ("accuracy", "keys retrieved", ...)

    def evaluate(self, mask: torch.Tensor, label: str) -> Judged: ...

    def measures(self, result) -> dict: ...

    def baseline_summary(self) -> dict: ...  # the unpruned model's figures for study.json


class TaskStudy:
    """A multiple-choice task: accuracy, the answer KL from the unablated model and the answers' agreement."""

    def __init__(self, work: Work, enc: EncodedTask, baseline: EvalResult):
        self.work, self.enc, self.baseline = work, enc, baseline
        self.inputs, self.unit, self.measure = len(enc), "questions", "accuracy"

    def evaluate(self, mask: torch.Tensor, label: str) -> EvalResult:
        return self.work.task_result(self.enc, mask, label)

    def baseline_summary(self) -> dict:
        return accuracy_summary(self.baseline)

    def measures(self, result: EvalResult) -> dict:
        return {"kl_answer_nats": round(float(answer_kl(result, self.baseline).mean()), 6),
                "agreement": round(agreement(result, self.baseline), 6)}


@dataclass(frozen=True)
class ProbeOutcome:
    """A probe's result judged as a study judges it: ``correct`` per prompt is its key match (passkey) or its share of
    target tokens predicted (copy, text)."""

    result: ProbeResult

    @property
    def correct(self) -> torch.Tensor:
        return getattr(self.result, PROBE_ACCURACY[self.result.probe.name])

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    def by_length(self) -> dict[str, float]:
        lengths = torch.tensor([it.length for it in self.result.probe.items])
        return {str(n): round(float(self.correct[lengths == n].mean()), 6) for n in self.result.probe.lengths}


class ProbeStudy:
    """A long-context probe: the accuracy per length, the target tokens' loss and its change from the unablated
    model (nats per token), and for the user's texts the next-token KL from it."""

    def __init__(self, work: Work, probe: ProbeSet, baseline: ProbeResult):
        self.work, self.probe = work, probe
        self.baseline = ProbeOutcome(baseline)
        self.inputs, self.unit, self.measure = len(probe.items), "prompts", PROBE_MEASURE[probe.name]

    def evaluate(self, mask: torch.Tensor, label: str) -> ProbeOutcome:
        return ProbeOutcome(self.work.probe(self.probe, mask, label))

    def baseline_summary(self) -> dict:
        return {"accuracy": round(self.baseline.accuracy, 6), "n": self.inputs,
                "by_length": self.baseline.by_length(), **self.probe.to_json()}

    def measures(self, outcome: ProbeOutcome) -> dict:
        res, base = outcome.result, self.baseline.result
        out = {"accuracy_by_length": outcome.by_length(), "nll_nats": round(float(res.nll.mean()), 6),
               "nll_change_nats": round(float((res.nll - base.nll).mean()), 6)}
        if self.probe.metric == "kl":
            out["kl_text_nats"] = round(float(res.kl.mean()), 6)
        return out


@dataclass(frozen=True)
class GenerationOutcome:
    """A generative task's documents judged as a study judges them: ``correct`` per document is the share of the
    unablated model's generated tokens at which the ablated model's greedy choice agrees (1 for every document
    unablated)."""

    damage: TextDamage

    @property
    def correct(self) -> torch.Tensor:
        return self.damage.agreement

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())


class GenerationStudy:
    """A generative lm-eval task, label-free (a model at chance still has a curve): each document's prompt and the
    unablated model's own greedy generation (``HeldOutText`` with the generated tokens scored); the curve is the share
    of generated tokens predicted as unablated, beside it the share of generations left the same, token for token,
    and the mean next-token KL. A perplexity task's documents serve the same way, every token read."""

    def __init__(self, work: Work, texts: HeldOutText):
        self.work, self.texts = work, texts
        self.baseline = GenerationOutcome(TextDamage.empty(len(texts)))
        self.inputs, self.unit, self.measure = len(texts), "documents", "generated tokens predicted as unablated"

    def evaluate(self, mask: torch.Tensor, label: str) -> GenerationOutcome:
        return GenerationOutcome(self.work.text_damage(self.texts, mask))

    def baseline_summary(self) -> dict:
        return {"accuracy": 1.0, "n": self.inputs, "source": self.texts.source,
                "generated_tokens": sum(self.texts.scored or [])}

    def measures(self, outcome: GenerationOutcome) -> dict:
        means = outcome.damage.means()
        return {k: means[k] for k in ("same_generation", "kl_text_nats")}
