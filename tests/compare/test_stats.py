"""Statistics: CIs against textbook values; verdicts on synthetic data with a known answer."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from klgrad.compare.stats import (
    ADJUSTMENT,
    FLIP_DRAWS,
    LATTICE_RTOL,
    NOT_SUPPORTED,
    OPPOSITE,
    SUPPORTED,
    TIE_RTOL,
    UNRESOLVED,
    SignFlip,
    decide,
    holm,
    holm_disjoint,
    mean_ci,
    paired_by_seed,
    paired_differences,
    paired_equivalent,
    paired_less,
    paired_t_p,
    sign_flip,
    sign_flip_enumerated,
    sign_flip_lattice,
    sign_flip_p,
    sign_flip_p_drawn,
    tost_interval,
    tost_p,
    welch_equivalent,
    welch_less,
)


def test_mean_ci_matches_the_t_table():
    # n = 3, sd = 1, t_{0.975, 2} = 4.302653: half-width = 4.302653 / sqrt(3)
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0
    assert h == pytest.approx(4.302653 / 3**0.5, rel=1e-6)
    assert mean_ci([5.0])[1] != mean_ci([5.0])[1]  # NaN for one value


def draws(mu: float, n: int, seed: int, sd: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mu, sd) for _ in range(n)]


def test_ordering_verdicts_on_known_data():
    assert welch_less(draws(0, 20, 1), draws(3, 20, 2))["verdict"] == SUPPORTED
    assert welch_less(draws(3, 20, 1), draws(0, 20, 2))["verdict"] == NOT_SUPPORTED
    assert welch_less(draws(0, 3, 1), draws(0.1, 3, 2))["verdict"] == UNRESOLVED


def test_false_positive_rate_is_near_alpha():
    hits = sum(welch_less(draws(0, 8, s), draws(0, 8, s + 10_000))["verdict"] == SUPPORTED for s in range(400))
    assert 0.02 < hits / 400 < 0.09  # one-sided α = 0.05 under the null


def test_equivalence_verdicts_on_known_data():
    assert welch_equivalent(draws(0, 40, 1, 0.1), draws(0.01, 40, 2, 0.1), margin=0.2)["verdict"] == SUPPORTED
    assert welch_equivalent(draws(0, 20, 1, 0.1), draws(1, 20, 2, 0.1), margin=0.2)["verdict"] == NOT_SUPPORTED
    assert welch_equivalent(draws(0, 3, 1), draws(0.2, 3, 2), margin=0.1)["verdict"] == UNRESOLVED


def test_degenerate_samples():
    assert welch_less([1.0, 1.0], [2.0, 2.0])["verdict"] == SUPPORTED
    assert welch_less([1.0, 1.0], [1.0, 1.0])["verdict"] == UNRESOLVED


# ----------------------------------------------------------------------------------------------------------
# paired tests


def test_paired_t_on_the_issue_example():
    # k2 - k3 exact KL per seed from a default `klgrad compare` (0.191-0.136, 0.268-0.218, 0.269-0.225).
    # With 2 degrees of freedom the t distribution has a closed form: two-sided p = 1 - t/sqrt(t^2 + 2).
    d = paired_differences([0.191, 0.268, 0.269], [0.136, 0.218, 0.225])
    m = sum(d) / 3
    t = m / (math.sqrt(sum((x - m) ** 2 for x in d) / 2) / math.sqrt(3))
    assert paired_t_p(d, "two-sided") == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    assert paired_t_p(d, "two-sided") == pytest.approx(0.0041, abs=5e-5)
    # The unpaired Welch test on the same six numbers cannot see it (the seed-to-seed spread dominates).
    assert welch_less([0.136, 0.218, 0.225], [0.191, 0.268, 0.269])["p_value"] > 0.1


def test_sign_flip_p_counts_the_patterns_exactly():
    # d = (1, 2, 3): the sign patterns with sum >= 6 are only (+,+,+): p = 1/8; two-sided: (+,+,+) and (-,-,-).
    assert sign_flip_p([1.0, 2.0, 3.0], "greater") == 1 / 8
    assert sign_flip_p([1.0, 2.0, 3.0], "two-sided") == 2 / 8
    assert sign_flip_p([1.0, 2.0, 3.0], "less") == 1.0
    # d = (1, -1): sums 0, 2, -2, 0 -> P(|sum| >= 0) = 1
    assert sign_flip_p([1.0, -1.0], "two-sided") == 1.0
    assert sign_flip_p([0.5] * 6, "two-sided") == 2 / 64  # the smallest two-sided value for n = 6


def test_holm_matches_the_textbook_example():
    # Holm (1979) step-down: sorted p (0.01, 0.02, 0.03, 0.5) -> (0.04, 0.06, 0.06, 0.5)
    assert holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06])
    assert holm([0.2, float("nan")])[0] == 0.2  # NaN is not part of the family


def test_paired_verdicts_supported_opposite_unresolved():
    base = draws(0, 8, 1, sd=5.0)  # a large seed effect shared by both arms (the block)
    lower = [x - 1 + e for x, e in zip(base, draws(0, 8, 2, sd=0.1), strict=True)]
    same = [x + e for x, e in zip(base, draws(0, 8, 3, sd=1.0), strict=True)]
    tests = [paired_less(lower, base), paired_less(base, lower), paired_less(same, base)]
    verdicts = [t["verdict"] for t in decide(tests)]
    assert verdicts == [SUPPORTED, OPPOSITE, UNRESOLVED]
    assert all("paired" in t["test"] for t in tests)
    assert welch_less(lower, base)["verdict"] == UNRESOLVED  # unpaired, the seed effect hides the shift


def test_paired_equivalence_verdicts():
    base = draws(0, 10, 4, sd=5.0)
    near = [x + e for x, e in zip(base, draws(0, 10, 5, sd=0.01), strict=True)]
    far = [x + 1 + e for x, e in zip(base, draws(0, 10, 6, sd=0.01), strict=True)]
    got = decide([paired_equivalent(near, base, 0.1), paired_equivalent(far, base, 0.1)])
    assert [t["verdict"] for t in got] == [SUPPORTED, OPPOSITE]
    with pytest.raises(ValueError, match="margin"):
        paired_equivalent(near, base, 0.0)


def test_paired_false_positive_rate_is_near_alpha():
    # Under the null (no shift), a two-sided paired t-test at 0.05 rejects 5% of the time in either direction;
    # 400 trials: binomial sd 1.1%, so [2%, 9%] holds with probability > 0.999.
    hits = 0
    for s in range(400):
        base = draws(0, 6, s, sd=3.0)
        other = [x + e for x, e in zip(base, draws(0, 6, s + 10_000), strict=True)]
        hits += decide([paired_less(other, base)])[0]["verdict"] != UNRESOLVED
    assert 0.02 < hits / 400 < 0.09


def test_zero_spread_gets_the_limit_of_a_small_spread():
    # n equal differences: t = ±inf, the limit of t as the spread shrinks, so p = 0 (two-sided and in their own
    # direction) and 1 against it, like the same differences a rounding apart.
    assert paired_t_p([0.3, 0.3], "two-sided") == 0.0
    assert paired_t_p([0.3, 0.3], "greater") == 0.0
    assert paired_t_p([0.3, 0.3], "less") == 1.0
    assert paired_t_p([0.2, 0.2], "less", shift=0.2) == 0.5  # d = shift exactly: t = 0, no evidence either way
    assert paired_t_p([0.0] * 4, "two-sided") == 1.0
    # 1.0 − 1.3 and 2.0 − 2.3 differ by 2.2e-16 (one ulp of 2.3): t ≈ 3·10^15, p below 1e-15 either way.
    got = decide([paired_less([1.0, 2.0], [1.3, 2.3])])[0]
    assert got["p_value"] < 1e-15
    assert got["verdict"] == SUPPORTED
    assert got["p_sign_flip"] == 0.5  # the distribution-free p beside it: 2 of 4 sign patterns as extreme
    assert decide([paired_less([0.0] * 6, [0.5] * 6)])[0]["verdict"] == SUPPORTED
    assert paired_equivalent([0.01] * 3, [0.0] * 3, margin=0.1)["p_value"] == 0.0


ALPHA = 0.05


def verdict_of(d: list[float]) -> str:
    """The verdict of "mean(a) < mean(b)" on per-seed differences d, alone in its Holm family."""
    return decide([paired_less(d, [0.0] * len(d))], alpha=ALPHA)[0]["verdict"]


def test_equal_differences_are_no_cliff_under_a_1e_9_change():
    """The audit's example: five equal differences of 0.05 gave p = 0.0625 (the sign-flip fallback) and, with
    one of them moved by 1e-9, p = 1.5e-33 (the t-test). Now both are the t-test's p, ~0 at this spread."""
    d = [0.05] * 5
    moved = [*d[:4], 0.05 + 1e-9]
    for alt in ("two-sided", "less", "greater"):
        assert paired_t_p(moved, alt) == pytest.approx(paired_t_p(d, alt), abs=1e-12)
    assert verdict_of([-x for x in d]) == verdict_of([-x for x in moved]) == SUPPORTED


