"""Honest statistics over seeds: t-based 95% confidence intervals and named tests that produce a verdict.

**Paired tests (the design of ``klgrad compare``).** Runs that share a seed share their prompts and their sampling
uniforms (common random numbers), so the seed is a block and the unit of analysis is the per-seed difference d_s =
a_s − b_s. A prediction is decided on d by a paired t-test (the p-value that decides), with a sign-flip permutation
p-value beside it (distribution-free; exact up to 20 seeds, a seeded Monte Carlo estimate beyond; with n seeds its
smallest two-sided value is 2/2^n, so it needs n ≥ 6 to reach 0.05). Both p-values are scale invariant, and the
t-test's moves continuously with the data (t is extended by continuity to zero spread, :func:`t_statistic`), so a
verdict does not change when every difference is multiplied by one factor or moved by rounding. Every hypothesis
tested in one summary (an equivalence claim brings two) forms one family, Holm-adjusted (:func:`holm`, step-down)
before a verdict is given. Verdicts:

- ``supported``: the claimed direction is significant (Holm-adjusted two-sided p < α);
- ``opposite``: significant in the other direction (for an equivalence claim: a significant difference);
- ``not resolved at this sample size``: neither.

An equivalence claim (a ≈ b) uses a paired TOST with a margin δ stated before the runs (not estimated from
the runs it judges): both one-sided tests of |mean d| < δ must reject. The unpaired Welch tests
(:func:`welch_less`, :func:`welch_equivalent`) remain for a secondary column and for designs without blocks;
their verdicts are ``supported`` / ``not supported`` / not resolved, each at α on its own p (no Holm adjustment).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats as st

SUPPORTED, NOT_SUPPORTED, UNRESOLVED = "supported", "not supported", "not resolved at this sample size"
OPPOSITE = "opposite"
MAX_EXACT_FLIPS = 20
"""Sign-flip tests enumerate all 2^n sign patterns up to n = 20 seeds (about a million patterns); beyond, they draw
:data:`FLIP_DRAWS` random patterns (:func:`sign_flip_p_drawn`)."""
FLIP_DRAWS = 1 << 17
"""Random sign patterns of a Monte Carlo sign-flip p: its standard error √(p(1 − p)/B) is at most 0.0014."""
FLIP_SEED = 0
"""Seed of those patterns: the same differences always get the same p."""
TIE_RTOL = 1e-12
"""Two signed sums of the same |d_s| count as tied when they differ by at most TIE_RTOL·Σ|d_s|.

