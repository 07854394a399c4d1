"""The long-context guard: a point the budget accepts must also keep every long-context probe (data/probes.py) within
a stated tolerance of the unablated model, at every probed length.

Per probe and length, each prompt is paired with itself unablated: the drop (in points) of the probability it gives
the pass key or each copied token (the default ``measure``, ``probability``: every token's log-likelihood moves it, so
a prompt says far more than whether greedy decoding wrote the key; the read rates users read, keys retrieved and
tokens predicted, are shown beside it) or, with ``measure: rate``, of its pass-key match or copy token accuracy
themselves, or its next-token KL on the user's texts (in nats), with the mean and a 95% interval over the prompts.
Under the run's decision rule, ``point`` judges the mean, and ``confident`` refuses a point only when the
interval says so (its lower end beyond the tolerance). What the prompts resolve is predicted before the guard judges,
and by default the generated probes are sized to resolve their tolerances (guard_sizing.py). A point
that fails is refused with the probe, the length and the numbers, like a failed confirmation, and the next passing
point of the search is tried (confirmation.py walks them).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from prune_heads.console import say
from prune_heads.data.probes import ProbeSet
from prune_heads.errors import UserError
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.probes import ProbeResult
from prune_heads.search.guard_sizing import ProbeResolution, Sizing, judged
from prune_heads.timings import stage

UNITS = {"match": "pt", "token_accuracy": "pt", "kl": "nat"}
DEFAULT_TOLERANCE = {"passkey": 5.0, "copy": 5.0, "text": 0.05}


def parse_tolerance(name: str, text) -> float:
    """A probe's tolerance as the recipe writes it: points for passkey/copy (5, 5pt, 5%), nats for text (0.05nat)."""
    raw = str(text).strip().lower()
    for suffix in ("pts", "pt", "%", "nats", "nat"):
        if raw.endswith(suffix):
            raw = raw[: -len(suffix)].strip()
            break
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0 or (name != "text" and value > 100):
        unit = "nats (0.05nat)" if name == "text" else "points between 0 and 100 (5pt)"
        raise UserError(f"the guard's tolerance for {name} {text!r} is not a tolerance; write it in {unit}")
    return value


@dataclass(frozen=True)
class GuardSetup:
    """The probes, each probe's tolerance (points, or nats for ``text``) and the decision rule."""

    probes: tuple[ProbeSet, ...]
    tolerances: tuple[tuple[str, float], ...]
    rule: str = "point"
    measure: str = "probability"  # probability | rate: what pass key and copy are judged by

    def tolerance(self, name: str) -> float:
        return dict(self.tolerances).get(name, DEFAULT_TOLERANCE[name])


@dataclass(frozen=True)
class ProbeComparison:
    """One probe at one length: original and pruned means, the paired change and its interval, the verdict."""

    probe: str
    length: int
    prompts: int
    original: float
    pruned: float
    change: float  # points lost (match, token accuracy) or nats of KL (text)
    ci_low: float
    ci_high: float
    tolerance: float
    unit: str
    ok: bool
    measure: str = "rate"  # what original, pruned and change are of: rate | probability | kl
    read_original: float | None = None  # the read rate beside a probability (keys retrieved, tokens predicted)
    read_pruned: float | None = None

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()
                if v is not None}

    def describe(self) -> str:
        if self.unit == "nat":
            what = "KL"
        elif self.measure == "probability":
            what = (f"{READS[self.probe]} {100 * self.read_original:.1f}% -> {100 * self.read_pruned:.1f}%, "
                    f"{PROBABILITIES[self.probe]} {100 * self.original:.1f}% -> {100 * self.pruned:.1f}%")
        else:
            what = f"{self.original * 100:.1f}% -> {self.pruned * 100:.1f}%"
        return (f"{self.probe} at {self.length} tokens: {what}, {self.change:+.3g} {self.unit} "
                f"[{self.ci_low:+.3g}, {self.ci_high:+.3g}] (tolerance {self.tolerance:g} {self.unit})")


READS = {"passkey": "keys retrieved", "copy": "tokens predicted"}
PROBABILITIES = {"passkey": "key probability", "copy": "token probability"}