@pytest.mark.parametrize("factor", [1e-10, 1e6])
@pytest.mark.parametrize(
    "d",
    [[0.05] * 5, [1e-3] * 5, [-0.2] * 3, [0.3, -0.1, 0.25, 0.2, 0.4], [1.0, 1.0, 2.0, -1.0, 0.5, 0.5]],
    ids=["equal", "equal-small", "equal-negative", "spread", "ties"],
)
def test_p_values_and_verdicts_are_scale_invariant(d, factor):
    """Every difference times one factor: same p (t and sign-flip) and verdict."""
    scaled = [x * factor for x in d]
    for alt in ("two-sided", "less", "greater"):
        assert paired_t_p(scaled, alt) == pytest.approx(paired_t_p(d, alt), rel=1e-9, abs=1e-12)
        assert sign_flip_p(scaled, alt) == sign_flip_p(d, alt)
    assert verdict_of(scaled) == verdict_of(d)


def test_tiny_equal_differences_get_the_same_p_as_large_ones():
    """The audit's example: five differences of 1e-13 gave p = 1 (an absolute sign-flip tie tolerance of 1e-12
    made every sign pattern a tie) where five of 0.05 gave 0.0625."""
    assert sign_flip_p([1e-13] * 5) == sign_flip_p([0.05] * 5) == 2 / 32
    assert paired_t_p([1e-13] * 5) == paired_t_p([0.05] * 5) == 0.0