Derivation (u = 2^-53 ≈ 1.1e-16): a float sum of n terms is off by at most γ_{n−1}·Σ|x|, γ_k = k·u/(1 − k·u),
so two orders of summation of one exact tie differ by ≤ 2·γ_19·Σ|d| ≈ 4.2e-15·Σ|d| for n ≤ 20 (2·γ_99 ≈
2.2e-14·Σ|d| for the drawn patterns of up to 100 seeds). The differences
themselves come from operands: d_s = a_s − b_s carries the representation error of a_s and b_s, up to
u·max(|a_s|, |b_s|) each (1.0 − 1.3 and 2.0 − 2.3 differ by 2.2e-16), so ties meant by the data survive operands
up to 1e-12 / (2u) ≈ 4500 times |d|. Relative to Σ|d| rather than absolute (earlier code used
1e-12·max(1, Σ|d|)), so a common factor on every d cannot turn distinct sums into ties: five differences of
1e-13 then get 2/32 like five of 0.05, not p = 1."""


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


def t_statistic(d: Sequence[float], shift: float = 0.0) -> float:
    """One-sample t of mean(d) against ``shift``: t = (mean(d) − shift) / (sd(d)/√n), n − 1 degrees of freedom.

    Extended by continuity to zero spread: when sd(d) = 0, t = ±∞ (the sign of mean(d) − shift), the limit of t
    as the spread shrinks at a fixed mean, and t = 0 when every d_s equals ``shift`` (no evidence either way).
    So t is scale invariant (t(c·d, c·shift) = t(d, shift) for c > 0) and a p-value taken from it moves
    continuously with the data: equal differences give the same p as differences a rounding apart. No
    tolerance is needed: differences that should be equal but are not by a few ulps give |t| ~ 1/ε ≈ 10^15,
    whose p is 0 to float precision, the value the continuous extension gives to exactly equal ones.
    """
    e = [x - shift for x in d]
    n = len(e)
    m = sum(e) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in e) / (n - 1))
    if sd == 0.0:
        return math.copysign(math.inf, m) if m != 0.0 else 0.0
    return m / (sd / math.sqrt(n))


def paired_t_p(d: Sequence[float], alternative: str = "two-sided", shift: float = 0.0) -> float:
    """p-value of the one-sample t-test of mean(d) against ``shift`` (paired t-test on differences d).

    p = 2·P(T ≥ |t|) (``two-sided``), P(T ≥ t) (``greater``) or P(T ≤ t) (``less``), T ~ t_{n−1}, with t from
    :func:`t_statistic`, so n equal differences give p = 0 (two-sided, or one-sided in their direction) like
    their neighbours with a rounding-level spread, and every difference equal to ``shift`` gives 1 (two-sided)
    or ½ (one-sided). There is no zero-spread fallback: a switch to another test at a spread threshold (earlier
    code used the exact sign-flip p below max − min ≤ 1e-12·max|d|) makes p jump from 2^(1−n) to ~10^−30 when
    one of n equal differences moves by 1e-9. The exact sign-flip p (:func:`sign_flip_p`) stays beside it in
    every test's record: where it is above α and this p below, the verdict rests on the t-test's normality.
    The one discontinuity left is t's own 0/0 at d ≡ ``shift``: for an ordering claim (shift = 0) every
    difference exactly 0, which no scaling or relative change of the data leaves; for a TOST every difference
    exactly on the margin (one side's p is ½ there and 0 just inside it).
    """
    n = len(d)
    if n < 2:
        return float("nan")
    t, df = t_statistic(d, shift), n - 1
    if alternative == "two-sided":
        return float(min(1.0, 2.0 * st.t.sf(abs(t), df)))
    if alternative == "greater":
        return float(st.t.sf(t, df))
    if alternative == "less":
        return float(st.t.cdf(t, df))
    raise ValueError(f"alternative must be 'less', 'greater' or 'two-sided', got {alternative!r}")


def sign_flip_p(d: Sequence[float], alternative: str = "two-sided") -> float:
    """Sign-flip permutation p-value of mean(d) = 0 (differences symmetric about 0 under H0).

    Up to MAX_EXACT_FLIPS differences, exact: enumerates every assignment of signs to |d_s| (2^n of them) and
    counts those whose mean is at least as extreme as the observed one: p = #{σ: T(σ) ≥ T_obs} / 2^n, with
    T = mean (greater), −mean (less) or |mean| (two-sided). The observed assignment is one of them, so p ≥ 2^-n.
    More differences: :func:`sign_flip_p_drawn` with FLIP_DRAWS seeded patterns.
    """
    n = len(d)
    if n == 0:
        return float("nan")
    if n > MAX_EXACT_FLIPS:
        return sign_flip_p_drawn(d, alternative)
    mags = [abs(x) for x in d]
    obs = sum(d)
    tol = TIE_RTOL * sum(mags)  # relative, so p(c·d) = p(d) for every c > 0
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


def sign_flip_p_drawn(
    d: Sequence[float], alternative: str = "two-sided", draws: int = FLIP_DRAWS, seed: int = FLIP_SEED
) -> float:
    """Monte Carlo sign-flip p-value: p = (1 + #{b: T(σ_b) ≥ T_obs}) / (B + 1) over B = ``draws`` sign patterns σ_b
    drawn uniformly (seeded), T as in :func:`sign_flip_p`, ties within TIE_RTOL·Σ|d_s| counted as extreme.

    Counting the observed pattern once more makes it a valid p-value, P(p ≤ α) ≤ α under H0 for any B (Phipson and
    Smyth 2010: permutation p-values should never be zero), at least 1/(B + 1); its standard error about the exact
    p is √(p(1 − p)/B) ≤ 0.5/√B. Patterns are drawn in blocks of 4096 (memory 4096·n·8 bytes)."""
    mags = np.abs(np.asarray(d, dtype=np.float64))  # (n,)
    obs = float(np.sum(np.asarray(d, dtype=np.float64)))
    tol = TIE_RTOL * float(mags.sum())
    rng = np.random.default_rng(seed)
    hits, left = 0, draws
    while left > 0:
        block = min(left, 4096)
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(block, len(mags)))  # (block, n) of ±1
        totals = signs @ mags  # (block,)
        if alternative == "greater":
            hits += int(np.count_nonzero(totals >= obs - tol))
        elif alternative == "less":
            hits += int(np.count_nonzero(totals <= obs + tol))
        else:
            hits += int(np.count_nonzero(np.abs(totals) >= abs(obs) - tol))
        left -= block
    return (1 + hits) / (draws + 1)


def paired_by_seed(a: Mapping[int, float], b: Mapping[int, float]) -> dict | None:
    """d = a − b over the seeds both have (``{seed: value}``): ``n``, ``mean``, its 95% t interval ``ci``, the
    two-sided paired t-test's ``t_p`` and sign-flip ``sign_flip_p`` (exact up to 20 pairs); None below 2 pairs."""
    seeds = sorted(a.keys() & b.keys())
    if len(seeds) < 2:
        return None
    d = paired_differences([a[s] for s in seeds], [b[s] for s in seeds])
    m, half = mean_ci(d)
    return {"n": len(d), "mean": m, "ci": [m - half, m + half], "t_p": paired_t_p(d), "sign_flip_p": sign_flip_p(d)}


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
    Holm-adjusted by :func:`decide`), the one-sided p-values, the sign-flip p, mean d and its 95% CI."""
    d = paired_differences(a, b)
    mean, ci = mean_ci(d) if d else (float("nan"), float("nan"))
    return {
        "kind": "less",
        "test": "paired t-test on per-seed differences (two-sided, Holm-adjusted); sign-flip p beside it",
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
        "difference and sign-flip p beside it",
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
