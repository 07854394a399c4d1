"""The guard's resolution and its size: what its prompts can tell apart, said before it judges, and (``sizing auto``,
the default) as many pass-key and copy prompts as resolve each tolerance, within a cap on the guard's time.

A probe judges a point by the mean over its prompts of a paired change (points lost, or nats of KL), so its 95%
half-width at ``n`` prompts is ``1.96 sd / sqrt(n)``, where ``sd`` is the per-prompt sd of the change of a point *at
the tolerance's edge*. It is estimated as the budget's resolution is (resolution.py), from the unablated read and a
pilot ablation (the search's choice, the first point the guard judges), never below what the edge itself implies:

- ``match`` (passkey: a key is read back or not) and ``token_accuracy`` (copy: a share of the repeat): a prompt
  loses at most what it scored (``a``, the unablated mean), so a loss of ``t`` points concentrated in a share
  ``b = t / (100 a)`` of the prompts gives ``sd = 100 a sqrt(b (1 - b))`` (for a pass key, whose prompts flip or not,
  this is the sd itself); the pilot's sd when larger. A pilot of a few prompts cannot be trusted to show the spread
  (on the embedded model, 2 copy prompts of the 9-head point showed +/-2.7 where 5 showed +/-13);
- ``kl`` (the user's texts): a scale quantity, the pilot's coefficient of variation times the tolerance.

Under the guard's default measure, ``probability`` (search/guard.py), pass-key and copy prompts are judged by the
probabilities the model gives the key and each repeated token, which move with every token's log-likelihood instead of
flipping at a threshold: the concentrated-loss bound above describes read rates, not them. Their sd is the pilot's,
pooled over the probe's lengths, taken at its one-sided 95% upper confidence limit (``sd sqrt(k / chi2_0.05(k))`` on
``k`` degrees of freedom), so that a pilot of a few prompts that happened to agree cannot size the probe too small.

Pass-key and copy prompts are generated, so they are what buys resolution: sized ``auto``, each gets the prompts its
worst length needs, within ``max_prompts`` and within ``max_tokens`` read per point (the cap on the guard's time,
in tokens so that two runs, or two ranks, of the same command size alike; a timed cap made torchrun's ranks and a
single process disagree); the user's texts are as many as they gave, and an unresolved tolerance is said, with the
count that would resolve it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prune_heads.eval.probes import ProbeResult
from prune_heads.search.resolution import coefficient_of_variation

Z = 1.96
GENERATED = ("passkey", "copy")  # probes whose prompts are made, not given: the ones sizing adds to


@dataclass(frozen=True)
class ProbeResolution:
    """One probe at one length: the planned prompts and the half-width they resolve at the tolerance's edge."""

    probe: str
    length: int
    prompts: int
    edge_sd: float  # per-prompt sd of the change at the tolerance's edge (points, or nats)
    tolerance: float
    unit: str  # pt | nat

    def half_width(self, n: int | None = None) -> float:
        n = self.prompts if n is None else n
        return Z * self.edge_sd / math.sqrt(n) if n > 0 else float("inf")

    def prompts_for(self, width: float) -> int:
        """The fewest prompts whose predicted half-width is at most ``width``."""
        return max(2, math.ceil((Z * self.edge_sd / width) ** 2)) if width > 0 else 1 << 30

    @property
    def resolves(self) -> bool:
        return self.half_width() <= self.tolerance + 1e-12

    def at(self, prompts: int) -> "ProbeResolution":
        return ProbeResolution(self.probe, self.length, prompts, self.edge_sd, self.tolerance, self.unit)

    def describe(self) -> str:
        return (f"{self.probe} at {self.length} tokens: {self.prompts} prompts resolve +/-{self.half_width():.3g} "
                f"{self.unit} (tolerance {self.tolerance:g} {self.unit})")

    def to_json(self) -> dict:
        return {"probe": self.probe, "length": self.length, "prompts": self.prompts,
                "predicted_half_width": round(self.half_width(), 6), "edge_sd": round(self.edge_sd, 6),
                "tolerance": self.tolerance, "unit": self.unit, "resolves_tolerance": self.resolves,
                "prompts_to_resolve": self.prompts_for(self.tolerance)}


def edge_sd(base: ProbeResult, pilot: ProbeResult, tolerance: float) -> float:
    """Per-prompt sd of a point at the tolerance's edge, at one length, judged by read rates or KL (see the module's
    docstring)."""
    if base.probe.metric == "kl":
        return coefficient_of_variation(pilot.kl.double()) * tolerance
    change = (base.metric() - pilot.metric()).double() * 100.0
    observed = float(change.std(unbiased=True)) if change.numel() > 1 else 0.0
    # A prompt can lose at most what it scored: losing ``tolerance`` points on average as a share b of the prompts
    # losing everything gives sd 100 a sqrt(b (1 - b)) (a: the unablated mean; exact for a pass key's 0/1).
    a = max(float(base.metric().double().mean()), 1e-9)
    b = min(max(tolerance, 1e-9) / (100.0 * a), 0.5)
    return max(observed, 100.0 * a * math.sqrt(b * (1 - b)))


# chi2's 5% quantile on k = 1..30 degrees of freedom (beyond: Wilson and Hilferty's approximation, within 0.1%)
CHI2_05 = (0.00393, 0.1026, 0.3518, 0.7107, 1.1455, 1.6354, 2.1673, 2.7326, 3.3251, 3.9403, 4.5748, 5.2260, 5.8919,
           6.5706, 7.2609, 7.9616, 8.6718, 9.3905, 10.1170, 10.8508, 11.5913, 12.3380, 13.0905, 13.8484, 14.6114,
           15.3792, 16.1514, 16.9279, 17.7084, 18.4927)


