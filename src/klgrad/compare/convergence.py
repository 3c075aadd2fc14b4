"""Has a grid converged? A criterion stated before the runs and decided from the runs' logged metrics.

For one method at one β, with n seeds, each run's logged series x_s(t) of ``metric`` (default ``kl/k1``, the
training batch's sequence KL on the training prompts) up to its last step N_s:

1. **logged densely**: every gap between consecutive logged steps, from step 0 to N_s, is at most
   ``max_log_gap``·N_s (a tenth of the run), and the metric is logged at N_s;
2. **stopped moving**: split the last ``window``·N_s steps (a quarter) into halves; per seed, a_s and b_s are
   the metric's means over the first and the second half and δ_s = b_s − a_s. With m = mean_s δ_s and
   se = sd_s(δ_s)/√n, the seed-mean moved by at most ``z`` standard errors: |m| ≤ z·se (z = 2);
3. **resolved**: that standard error is at most ``se_fraction``·``gap`` (a quarter of the gap the grid is meant
   to resolve, stated before the runs; without a gap this condition is not checked and the criterion says so);
4. **the learning rate decays** over the last ``lr_decay`` of the run (a third): in every run the logged ``lr``
   never rises there and ends below where that stretch starts (off when ``lr_decay`` is None);
5. **stopped before the decay** (``before_decay``, on by default): conditions 2 and 3 hold as well on the run
   cut at H_s, the last logged step whose ``lr`` is at least half the run's largest (for a constant lr H_s = N_s,
   the same test; for a cosine schedule the middle of the run).

Condition 3 is what a noisy run cannot pass: noise widens se, which lets condition 2 pass, but then fails 3.
Condition 5 is what a run the schedule stopped cannot pass: once the learning rate has decayed to nearly 0 the
metric cannot move, so 2 and 3 hold by construction at the end of any decayed run, converged or not.
What no condition here catches is a drift slower than the noise: on the tiny addition task (results/
tiny_add_shaping, 3 seeds, 150 cosine steps) the batch KL and the reward passed all five while the exact
distance to the optimum was still falling (0.30, 0.28, 0.25 nats at steps 50, 100, 150). ``met`` says the
logged metric stopped moving at the stated resolution, not that the policy reached its fixed point; the
fixed point itself is the comparison with ``klgrad regime``'s prediction. The grid's record (``summary.json``'s
``convergence``) is met when every method checked meets all of them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

from klgrad.flags import option

Series = Sequence[tuple[int, float]]
"""(step, value) pairs of one run, steps increasing."""


class MethodRuns(NamedTuple):
    """One method's finished runs at one β, in seed order: each run's series of the criterion's metric, of its
    ``lr``, and its seed."""

    series: list[Series]
    lrs: list[Series]
    seeds: list[int]


@dataclass(frozen=True)
class ConvergenceCriterion:
    """The stated criterion (module docstring); its fields are recorded in grid.json and summary.json."""

    metric: str = option(
        "kl/k1", "logged metric the convergence criterion reads (kl/k1: the training batch's sequence KL)",
        aliases=("--converge-metric",), metavar="KEY",
    )  # fmt: skip
    gap: float | None = option(
        None,
        "the gap the grid must resolve: convergence needs the standard error of the last quarter's movement <= "
        "gap/4 (without it that bound is not checked)",
        aliases=("--converge-gap",),
        metavar="NATS",
    )
    window: float = 0.25
    max_log_gap: float = 0.1
    z: float = 2.0
    se_fraction: float = 0.25
    lr_decay: float | None = option(
        1 / 3,
        "the learning rate must decay over this last fraction of every run (none: drop the condition, a constant lr)",
        const_aliases={"--converge-without-lr-decay": "none"},
        metavar="FRACTION|none",
    )
    before_decay: bool = True

    def text(self) -> str:
        """The criterion in words, as summary.json states it."""
        parts = [
            f"{self.metric} logged at least every {self.max_log_gap:g} of each run",
            f"over the last {self.window:g} of the run its seed-mean moves (second half minus first half) by at most "
            f"{self.z:g} standard errors",
        ]
        if self.gap is None:
            parts.append("no bound on that standard error (no gap stated)")
        else:
            parts.append(f"that standard error is at most {self.se_fraction:g} × the stated gap {self.gap:g}")
        if self.lr_decay is not None:
            parts.append(f"the learning rate decays over the last {self.lr_decay:.3g} of every run")
        if self.before_decay:
            parts.append("and the same movement and standard-error test holds on each run cut where its lr last is "
                         "at least half its largest")  # fmt: skip
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def logged_densely(series: Series, max_gap: float) -> bool:
    """Condition 1: the steps 0 = t_0 < t_1 < … < t_k = N (N the series' last step) have gaps ≤ max_gap·N."""
    if not series:
        return False
    steps = [0] + [t for t, _ in series]
    n = steps[-1]
    return n > 0 and max(b - a for a, b in itertools.pairwise(steps)) <= max_gap * n + 1e-9


def window_spans(last_step: float, window: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The two halves (N(1 − w), N(1 − w/2)] and (N(1 − w/2), N] of the last ``window`` of a run ending at N."""
    lo, mid = last_step * (1 - window), last_step * (1 - window / 2)
    return (lo, mid), (mid, last_step)


def window_halves(series: Series, window: float) -> tuple[float, float] | None:
    """(a, b): means of the values over the first and the second half of the last ``window`` of the series
    (:func:`window_spans` of its last step N); None when a half has no value."""
    if not series:
        return None
    n = series[-1][0]
    (lo, mid), _ = window_spans(n, window)
    first = [x for t, x in series if lo < t <= mid and x is not None]
    second = [x for t, x in series if mid < t <= n and x is not None]
    if not first or not second:
        return None
    return sum(first) / len(first), sum(second) / len(second)


def lr_decays(lrs: Series, fraction: float) -> bool:
    """Condition 4 on one run: over steps t ≥ N(1 − fraction) the lr never rises and ends below its start."""
    if not lrs:
        return False
    n = lrs[-1][0]
    tail = [x for t, x in lrs if t >= n * (1 - fraction)]
    return len(tail) >= 2 and all(b <= a for a, b in itertools.pairwise(tail)) and tail[-1] < tail[0]


def cut_before_decay(series: Series, lrs: Series) -> Series:
    """The series up to H, the last logged step whose lr is at least half the largest logged lr (the whole
    series when no lr is logged)."""
    if not lrs:
        return series
    top = max(x for _, x in lrs)
    h = max(t for t, x in lrs if x >= top / 2)
    return [(t, x) for t, x in series if t <= h]


def window_deltas(series: Sequence[Series], window: float) -> list[float] | None:
    """δ_s = b_s − a_s of condition 2, one per run (:func:`window_halves`); None when a run lacks a value in a
    half."""
    halves = [window_halves(s, window) for s in series]
    if any(h is None for h in halves):
        return None
    return [b - a for a, b in halves]  # type: ignore[misc]


def movement(series: Sequence[Series], crit: ConvergenceCriterion) -> tuple[float | None, float | None]:
    """(m, se) of condition 2 over the runs' last ``window``: m = mean_s δ_s, se = sd_s(δ_s)/√n; (None, None)
    when a run lacks a value in a half or there are fewer than 2 runs."""
    d = window_deltas(series, crit.window)
    if d is None or len(d) < 2:
        return None, None
    n = len(d)
    m = sum(d) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) / math.sqrt(n)


def seeds_for_sd(sd: float, bound: float) -> int:
    """The fewest seeds n' whose standard error sd/√n' is at most ``bound``: ⌈(sd/bound)²⌉, at least 2 (the fewest
    with a standard error)."""
    return max(2, math.ceil((sd / bound) ** 2 - 1e-9))  # − 1e-9: an exact integer stays itself


def seeds_for_resolution(se: float | None, n: int, bound: float | None) -> int | None:
    """The number of seeds n' at which condition 3 would hold if the seeds' spread stayed what ``n`` seeds show:
    :func:`seeds_for_sd` of sd = se·√n, so n' = ⌈n·(se/bound)²⌉.

    A projection for planning (how many more seeds a grid needs), not a test: the spread of the next seeds is
    itself uncertain: with n = 8 the sample sd lies between 0.49 and 1.51 times the true one with
    probability 0.95 (√(χ²₇/7)), and n' ∝ sd², so the seeds truly needed may be from 0.44 (1/1.51²) to 4.1
    (1/0.49²) times the projection. None without a standard error or a bound."""
    if se is None or bound is None or n < 2:
        return None
    return seeds_for_sd(se * math.sqrt(n), bound)


def still_and_resolved(m: float | None, se: float | None, crit: ConvergenceCriterion) -> tuple[bool, bool]:
    """Conditions 2 and 3 on a movement ``m`` and its ``se``."""
    still = m is not None and se is not None and abs(m) <= crit.z * se
    resolved = se is not None and (crit.gap is None or se <= crit.se_fraction * crit.gap)
    return still, resolved


def converged(series: Sequence[Series], lrs: Sequence[Series], crit: ConvergenceCriterion) -> dict:
    """The criterion on one method's runs (one series per seed, ``lrs`` the same runs' ``lr``).

    Returns ``{"met", "moved", "se", "deltas", "seeds_needed", "dense", "lr_decays", "before_decay", "n"}``:
    ``moved`` = m and ``se`` = sd(δ)/√n of condition 2 (None when some run lacks a value in a half or there are
    fewer than 2 runs), ``deltas`` the per-run δ_s, ``seeds_needed`` :func:`seeds_for_resolution`'s projection for
    condition 3, and ``before_decay`` = condition 5's ``{"met", "moved", "se", "deltas", "seeds_needed"}`` (None
    when the criterion does not ask for it)."""
    n = len(series)
    bound = None if crit.gap is None else crit.se_fraction * crit.gap
    dense = n > 0 and all(logged_densely(s, crit.max_log_gap) for s in series)
    moved, se = movement(series, crit)
    still, resolved = still_and_resolved(moved, se, crit)
    decays = crit.lr_decay is None or (len(lrs) == n and all(lr_decays(x, crit.lr_decay) for x in lrs))
    before = None
    if crit.before_decay:
        cut = [cut_before_decay(s, lr) for s, lr in zip(series, lrs, strict=False)] if len(lrs) == n else []
        m5, se5 = movement(cut, crit) if cut else (None, None)
        ok = all(still_and_resolved(m5, se5, crit))
        before = {
            "met": ok,
            "moved": m5,
            "se": se5,
            "deltas": window_deltas(cut, crit.window) if cut else None,
            "seeds_needed": seeds_for_resolution(se5, n, bound),
        }
    return {
        "met": bool(dense and still and resolved and decays and (before is None or before["met"])),
        "moved": moved,
        "se": se,
        "deltas": window_deltas(series, crit.window),
        "seeds_needed": seeds_for_resolution(se, n, bound),
        "dense": dense,
        "lr_decays": decays,
        "before_decay": before,
        "n": n,
    }


def metric_series(records: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record of step ≥ 1 that logs ``key`` with a value."""
    return [(r["step"], r[key]) for r in records if r.get("step", 0) >= 1 and r.get(key) is not None]
