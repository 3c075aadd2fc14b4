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

Series = Sequence[tuple[int, float]]
"""(step, value) pairs of one run, steps increasing."""


@dataclass(frozen=True)
class ConvergenceCriterion:
    """The stated criterion (module docstring); its fields are recorded in grid.json and summary.json."""

    metric: str = "kl/k1"
    gap: float | None = None
    window: float = 0.25
    max_log_gap: float = 0.1
    z: float = 2.0
    se_fraction: float = 0.25
    lr_decay: float | None = 1 / 3
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


def window_halves(series: Series, window: float) -> tuple[float, float] | None:
    """(a, b): means of the values over the first and the second half of the last ``window`` of the series,
    steps t with N(1 − w) < t ≤ N(1 − w/2) and N(1 − w/2) < t ≤ N; None when a half has no value."""
    if not series:
        return None
    n = series[-1][0]
    lo, mid = n * (1 - window), n * (1 - window / 2)
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


def movement(series: Sequence[Series], crit: ConvergenceCriterion) -> tuple[float | None, float | None]:
    """(m, se) of condition 2 over the runs' last ``window``; (None, None) when a run lacks a value in a half or
    there are fewer than 2 runs."""
    n = len(series)
    halves = [window_halves(s, crit.window) for s in series]
    if n < 2 or any(h is None for h in halves):
        return None, None
    d = [b - a for a, b in halves]  # type: ignore[misc]
    m = sum(d) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) / math.sqrt(n)


def still_and_resolved(m: float | None, se: float | None, crit: ConvergenceCriterion) -> tuple[bool, bool]:
    """Conditions 2 and 3 on a movement ``m`` and its ``se``."""
    still = m is not None and se is not None and abs(m) <= crit.z * se
    resolved = se is not None and (crit.gap is None or se <= crit.se_fraction * crit.gap)
    return still, resolved


def converged(series: Sequence[Series], lrs: Sequence[Series], crit: ConvergenceCriterion) -> dict:
    """The criterion on one method's runs (one series per seed, ``lrs`` the same runs' ``lr``).

    Returns ``{"met", "moved", "se", "dense", "lr_decays", "before_decay", "n"}``: ``moved`` = m and ``se`` =
    sd(δ)/√n of condition 2 (None when some run lacks a value in a half or there are fewer than 2 runs), and
    ``before_decay`` = condition 5's ``{"met", "moved", "se"}`` (None when the criterion does not ask for it)."""
    n = len(series)
    dense = n > 0 and all(logged_densely(s, crit.max_log_gap) for s in series)
    moved, se = movement(series, crit)
    still, resolved = still_and_resolved(moved, se, crit)
    decays = crit.lr_decay is None or (len(lrs) == n and all(lr_decays(x, crit.lr_decay) for x in lrs))
    before = None
    if crit.before_decay:
        cut = [cut_before_decay(s, lr) for s, lr in zip(series, lrs, strict=False)] if len(lrs) == n else []
        m5, se5 = movement(cut, crit) if cut else (None, None)
        ok = all(still_and_resolved(m5, se5, crit))
        before = {"met": ok, "moved": m5, "se": se5}
    return {
        "met": bool(dense and still and resolved and decays and (before is None or before["met"])),
        "moved": moved,
        "se": se,
        "dense": dense,
        "lr_decays": decays,
        "before_decay": before,
        "n": n,
    }


def metric_series(records: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record of step ≥ 1 that logs ``key`` with a value."""
    return [(r["step"], r[key]) for r in records if r.get("step", 0) >= 1 and r.get(key) is not None]