def chi2_05(k: int) -> float:
    if k <= len(CHI2_05):
        return CHI2_05[k - 1]
    return k * (1 - 2 / (9 * k) - 1.6449 * math.sqrt(2 / (9 * k))) ** 3


def probability_edge_sd(base: ProbeResult, pilot: ProbeResult) -> float:
    """Per-prompt sd of the change of a probe judged by probabilities (points): the pilot's, pooled over its lengths,
    at its one-sided 95% upper confidence limit (infinite from one prompt per length)."""
    squares, k = 0.0, 0
    for n in base.probe.lengths:
        a, b = base.at_length(n), pilot.at_length(n)
        change = (judged(a, "probability") - judged(b, "probability")) * 100.0
        if change.numel() > 1:
            squares += float(change.var(unbiased=True)) * (change.numel() - 1)
            k += change.numel() - 1
    return math.sqrt(squares / chi2_05(k)) if k else float("inf")  # k x (pooled variance) / chi2_0.05(k)


def resolutions(baselines: tuple[ProbeResult, ...], pilots: tuple[ProbeResult, ...],
                tolerances: dict[str, float], measure: str = "rate") -> list[ProbeResolution]:
    """Every probe at every length, at its current prompt count, judged by ``measure`` (search/guard.py)."""
    rows = []
    for base, pilot in zip(baselines, pilots):
        name, unit = base.probe.name, "nat" if base.probe.metric == "kl" else "pt"
        pooled = probability_edge_sd(base, pilot) if measure == "probability" and unit == "pt" else None
        for n in base.probe.lengths:
            a, b = base.at_length(n), pilot.at_length(n)
            sd = pooled if pooled is not None else edge_sd(a, b, tolerances[name])
            rows.append(ProbeResolution(name, n, len(a.probe.items), sd, tolerances[name], unit))
    return rows


JUDGED = {"match": "p_match", "token_accuracy": "p_token"}  # a read rate -> the probability judged in its place


def judged(result: ProbeResult, measure: str) -> torch.Tensor:
    """Per prompt, what a probe is judged by: its read rate (``rate``), or under ``probability`` the probability of
    the key (pass key) or of each repeated token (copy); KL for text either way."""
    field = JUDGED.get(result.probe.metric, result.probe.metric) if measure == "probability" else result.probe.metric
    return getattr(result, field).double()


@dataclass(frozen=True)
class Sizing:
    """How ``auto`` sized the generated probes: the prompts per probe, what it would have taken, what capped it."""

    prompts: dict[str, int]
    wanted: dict[str, int]
    tokens_per_point: int  # what one point's read costs at ``prompts`` (tokens read; a text is read twice)
    capped_by: str | None  # max_tokens | max_prompts | None

    def to_json(self) -> dict:
        return {"prompts": self.prompts, "prompts_to_resolve": self.wanted,
                "tokens_per_point": self.tokens_per_point, "capped_by": self.capped_by}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """For the run's cache: a resumed run re-reads its probes from the cache in no time, so it must take the
        sizing it made, not make one from a read that cost nothing."""
        names = sorted(self.prompts)
        return {"prompts": torch.tensor([self.prompts[p] for p in names]),
                "wanted": torch.tensor([self.wanted[p] for p in names]),
                "tokens": torch.tensor([self.tokens_per_point]),
                "capped": torch.tensor([CAPS.index(self.capped_by)])}

    @staticmethod
    def from_tensors(names: list[str], t: dict[str, torch.Tensor]) -> "Sizing":
        names = sorted(names)
        return Sizing({p: int(n) for p, n in zip(names, t["prompts"].tolist())},
                      {p: int(n) for p, n in zip(names, t["wanted"].tolist())}, int(t["tokens"][0]),
                      CAPS[int(t["capped"][0])])


CAPS = (None, "max_prompts", "max_tokens")


def size(rows: list[ProbeResolution], current: dict[str, int], max_tokens: int, max_prompts: int) -> Sizing:
    """Prompts per generated probe (the same at every length): what its worst length needs, at least the current
    count, at most ``max_prompts``, and scaled down together so one point's read fits ``max_tokens``."""
    tokens = {}  # tokens one prompt adds per probe (one at each length; a text prompt is read twice per point)
    for r in rows:
        tokens[r.probe] = tokens.get(r.probe, 0) + r.length * (2 if r.unit == "nat" else 1)
    wanted = {p: max(current[p], *(r.prompts_for(r.tolerance) for r in rows if r.probe == p))
              for p in tokens if p in GENERATED}
    fixed = sum(current[p] * tokens[p] for p in tokens if p not in wanted)
    prompts = {p: min(n, max_prompts) for p, n in wanted.items()}
    capped = "max_prompts" if prompts != wanted else None
    if prompts and fixed + sum(prompts[p] * tokens[p] for p in prompts) > max_tokens:
        share = max(0.0, (max_tokens - fixed) / sum(prompts[p] * tokens[p] for p in prompts))
        prompts = {p: max(current[p], math.floor(n * share)) for p, n in prompts.items()}
        capped = "max_tokens"
    return Sizing(prompts, wanted, fixed + sum(prompts[p] * tokens[p] for p in prompts), capped)


def unresolved_warning(row: ProbeResolution) -> str:
    """The one line a tolerance the guard cannot resolve gets."""
    more = ("raise the recipe's guard max_tokens or max_prompts" if row.probe in GENERATED
            else "give more --guard-texts documents of this length")
    return (f"the long-context guard cannot resolve its tolerance for {row.describe()}; "
            f"{row.prompts_for(row.tolerance)} prompts would ({more}, or widen the tolerance): a point's verdict "
            "there turns on which prompts were drawn")