differences = st.lists(st.integers(-1000, 1000).map(lambda k: k / 1000), min_size=2, max_size=12)
"""Per-seed differences in [−1, 1] on a grid of 1e-3: exact ties and equal values are common."""


@settings(max_examples=300, deadline=None)
@given(differences, st.lists(st.floats(-1.0, 1.0), min_size=12, max_size=12))
@example([0.05] * 5, [0.0] * 4 + [1.0] + [0.0] * 7)
@example([-0.05] * 5, [1.0] * 12)
def test_a_relative_change_of_1e_9_moves_p_by_at_most_1e_6(d, noise):
    """d_s → d_s·(1 + 1e-9·η_s), |η_s| ≤ 1: the paired t p moves by at most 1e-6, so the verdict changes only
    where p is within 1e-6 of α (never hit here). Fails on the old code at every run of equal differences."""
    moved = [x * (1 + 1e-9 * e) for x, e in zip(d, noise, strict=False)]
    for alt in ("two-sided", "less", "greater"):
        assert abs(paired_t_p(moved, alt) - paired_t_p(d, alt)) <= 1e-6
    p = paired_t_p(d, "two-sided")
    assume(abs(p - ALPHA) > 1e-6)
    assert verdict_of(moved) == verdict_of(d)


@settings(max_examples=300, deadline=None)
@given(differences, st.sampled_from([1e-10, 1e-3, 3.0, 1e6]))
def test_a_common_factor_changes_no_p_value(d, factor):
    """d → c·d for c > 0: t and the sign-flip count are invariant (the tie tolerance is relative to Σ|d|)."""
    scaled = [x * factor for x in d]
    for alt in ("two-sided", "less", "greater"):
        assert paired_t_p(scaled, alt) == pytest.approx(paired_t_p(d, alt), rel=1e-9, abs=1e-12)
        assert sign_flip_p(scaled, alt) == sign_flip_p(d, alt)
    assert verdict_of(scaled) == verdict_of(d)


