"""Honest statistics over seeds: t-based 95% confidence intervals and named tests that produce a verdict.

**Paired tests (the design of ``klgrad compare``).** Runs that share a seed share their prompts and their
sampling uniforms (common random numbers), so the seed is a block and the unit of analysis is the per-seed
difference d_s = a_s − b_s. A prediction is decided on d by a paired t-test (the p-value that decides), with an
exact sign-flip permutation p-value beside it (distribution-free; with n seeds its smallest two-sided value is
2/2^n, so it needs n ≥ 6 to reach 0.05). Every hypothesis tested in one summary (an equivalence claim brings
two) forms one family, Holm-adjusted (:func:`holm`, step-down) before a verdict is given. Verdicts:

- ``supported``: the claimed direction is significant (Holm-adjusted two-sided p < α);
- ``opposite``: significant in the other direction (for an equivalence claim: a significant difference);
- ``not resolved at this sample size``: neither.

An equivalence claim (a ≈ b) uses a paired TOST with a margin δ stated before the runs (not estimated from
the runs it judges): both one-sided tests of |mean d| < δ must reject. The unpaired Welch tests
(:func:`welch_less`, :func:`welch_equivalent`) remain for a secondary column and for designs without blocks;
their verdicts are ``supported`` / ``not supported`` / not resolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scipy import stats as st

SUPPORTED, NOT_SUPPORTED, UNRESOLVED = "supported", "not supported", "not resolved at this sample size"
OPPOSITE = "opposite"
MAX_EXACT_FLIPS = 20
"""Sign-flip tests enumerate all 2^n sign patterns up to n = 20 seeds (about a million patterns)."""


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


# ----------------------------------------------------------------------------------------------------------
# paired tests (blocks = seeds)


def paired_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """d_s = a_s − b_s for seeds s in the order given; both sequences must list the same seeds."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need one value per seed on both sides, got {len(a)} and {len(b)}")
    return [x - y for x, y in zip(a, b, strict=True)]


def no_spread(d: Sequence[float]) -> bool:
    """True when the values differ by no more than float64 rounding of their size: max − min ≤ 1e-12·max|d|.

    Differences a_s − b_s of equal offsets come out a few ulps of the operands apart (1.0 − 1.3 and 2.0 − 2.3
    differ by 2.2e-16: one ulp of 2.3); 1e-12·|d| stays thousands of ulps above that for operands up to ~10³·|d|
    and far below any seed-to-seed spread of a real grid. Below it a t statistic is a ratio of round-off."""
    return max(d) - min(d) <= 1e-12 * max(abs(x) for x in d)


def paired_t_p(d: Sequence[float], alternative: str = "two-sided", shift: float = 0.0) -> float:
    """p-value of the one-sample t-test of mean(d) against ``shift`` (paired t-test on differences d).

    t = (mean(d) − shift) / (sd(d)/√n) with n − 1 degrees of freedom; ``alternative`` is ``less``,
    ``greater`` or ``two-sided``. With no spread in d, t is infinite (or 0/0) and says nothing about how often
    such a pattern arises by chance: the exact sign-flip p of d − shift is returned instead (n equal
    differences give 2^(1−n) two-sided, 2^−n one-sided in their own direction, 1 against it; 1 when d = shift).
    """
    n = len(d)
    if n < 2:
        return float("nan")
    if no_spread(d):  # sd = 0: t is ±inf (or 0/0); the exact sign-flip test is defined and honest
        return sign_flip_p([x - shift for x in d], alternative)
    return float(st.ttest_1samp([x - shift for x in d], 0.0, alternative=alternative).pvalue)


