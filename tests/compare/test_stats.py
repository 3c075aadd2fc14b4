"""Statistics: CIs against textbook values; verdicts on synthetic data with a known answer."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from klgrad.compare.stats import (
    FLIP_DRAWS,
    NOT_SUPPORTED,
    OPPOSITE,
    SUPPORTED,
    UNRESOLVED,
    decide,
    holm,
    mean_ci,
    paired_by_seed,
    paired_differences,
    paired_equivalent,
    paired_less,
    paired_t_p,
    sign_flip_p,
    sign_flip_p_drawn,
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
    """m counts the equivalence claim twice; its difference p is adjusted by the same step-down, not apart."""
    tests = [
        {"kind": "less", "p_value": 0.004, "mean_difference": -1.0},
        {"kind": "equivalent", "p_value": 0.9, "p_difference": 0.012, "mean_difference": 0.5},
    ]
    got = decide(tests)
    # family (0.004, 0.9, 0.012): Holm → 0.012, 0.9, max(0.012, 2·0.012) = 0.024
    assert got[0]["p_adjusted"] == pytest.approx(0.012)
    assert got[0]["verdict"] == SUPPORTED
    assert got[1]["p_adjusted"] == pytest.approx(0.9)
    assert got[1]["p_difference_adjusted"] == pytest.approx(0.024)
    assert got[1]["verdict"] == OPPOSITE
    # With a third, weaker ordering claim the difference's rank moves: (0.004, 0.9, 0.012, 0.03) → 0.016,
    # 0.9, 0.036, 0.06: still opposite, and the weak claim is not resolved.
    got = decide([*tests, {"kind": "less", "p_value": 0.03, "mean_difference": -1.0}])
    assert got[1]["p_difference_adjusted"] == pytest.approx(0.036)
    assert got[2]["p_adjusted"] == pytest.approx(0.06)
    assert got[2]["verdict"] == UNRESOLVED


def test_paired_samples_must_have_one_value_per_seed():
    with pytest.raises(ValueError, match="one value per seed"):
        paired_differences([1.0, 2.0], [1.0])


def test_paired_by_seed_pairs_the_seeds_both_have_and_uses_the_paired_tests():
    a = {0: 0.30, 1: 0.28, 2: 0.20, 3: 0.25, 9: 5.0}  # seed 9 has no partner: left out
    b = {0: 0.31, 1: 0.26, 2: 0.33, 3: 0.30, 7: -5.0}
    got = paired_by_seed(a, b)
    d = [a[s] - b[s] for s in range(4)]
    m, half = mean_ci(d)
    assert got == {"n": 4, "mean": m, "ci": [m - half, m + half], "t_p": paired_t_p(d), "sign_flip_p": sign_flip_p(d)}
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


def test_more_than_twenty_differences_get_the_drawn_p_with_the_exact_ps_properties():
    """n = 24: all differences equal and positive, the exact two-sided p is 2/2^24 ≈ 1.2e-7, below what B draws can
    show: the drawn p is its floor 1/(B + 1) (at most 2 of 2^17 draws hit the two extreme patterns, probability
    ≈ 1.6e-2); symmetric differences give p = 1; scaling every difference leaves p unchanged."""
    assert sign_flip_p([0.05] * 24) <= 3 / (FLIP_DRAWS + 1)
    assert sign_flip_p([1.0, -1.0] * 12) == 1.0
    d = [0.3 * (-1) ** i + 0.01 * i for i in range(30)]
    for alt in ("two-sided", "greater", "less"):
        assert sign_flip_p([1e-9 * x for x in d], alt) == sign_flip_p(d, alt)
    assert paired_by_seed({s: float(s) for s in range(25)}, {s: 0.0 for s in range(25)})["sign_flip_p"] > 0