def test_one_holm_family_holds_both_hypotheses_of_an_equivalence_claim():
    """Both hypotheses of an equivalence claim are in the family, and as they cannot both be true they count once
    in the multiplier (holm_disjoint): t_r = the number of claims with a hypothesis ranked r or later."""
    tests = [
        {"kind": "less", "p_value": 0.004, "mean_difference": -1.0},
        {"kind": "equivalent", "p_value": 0.9, "p_difference": 0.012, "mean_difference": 0.5},
    ]
    got = decide(tests)
    # sorted 0.004 (claims 0, 1 left: ×2) → 0.008; 0.012 (claim 1 left: ×1) → 0.012; 0.9 → 0.9
    assert got[0]["p_adjusted"] == pytest.approx(0.008)
    assert got[0]["verdict"] == SUPPORTED
    assert got[1]["p_adjusted"] == pytest.approx(0.9)
    assert got[1]["p_difference_adjusted"] == pytest.approx(0.012)
    assert got[1]["verdict"] == OPPOSITE
    assert {t["adjustment"] for t in got} == {ADJUSTMENT}
    # With a third, weaker ordering claim: 0.004 (×3) → 0.012; 0.012 (claims 1, 2 left: ×2) → 0.024; 0.03 (claims
    # 2 and 1's TOST left: ×2) → 0.06; 0.9. Still opposite, and the weak claim is not resolved.
    got = decide([*tests, {"kind": "less", "p_value": 0.03, "mean_difference": -1.0}])
    assert got[1]["p_difference_adjusted"] == pytest.approx(0.024)
    assert got[2]["p_adjusted"] == pytest.approx(0.06)
    assert got[2]["verdict"] == UNRESOLVED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
def test_holm_disjoint_is_holm_when_every_group_has_one_hypothesis(ps):
    assert holm_disjoint(ps, list(range(len(ps)))) == pytest.approx(holm(ps))
    # one group holding everything (pairwise disjoint nulls): at most one is true, no adjustment at all
    assert holm_disjoint(ps, [0] * len(ps)) == pytest.approx(ps)


def test_tost_p_is_the_larger_one_sided_p():
    """p_TOST = max of the one-sided t p-values of mean d ≤ −δ and mean d ≥ +δ (scipy's one-sample t-tests)."""
    from scipy import stats as scipy_stats

    d, margin = [0.12, -0.05, 0.3, 0.08, 0.02, 0.15, -0.1, 0.2], 0.25
    lower = scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    upper = scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue
    assert tost_p(d, margin) == pytest.approx(max(lower, upper), rel=1e-12)
    assert paired_equivalent(d, [0.0] * 8, margin)["p_value"] == tost_p(d, margin)