def compare(original: ProbeResult, pruned: ProbeResult, tolerance: float, rule: str,
            measure: str = "rate") -> list[ProbeComparison]:
    """Per length, each prompt paired with itself unablated: the change of what ``measure`` judges (guard_sizing's
    ``judged``), its 95% interval and the verdict."""
    rows = []
    for n in original.probe.lengths:
        a, b = original.at_length(n), pruned.at_length(n)
        unit = UNITS[original.probe.metric]
        change = b.kl.double() if unit == "nat" else (judged(a, measure) - judged(b, measure)) * 100.0
        mean = float(change.mean())
        se = float(change.std()) / len(change) ** 0.5 if len(change) > 1 else 0.0
        low, high = mean - 1.96 * se, mean + 1.96 * se
        ok = (low if rule == "confident" else mean) <= tolerance + 1e-9  # confident: refused only when sure
        pruned_mean = float(b.kl.mean()) if unit == "nat" else float(judged(b, measure).mean())
        original_mean = 0.0 if unit == "nat" else float(judged(a, measure).mean())
        kind = "kl" if unit == "nat" else measure
        reads = (float(a.metric().mean()), float(b.metric().mean())) if kind == "probability" else (None, None)
        rows.append(ProbeComparison(original.probe.name, n, len(change), original_mean, pruned_mean, mean, low, high,
                                    tolerance, unit, ok, kind, *reads))
    return rows


@dataclass(frozen=True)
class GuardVerdict:
    rows: tuple[ProbeComparison, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def reason(self) -> str:
        return "; ".join(r.describe() for r in self.rows if not r.ok)

    def to_json(self) -> dict:
        return {"within_tolerance": self.ok, "probes": [r.to_json() for r in self.rows],
                **({"reason": self.reason} if not self.ok else {})}


class Guard:
    """The probes' unablated results, and each head set judged against them; what the prompts resolve at each
    tolerance's edge (``resolution``) and how they were sized (``sizing``), once a pilot has measured it."""

    def __init__(self, work: Work, setup: GuardSetup, baselines: tuple[ProbeResult, ...], seconds: float = 0.0):
        self.work, self.setup, self.baselines = work, setup, baselines
        self.seconds = seconds  # spent reading probes (what the guard costs the run; cached reads cost nothing)
        self.resolution: list[ProbeResolution] = []
        self.sizing: Sizing | None = None

    @property
    def tolerances(self) -> dict[str, float]:
        return {p.name: self.setup.tolerance(p.name) for p in self.setup.probes}

    def read_all(self, target, label: str) -> tuple[ProbeResult, ...]:
        """Every probe with ``target`` ablated (a pilot: nothing is judged, no probe is skipped)."""
        started = time.perf_counter()
        with stage("guard"):
            results = tuple(self.work.probe(p, target, f"{p.name}, {label}") for p in self.setup.probes)
        self.seconds += time.perf_counter() - started
        return results

    @classmethod
    def measured(cls, work: Work, setup: GuardSetup) -> "Guard":
        """A guard with the unablated model's probe results (cached)."""
        started = time.perf_counter()
        baselines = tuple(work.probe(p, None, f"{p.name} unablated") for p in setup.probes)
        return cls(work, setup, baselines, time.perf_counter() - started)

    def check(self, target, label: str) -> GuardVerdict:
        """The probes with ``target`` ablated, against the unablated model: the cheapest first, stopping at the first
        that fails (a refused point costs only what refuses it)."""
        started = time.perf_counter()
        with stage("guard"):
            verdict = self._read(target, label)
        self.seconds += time.perf_counter() - started
        say(f"  long-context guard, {label}: " + ("every probe within tolerance" if verdict.ok
                                                   else f"refused: {verdict.reason}"),
            fg="green" if verdict.ok else "yellow")
        return verdict

    def _read(self, target, label: str) -> "GuardVerdict":
        rows: list[ProbeComparison] = []
        order = sorted(zip(self.setup.probes, self.baselines), key=lambda pb: sum(len(it.ids) for it in pb[0].items))
        for probe, base in order:
            result = self.work.probe(probe, target, f"{probe.name}, {label}")
            rows += compare(base, result, self.setup.tolerance(probe.name), self.setup.rule, self.setup.measure)
            if not all(r.ok for r in rows):
                break
        return GuardVerdict(tuple(rows))

    def to_json(self) -> dict:
        """What the guard checks, and the unablated model's results per probe and length."""
        return {"enabled": True, "rule": self.setup.rule, "measure": self.setup.measure, "tolerance": self.tolerances,
                "probes": [p.to_json() for p in self.setup.probes],
                "original": {b.probe.name: b.summary() for b in self.baselines},
                "resolution": [r.to_json() for r in self.resolution],
                "sizing": self.sizing.to_json() if self.sizing else None}


def per_length(verdict: GuardVerdict | None) -> dict:
    """``{probe: {length: {original, pruned, change, ...}}}`` of a verdict: the table of the report and the card."""
    if verdict is None:
        return {}
    out: dict[str, dict] = {}
    for r in verdict.rows:
        out.setdefault(r.probe, {})[str(r.length)] = {k: v for k, v in r.to_json().items()
                                                       if k not in ("probe", "length")}
    return out
