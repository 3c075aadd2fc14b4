"""Honest statistics over seeds: t-based 95% confidence intervals and named tests that produce a verdict.

Verdicts are one of ``supported``, ``not supported``, ``not resolved at this sample size``:
- an ordering claim (a < b) uses a one-sided Welch t-test at α: supported if a < b is significant, not
  supported if a > b is significant, otherwise not resolved;
- an equivalence claim (a ≈ b) uses Welch TOST (two one-sided tests) with a stated margin δ: supported if the
  difference is significantly inside ±δ, not supported if a two-sided Welch test finds a difference,
  otherwise not resolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scipy import stats as st

SUPPORTED, NOT_SUPPORTED, UNRESOLVED = "supported", "not supported", "not resolved at this sample size"


def mean_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of its t-based confidence interval (half-width NaN for fewer than 2 values)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, float(st.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)


def _welch(a: Sequence[float], b: Sequence[float], alternative: str) -> float:
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    if max(a) == min(a) and max(b) == min(b):  # no variance at all: the test is undefined unless means differ
        diff = sum(a) / len(a) - sum(b) / len(b)
        if diff == 0:
            return 1.0
        return 0.0 if (alternative == "two-sided" or (diff < 0) == (alternative == "less")) else 1.0
    return float(st.ttest_ind(a, b, equal_var=False, alternative=alternative).pvalue)


def welch_less(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> dict:
    """Claim mean(a) < mean(b): one-sided Welch t-tests both ways."""
    p_less, p_greater = _welch(a, b, "less"), _welch(a, b, "greater")
    if p_less < alpha:
        verdict = SUPPORTED
    elif p_greater < alpha:
        verdict = NOT_SUPPORTED
    else:
        verdict = UNRESOLVED
    return {
        "test": "one-sided Welch t-test",
        "p_value": p_less,
        "p_opposite": p_greater,
        "alpha": alpha,
        "verdict": verdict,
    }


def welch_equivalent(a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05) -> dict:
    """Claim mean(a) ≈ mean(b) within ±margin: Welch TOST; a significant two-sided difference refutes it."""
    shift_up = [x + margin for x in a]  # H0: a - b <= -margin
    shift_down = [x - margin for x in a]  # H0: a - b >= +margin
    p_tost = max(_welch(shift_up, b, "greater"), _welch(shift_down, b, "less"))
    p_diff = _welch(a, b, "two-sided")
    if p_tost < alpha:
        verdict = SUPPORTED
    elif p_diff < alpha:
        verdict = NOT_SUPPORTED
    else:
        verdict = UNRESOLVED
    return {
        "test": f"Welch TOST (margin ±{margin:.4g})",
        "p_value": p_tost,
        "p_difference": p_diff,
        "alpha": alpha,
        "margin": margin,
        "verdict": verdict,
    }