def test_an_equivalence_decided_alone_reads_the_90_percent_interval():
    """The k1_as_loss ≈ none design: 8 seeds, margin δ. Here the 90% interval lies inside ±δ and the 95% one does
    not, so the TOST at α = 0.05 holds (p_TOST < 0.05) and the claim is supported. The former rule (plain Holm over
    its two hypotheses, the TOST at α/2) said not resolved: p_adjusted was 2·p_TOST."""
    d = [-0.35, 0.1, -0.2, 0.05, -0.4, 0.25, -0.1, -0.15]
    m, h90 = mean_ci(d, 0.90)
    _, h95 = mean_ci(d, 0.95)
    margin = max(abs(m - h90), abs(m + h90)) + 0.01  # just outside the 90% interval's ends
    assert max(abs(m - h95), abs(m + h95)) > margin  # … and inside the 95% one's
    test = paired_equivalent(d, [0.0] * 8, margin)
    assert test["ci_tost"] == pytest.approx([m - h90, m + h90])
    assert test["ci_tost_level"] == pytest.approx(0.90)
    assert 0.025 < test["p_value"] < 0.05
    got = decide([test])[0]
    assert got["p_adjusted"] == test["p_value"]  # alone: t = 1 at both ranks
    assert got["verdict"] == SUPPORTED
    assert holm([test["p_value"], test["p_difference"]])[0] >= 0.05  # plain Holm: not resolved


@settings(max_examples=300, deadline=None)
@given(differences, st.floats(0.01, 1.0))
def test_tost_rejects_exactly_when_the_90_percent_interval_is_inside_the_margin(d, margin):
    lo, hi = tost_interval(d, alpha=0.05)
    assume(min(abs(lo + margin), abs(hi - margin)) > 1e-9)  # not on the boundary
    assert (tost_p(d, margin) < 0.05) == (-margin < lo and hi < margin)


def test_paired_samples_must_have_one_value_per_seed():
    with pytest.raises(ValueError, match="one value per seed"):
        paired_differences([1.0, 2.0], [1.0])


def test_paired_by_seed_pairs_the_seeds_both_have_and_uses_the_paired_tests():
    a = {0: 0.30, 1: 0.28, 2: 0.20, 3: 0.25, 9: 5.0}  # seed 9 has no partner: left out
    b = {0: 0.31, 1: 0.26, 2: 0.33, 3: 0.30, 7: -5.0}
    got = paired_by_seed(a, b)
    d = [a[s] - b[s] for s in range(4)]
    m, half = mean_ci(d)
    p = sign_flip_p(d)
    assert got == {
        "n": 4,
        "mean": m,
        "ci": [m - half, m + half],
        "t_p": paired_t_p(d),
        "sign_flip_p": p,
        "sign_flip_bracket": [p, p],
        "sign_flip_method": "enumerated",
    }
    assert paired_by_seed({0: 1.0}, {0: 2.0, 1: 3.0}) is None  # one pair: no spread, no test


def test_the_drawn_sign_flip_p_agrees_with_the_exact_one_within_its_standard_error():
    """n = 14 (16384 patterns, exact): the drawn p is within 5 standard errors √(p(1 − p)/B) of the exact p, for
    each alternative; never below 1/(B + 1); and the same differences get the same p (seeded)."""
    d = [0.31, -0.12, 0.05, 0.22, -0.4, 0.18, 0.09, -0.03, 0.27, 0.11, -0.16, 0.08, 0.2, -0.07]
    for alt in ("two-sided", "greater", "less"):
        exact = sign_flip_p(d, alt)
        drawn = sign_flip_p_drawn(d, alt)
        se = math.sqrt(max(exact * (1 - exact), 1 / FLIP_DRAWS) / FLIP_DRAWS)
        assert abs(drawn - exact) <= 5 * se + 1 / (FLIP_DRAWS + 1), alt  # + the observed pattern counted once more
        assert drawn == sign_flip_p_drawn(d, alt)
    assert sign_flip_p_drawn([0.5] * 6, draws=1000) >= 1 / 1001