def sign_flip_p(d: Sequence[float], alternative: str = "two-sided") -> float:
    """Exact sign-flip permutation p-value of mean(d) = 0 (differences symmetric about 0 under H0).

    Enumerates every assignment of signs to |d_s| (2^n of them, n ≤ MAX_EXACT_FLIPS) and counts those whose
    mean is at least as extreme as the observed one: p = #{σ: T(σ) ≥ T_obs} / 2^n, with T = mean (greater),
    −mean (less) or |mean| (two-sided). The observed assignment is one of them, so p ≥ 2^-n.
    """
    n = len(d)
    if n == 0:
        return float("nan")
    if n > MAX_EXACT_FLIPS:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns; n = {n} > {MAX_EXACT_FLIPS}")
    mags = [abs(x) for x in d]
    obs = sum(d)
    tol = 1e-12 * max(1.0, sum(mags))  # sums of the same magnitudes in another order: ties within rounding
    hits = 0
    for pattern in range(1 << n):
        total = sum(-m if (pattern >> i) & 1 else m for i, m in enumerate(mags))
        if alternative == "greater":
            hits += total >= obs - tol
        elif alternative == "less":
            hits += total <= obs + tol
        else:
            hits += abs(total) >= abs(obs) - tol
    return hits / (1 << n)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error ≤ α for any dependence): sort ascending,
    p̃_(k) = max_{j ≤ k} min(1, (m − j + 1)·p_(j)); NaN p-values are left out of the family and stay NaN."""
    idx = [i for i, p in enumerate(p_values) if not math.isnan(p)]
    m = len(idx)
    out = [float("nan")] * len(p_values)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def paired_less(a: Sequence[float], b: Sequence[float]) -> dict:
    """Claim mean(a) < mean(b) over paired seeds: the paired t-test on d = a − b (two-sided p, to be
    Holm-adjusted by :func:`decide`), the one-sided p-values, the exact sign-flip p, mean d and its 95% CI."""
    d = paired_differences(a, b)
    mean, ci = mean_ci(d) if d else (float("nan"), float("nan"))
    return {
        "kind": "less",
        "test": "paired t-test on per-seed differences (two-sided, Holm-adjusted); exact sign-flip p beside it",
        "n_pairs": len(d),
        "differences": d,
        "mean_difference": mean,
        "ci95": [mean - ci, mean + ci],
        "p_value": paired_t_p(d, "two-sided"),
        "p_less": paired_t_p(d, "less"),
        "p_greater": paired_t_p(d, "greater"),
        "p_sign_flip": sign_flip_p(d, "two-sided") if d else float("nan"),
        "n_negative": sum(x < 0 for x in d),
    }


def paired_equivalent(a: Sequence[float], b: Sequence[float], margin: float) -> dict:
    """Claim mean(a) ≈ mean(b) within ±``margin`` over paired seeds: paired TOST on d = a − b,
    p_TOST = max(p(mean d ≤ −δ), p(mean d ≥ +δ)); the two-sided paired t p-value of a difference beside it."""
    if not margin > 0:
        raise ValueError(f"equivalence margin must be > 0, got {margin}")
    d = paired_differences(a, b)
    mean, ci = mean_ci(d) if d else (float("nan"), float("nan"))
    p_tost = max(paired_t_p(d, "greater", shift=-margin), paired_t_p(d, "less", shift=margin))
    return {
        "kind": "equivalent",
        "test": f"paired TOST on per-seed differences (margin ±{margin:.4g}, Holm-adjusted); paired t-test of a "
        "difference and exact sign-flip p beside it",
        "margin": margin,
        "n_pairs": len(d),
        "differences": d,
        "mean_difference": mean,
        "ci95": [mean - ci, mean + ci],
        "p_value": p_tost,
        "p_difference": paired_t_p(d, "two-sided"),
        "p_sign_flip": sign_flip_p(d, "two-sided") if d else float("nan"),
        "n_negative": sum(x < 0 for x in d),
    }


def decide(tests: Sequence[dict], alpha: float = 0.05) -> list[dict]:
    """Give each paired test its verdict, every tested hypothesis in one Holm family (module docstring).

    The family holds each ordering claim's two-sided p (H0: mean d = 0) and, for each equivalence claim, both of
    its hypotheses: the TOST p (H0: |mean d| ≥ δ) and the two-sided difference p (H0: mean d = 0), so
    m = #orderings + 2·#equivalences and the step-down runs over all of them at once. Ordering claims:
    supported when the adjusted p < α and mean d < 0, opposite when it is significant with mean d > 0.
    Equivalence claims: supported when the adjusted TOST p < α, else opposite when the adjusted difference p is.
    The family-wise error of the verdicts is then ≤ α (Holm, any dependence; simulated in the tests). Returns new
    dicts with ``p_adjusted`` (and ``p_difference_adjusted`` for equivalences), ``alpha`` and ``verdict``.
    """
    slots: list[tuple[int, str]] = [(i, "p_value") for i in range(len(tests))]
    slots += [(i, "p_difference") for i, t in enumerate(tests) if t["kind"] == "equivalent"]
    adjusted = dict(zip(slots, holm([tests[i][k] for i, k in slots]), strict=True))
    out = []
    for i, t in enumerate(tests):
        p_adj = adjusted[(i, "p_value")]
        extra: dict = {}
        verdict = UNRESOLVED
        if t["kind"] == "less":
            if p_adj < alpha:
                verdict = SUPPORTED if t["mean_difference"] < 0 else OPPOSITE
        else:
            extra["p_difference_adjusted"] = adjusted[(i, "p_difference")]
            if p_adj < alpha:
                verdict = SUPPORTED
            elif extra["p_difference_adjusted"] < alpha:
                verdict = OPPOSITE
        out.append({**t, "p_adjusted": p_adj, **extra, "alpha": alpha, "verdict": verdict})
    return out
