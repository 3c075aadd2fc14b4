"""Honest statistics over seeds: t-based 95% confidence intervals and named tests that produce a verdict.

**Paired tests (the design of ``klgrad compare``).** Runs that share a seed share their prompts and their sampling
uniforms (common random numbers), so the seed is a block and the unit of analysis is the per-seed difference d_s =
a_s − b_s. A prediction is decided on d by a paired t-test (the p-value that decides), with a sign-flip permutation
p-value beside it (distribution-free and exact for any n: all 2^n sign patterns enumerated up to 20 seeds, beyond
that the upper end of an exact bracket [p_lo, p_hi] from a dynamic programme on a lattice, :func:`sign_flip`,
recorded beside it; Monte Carlo only by name, :func:`sign_flip_p_drawn`; with n seeds its smallest two-sided value
is 2/2^n, so it needs n ≥ 6 to reach 0.05). Both p-values are scale invariant, and the
t-test's moves continuously with the data (t is extended by continuity to zero spread, :func:`t_statistic`), so a
verdict does not change when every difference is multiplied by one factor or moved by rounding. Every hypothesis
tested in one summary (an equivalence claim brings two) forms one family, Holm-adjusted (step-down; an equivalence
claim's two nulls cannot both hold, so they count once, :func:`holm_disjoint`) before a verdict is given. Verdicts:

- ``supported``: the claimed direction is significant (Holm-adjusted two-sided p < α);
- ``opposite``: significant in the other direction (for an equivalence claim: a significant difference);
- ``not resolved at this sample size``: neither.

An equivalence claim (a ≈ b) uses a paired TOST with a margin δ stated before the runs (not estimated from
the runs it judges): both one-sided tests of |mean d| < δ must reject (:func:`tost_p`), i.e. at α the (1 − 2α)
interval, 90% at α = 0.05 (:func:`tost_interval`), must lie inside ±δ. The unpaired Welch tests
(:func:`welch_less`, :func:`welch_equivalent`) remain for a secondary column and for designs without blocks;
their verdicts are ``supported`` / ``not supported`` / not resolved, each at α on its own p (no Holm adjustment).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scipy import stats as st

from klgrad.compare.signflip import (  # noqa: F401 (re-exported: stats is where callers look)
    FLIP_DRAWS,
    FLIP_SEED,
    LATTICE_RTOL,
    LATTICE_STATES,
    LATTICE_WORK,
    MAX_EXACT_FLIPS,
    MAX_LATTICE_SEEDS,
    TIE_RTOL,
    SignFlip,
    _flip_bracket,
    _lattice_step,
    _scaled,
    _subset_sum_cdf,
    _tail_count,
    sign_flip,
    sign_flip_enumerated,
    sign_flip_lattice,
    sign_flip_p,
    sign_flip_p_drawn,
)

SUPPORTED, NOT_SUPPORTED, UNRESOLVED = "supported", "not supported", "not resolved at this sample size"
OPPOSITE = "opposite"
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


def paired_by_seed(a: Mapping[int, float], b: Mapping[int, float]) -> dict | None:
    """d = a − b over the seeds both have (``{seed: value}``): ``n``, ``mean``, its 95% t interval ``ci``, the
    two-sided paired t-test's ``t_p`` and the exact two-sided sign-flip ``sign_flip_p`` with its
    ``sign_flip_bracket`` [p_lo, p_hi] and ``sign_flip_method`` (:func:`sign_flip`); None below 2 pairs."""
    seeds = sorted(a.keys() & b.keys())
    if len(seeds) < 2:
        return None
    d = paired_differences([a[s] for s in seeds], [b[s] for s in seeds])
    m, half = mean_ci(d)
    flip = sign_flip(d)
    return {
        "n": len(d),
        "mean": m,
        "ci": [m - half, m + half],
        "t_p": paired_t_p(d),
        "sign_flip_p": flip.p,
        "sign_flip_bracket": [flip.p_lo, flip.p_hi],
        "sign_flip_method": flip.method,
    }


def sign_flip_record(d: Sequence[float]) -> dict:
    """The two-sided sign-flip keys of a paired test's record: ``p_sign_flip`` (:func:`sign_flip`'s p, exact or
    the upper end of its bracket), ``p_sign_flip_bracket`` [p_lo, p_hi] and ``sign_flip_method``."""
    flip = sign_flip(d, "two-sided")
    return {"p_sign_flip": flip.p, "p_sign_flip_bracket": [flip.p_lo, flip.p_hi], "sign_flip_method": flip.method}


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


def holm_disjoint(p_values: Sequence[float], groups: Sequence[int]) -> list[float]:
    """Holm's step-down where hypotheses of one group are disjoint (at most one of them true, as an equivalence
    claim's H0: mean d = 0 and H0: |mean d| ≥ δ), so a group counts once in the multiplier (Shaffer 1986).

    Sort the p-values ascending: p̃_(j) = max_{r ≤ j} min(1, t_r·p_(r)), t_r = the number of distinct groups among
    the hypotheses ranked r … m (Holm's m − r + 1 when every group has one member). NaN p-values are left out of
    the family and stay NaN.

    Family-wise error ≤ α for any dependence, by closed testing with Bonferroni local tests: an intersection
    ∩_{i∈J} H_i can be true only if J holds at most one hypothesis per group. For such a J containing H_(j), let r
    ≤ j be the rank of J's smallest p; J lies among the hypotheses ranked r … m, so |J| ≤ t_r, and p̃_(j) < α gives
    min_J p = p_(r) < α/t_r ≤ α/|J|, so Bonferroni rejects ∩J. Every intersection that can hold and contains H_(j) is
    rejected: rejecting H_(j) is a closed test. An equivalence claim alone has t = 1 at both ranks, so p̃ = p: its
    TOST is decided at α itself, i.e. by the (1 − 2α) interval (:func:`tost_p`), not at α/2 as plain Holm over
    its two hypotheses would (the 95% interval at α = 0.05).
    """
    idx = sorted((i for i, p in enumerate(p_values) if not math.isnan(p)), key=lambda i: p_values[i])
    out = [float("nan")] * len(p_values)
    running = 0.0
    for rank, i in enumerate(idx):
        t = len({groups[k] for k in idx[rank:]})
        running = max(running, min(1.0, t * p_values[i]))
        out[i] = running
    return out


def tost_interval(d: Sequence[float], alpha: float = 0.05) -> list[float]:
    """The (1 − 2α) t interval of mean(d) a TOST at α reads (90% at α = 0.05):
    [m − t_{1−α, n−1}·s/√n, m + t_{1−α, n−1}·s/√n], m = mean(d), s = sd(d); NaN ends below 2 values."""
    m, half = mean_ci(d, level=1 - 2 * alpha)
    return [m - half, m + half]


def tost_p(d: Sequence[float], margin: float) -> float:
    """Paired TOST p of H0: |mean d| ≥ δ (δ = ``margin``) against equivalence |mean d| < δ (Schuirmann 1987).

    p = max(p₋, p₊), the one-sided paired t p-values of H0: mean d ≤ −δ (p₋ = P(T ≥ (m + δ)/(s/√n))) and of
    H0: mean d ≥ +δ (p₊ = P(T ≤ (m − δ)/(s/√n))), T ~ t_{n−1}, :func:`paired_t_p`. So p < α ⇔ both one-sided tests
    reject at α ⇔ m − t_{1−α}·s/√n > −δ and m + t_{1−α}·s/√n < δ ⇔ the (1 − 2α) interval :func:`tost_interval`
    (90% at α = 0.05) lies inside (−δ, δ). At zero spread the interval is the point m and p is 0 inside the
    margin, ½ on it (t = 0) and 1 outside, the same rule.
    """
    return max(paired_t_p(d, "greater", shift=-margin), paired_t_p(d, "less", shift=margin))


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
        **sign_flip_record(d),
        "n_negative": sum(x < 0 for x in d),
    }


def paired_equivalent(a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05) -> dict:
    """Claim mean(a) ≈ mean(b) within ±``margin`` over paired seeds: paired TOST on d = a − b (:func:`tost_p`,
    p_TOST = max(p(mean d ≤ −δ), p(mean d ≥ +δ))) with the (1 − 2α) interval it reads, ``ci_tost`` (90% at
    α = 0.05; equivalence at α iff it lies inside ±δ); the two-sided paired t p-value of a difference beside it."""
    if not margin > 0:
        raise ValueError(f"equivalence margin must be > 0, got {margin}")
    d = paired_differences(a, b)
    mean, ci = mean_ci(d) if d else (float("nan"), float("nan"))
    p_tost = tost_p(d, margin)
    return {
        "kind": "equivalent",
        "test": f"paired TOST on per-seed differences (margin ±{margin:.4g}, Holm-adjusted); paired t-test of a "
        "difference and sign-flip p beside it",
        "margin": margin,
        "n_pairs": len(d),
        "differences": d,
        "mean_difference": mean,
        "ci95": [mean - ci, mean + ci],
        "ci_tost": tost_interval(d, alpha) if d else [float("nan"), float("nan")],
        "ci_tost_level": 1 - 2 * alpha,
        "p_value": p_tost,
        "p_difference": paired_t_p(d, "two-sided"),
        **sign_flip_record(d),
        "n_negative": sum(x < 0 for x in d),
    }


ADJUSTMENT = "Holm step-down, an equivalence claim's two disjoint nulls counted once"
"""``adjustment`` of a decided record (:func:`holm_disjoint`); records without it were adjusted by plain Holm over
every hypothesis, an equivalence claim's two counted twice (its TOST at α/2 when alone: the 95% interval)."""


def decide(tests: Sequence[dict], alpha: float = 0.05) -> list[dict]:
    """Give each paired test its verdict, every tested hypothesis in one Holm family (module docstring).

    The family holds each ordering claim's two-sided p (H0: mean d = 0) and, for each equivalence claim, both of
    its hypotheses: the TOST p (H0: |mean d| ≥ δ) and the two-sided difference p (H0: mean d = 0), and the
    step-down runs over all of them at once. An equivalence claim's two nulls cannot both be true, so they count
    once in the multiplier (:func:`holm_disjoint`): decided alone, the TOST is at α, i.e. supported iff the
    (1 − 2α) interval (90%) lies inside ±δ. Ordering claims: supported when the adjusted p < α and mean d < 0,
    opposite when it is significant with mean d > 0. Equivalence claims: supported when the adjusted TOST p < α,
    else opposite when the adjusted difference p is. The family-wise error of the verdicts is then ≤ α (any
    dependence; simulated in the tests). Returns new dicts with ``p_adjusted`` (and ``p_difference_adjusted``
    for equivalences), ``adjustment``, ``alpha`` and ``verdict``.
    """
    slots: list[tuple[int, str]] = [(i, "p_value") for i in range(len(tests))]
    slots += [(i, "p_difference") for i, t in enumerate(tests) if t["kind"] == "equivalent"]
    family = holm_disjoint([tests[i][k] for i, k in slots], [i for i, _ in slots])  # one group per claim
    adjusted = dict(zip(slots, family, strict=True))
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
        out.append({**t, "p_adjusted": p_adj, **extra, "adjustment": ADJUSTMENT, "alpha": alpha, "verdict": verdict})
    return out