def test_more_than_twenty_differences_get_the_exact_p_not_the_drawn_floor():
    """n = 24, every difference equal and positive: the exact two-sided p is 2/2^24 ≈ 1.2e-7 (only (+,…,+) and
    (−,…,−) reach |Σ| = 24·0.05), below the drawn p's floor 1/(B + 1) ≈ 7.6e-6 that a 131,072-draw Monte Carlo
    reported; the lattice holds every |d_s|, so the bracket has width 0. Symmetric differences give p = 1; a
    common power-of-two factor leaves the bracket bit for bit, any factor leaves it around the same p."""
    got = sign_flip([0.05] * 24)
    assert got == SignFlip(2 / 2**24, 2 / 2**24, 2 / 2**24, "lattice")
    assert sign_flip_p([0.05] * 24) < 1 / (FLIP_DRAWS + 1)
    assert sign_flip_p([1.0, -1.0] * 12) == 1.0
    d = [0.3 * (-1) ** i + 0.01 * i for i in range(30)]
    for alt in ("two-sided", "greater", "less"):
        assert sign_flip(d, alt) == sign_flip([2.0**-30 * x for x in d], alt)
        assert sign_flip_p([1e-9 * x for x in d], alt) == pytest.approx(sign_flip_p(d, alt), rel=LATTICE_RTOL)
    assert paired_by_seed({s: float(s) for s in range(25)}, {s: 0.0 for s in range(25)})["sign_flip_p"] > 0


# ----------------------------------------------------------------------------------------------------------
# the sign-flip p, exact for any n: enumeration (n <= 20) and the lattice bracket


def plain_loop_sign_flip_p(d: list[float], alternative: str) -> float:
    """The reference: every sign pattern in a Python loop, each sum left to right (the former implementation)."""
    mags = [abs(x) for x in d]
    obs, tol, hits = sum(d), TIE_RTOL * sum(mags), 0
    for pattern in range(1 << len(d)):
        total = sum(-m if (pattern >> i) & 1 else m for i, m in enumerate(mags))
        if alternative == "greater":
            hits += total >= obs - tol
        elif alternative == "less":
            hits += total <= obs + tol
        else:
            hits += abs(total) >= abs(obs) - tol
    return hits / (1 << len(d))


def meet_in_the_middle_p(d: list[float]) -> float:
    """An independent exact two-sided count for n up to ~36: the 2^(n/2) sums of each half, one half sorted,
    #{a + b ≥ c} by binary search; p = 2·# / 2^n for c = |Σd| − tol > 0 (the mirror patterns)."""
    a = np.abs(np.asarray(d))
    c = abs(sum(d)) - TIE_RTOL * float(a.sum())
    assert c > 0

    def sums(x: np.ndarray) -> np.ndarray:
        s = np.zeros(1)
        for m in x:
            s = np.concatenate((s + m, s - m))
        return s

    left, right = sums(a[: len(a) // 2]), np.sort(sums(a[len(a) // 2 :]))
    count = int(np.sum(len(right) - np.searchsorted(right, c - left, side="left")))
    return 2 * count / 2 ** len(d)


ALTERNATIVES = ("two-sided", "greater", "less")


@pytest.mark.parametrize("n", [1, 2, 5, 9, 13])
def test_vectorised_enumeration_equals_the_plain_loop_bit_for_bit(n):
    rng = random.Random(n)
    for d in ([rng.gauss(0.2, 1) for _ in range(n)], [rng.randint(-3, 3) / 10 for _ in range(n)]):
        for alt in ALTERNATIVES:
            assert sign_flip_enumerated(d, alt) == plain_loop_sign_flip_p(d, alt)


@pytest.mark.parametrize("n", [1, 2, 7, 20, 21, 33, 56, 70])
def test_closed_forms_for_equal_magnitudes(n):
    """|d_s| all equal with j of them negative: S = (n − 2J)·|d| for J ~ Binomial(n, ½) sign changes, so the
    two-sided p = P(|n − 2J| ≥ |n − 2j|), greater P(n − 2J ≥ n − 2j) = P(J ≤ j), less P(J ≥ j). All positive:
    2/2^n, 1/2^n and 1. Beyond 20 seeds the lattice holds the magnitude, so the bracket has width 0 while the
    counts are int64 (≤ 62 seeds); at 70 they are float64 probabilities, the bracket widened by their rounding
    bound γ_{n+Σk+1} ≈ 2^22·u ≈ 5e-10 (relative)."""
    for j in sorted({0, 1, n // 3, n // 2, n}):
        d = [-0.37] * j + [0.37] * (n - j)
        law = [math.comb(n, k) / 2**n for k in range(n + 1)]
        want = {
            "two-sided": sum(q for k, q in enumerate(law) if abs(n - 2 * k) >= abs(n - 2 * j)),
            "greater": sum(law[: j + 1]),
            "less": sum(law[j:]),
        }
        for alt in ALTERNATIVES:
            got = sign_flip(d, alt)
            if n <= 62:
                assert got.p_lo == got.p == got.p_hi, (j, alt)
            else:
                assert got.p_lo <= want[alt] * (1 + 1e-13), (j, alt)  # want: a float sum of ≤ 71 terms
                assert want[alt] <= got.p_hi * (1 + 1e-13), (j, alt)
                assert got.p_hi - got.p_lo <= 1e-9 * got.p_hi
            assert got.p == pytest.approx(want[alt], rel=1e-12 if n <= 62 else 1e-9), (j, alt)
    assert sign_flip([0.37] * n).p == pytest.approx(2 / 2**n, rel=1e-12 if n <= 62 else 1e-9)  # n = 1: p = 1


def test_zeros_double_every_count_and_change_no_p():
    """A zero difference takes both signs with the same sum: p is that of the nonzero ones (24 zeros + 8 equal
    positives: 2/2^8), and all-zero differences tie with every pattern: p = 1 whichever alternative."""
    assert sign_flip([0.0] * 24 + [0.5] * 8) == SignFlip(2 / 2**8, 2 / 2**8, 2 / 2**8, "lattice")
    assert sign_flip([0.0] * 6 + [0.5] * 8).p == 2 / 2**8
    for n in (1, 5, 30):
        for alt in ALTERNATIVES:
            assert sign_flip([0.0] * n, alt).p == 1.0


@pytest.mark.parametrize("n", [21, 24, 28, 32])
def test_the_bracket_holds_an_independent_exact_count_beyond_twenty(n):
    """Gaussian differences past enumeration: meet in the middle counts all 2^n patterns exactly; the default
    lattice's bracket holds it and is at most LATTICE_RTOL·p_hi wide (no ties here)."""
    rng = random.Random(100 + n)
    d = [rng.gauss(0.35, 1.0) for _ in range(n)]
    exact = meet_in_the_middle_p(d)
    got = sign_flip(d)
    assert got.method == "lattice"
    assert got.p_lo <= exact <= got.p_hi
    assert got.p_hi - got.p_lo <= LATTICE_RTOL * got.p_hi


HELD_OUT_K2_MINUS_K3 = (
    0.024541468324493165, 0.04283283812559724, 0.05193684709016741, -0.0016926692417328637, 0.0008966331694291729,
    0.037398385382250376, -0.02420556652395428, 0.049141732317452114, -0.014449779599132212, 0.02034148784232026,
    0.07131585090660672, -0.03195359702307704, 0.047604494955982346, -0.037429730399156425, -0.020733161553301488,
    0.0029991124726881646, 0.05169960596596598, 0.06309083838787838, 0.007348596174047428, 0.059903757713327815,
    0.015323489070969948, 0.00711231265518622, 0.0523215236452618, 0.08243660396594873, 0.009737904829773658,
    -0.009665477241469433, 0.016799597096191027, 0.0011573436540116555, 0.09007987350559055, 0.008922069675598249,
    0.020209125576371, 0.030366533709871663, 0.01423126150538298, 0.009388998862435771, -0.029159684760771798,
    0.058793020792818895, 0.01894847755276255, 0.06493024157689606, 0.06803905685581041, -0.010894988663053773,
    -0.05425688197324241, 0.01881074521354023, -0.015407996222034703, 0.038506619149355104, 0.05479771921830068,
    0.04629144589412146, 0.028856152775274646, 0.026214164322421796, 0.062358704705976015, 0.032164621161903384,
    0.04065664337194358, 0.04738921259430129, -0.011989874327662353, 0.03690939154040315, 0.025995283458220997,
    0.040959319497426455,
)  # fmt: skip
"""k2_as_loss − k3_as_loss, held-out stepwise KL, the 56 seeds of results/smollm2_sharpen_converged (summary.json)."""


def test_the_56_seed_held_out_difference_gets_its_exact_p():
    """Reported as 7.63e-06, the floor 1/(B + 1) of 131,072 drawn patterns (no draw as extreme). The exact
    two-sided count, by meet in the middle over the 2^28 sums of each half of the seeds (:func:`meet_in_the_middle_p`
    at n = 56, in chunks: minutes and 2 GiB, so run once, not here), is 2·48,112,803,256 of 2^56 patterns: p =
    1.335398548851785e-06, inside the bracket."""
    got = sign_flip(list(HELD_OUT_K2_MINUS_K3))
    assert got.method == "lattice"
    assert got.p_lo <= 96_225_606_512 / 2**56 <= got.p_hi
    assert got.p_hi - got.p_lo <= LATTICE_RTOL * got.p_hi
    assert got.p < 1 / (FLIP_DRAWS + 1)


def test_the_lattice_bracket_is_rigorous_at_a_coarse_lattice():
    """K = 16 lattice points for 18 Gaussian differences: E is large, the bracket wide, and still it holds the
    enumerated p for every alternative (the inclusions of sign_flip_lattice's docstring, not an estimate)."""
    rng = random.Random(7)
    for _ in range(20):
        d = [rng.gauss(0.1, 1.0) for _ in range(18)]
        for alt in ALTERNATIVES:
            got, exact = sign_flip_lattice(d, alt, states=16), sign_flip_enumerated(d, alt)
            assert got.p_lo <= exact <= got.p_hi


magnitudes = st.one_of(
    st.integers(-6, 6).map(lambda k: k / 4),  # a coarse grid: ties, zeros, equal values
    st.floats(-1.0, 1.0, allow_subnormal=False),
    st.floats(1e-300, 1e300).flatmap(lambda x: st.sampled_from([x, -x])),  # huge and tiny magnitudes
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(magnitudes, min_size=1, max_size=13),
    st.sampled_from(ALTERNATIVES),
    st.sampled_from([None, 8, 100, 4096]),
)
@example([0.25] * 13, "two-sided", None)  # all equal
@example([0.0] * 13, "greater", 8)  # all zero
@example([1e300, -1e-300, 2e299, 0.0, -1e300], "two-sided", None)  # 600 decades apart
@example([0.5], "greater", None)  # n = 1
@example([1.0, -1.0, 0.5, -0.5, 0.25, -0.25], "less", 8)  # the observed sum 0: ties everywhere
def test_the_lattice_bracket_holds_the_enumerated_p(d, alt, states):
    """Any differences, any lattice size: p_lo ≤ the enumerated p ≤ p_hi, and p = p_hi; a power-of-two multiple
    of d (exact in floating point) gets the same bracket bit for bit."""
    exact = sign_flip_enumerated(d, alt)
    got = sign_flip_lattice(d, alt, states=states)
    assert got.p_lo <= exact <= got.p_hi, (got, exact)
    assert got.p == got.p_hi
    assert 2.0 ** -len(d) <= got.p_lo  # the observed pattern is counted on its own sum, never through E
    assert sign_flip_lattice([x * 2.0**-20 for x in d], alt, states=states) == got
