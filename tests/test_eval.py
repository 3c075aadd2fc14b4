"""``klgrad eval``: the unbiased pass@k estimator, model and benchmark resolution, and the command end to end on
the embedded model (its greedy accuracy against transformers ``generate`` scored independently here)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.eval.passk import mean_pass_at_k, pass_at_k

# --------------------------------------------------------------------------------------------------------------
# pass@k


def _exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 − C(n−c, k)/C(n, k) in exact rationals (math.comb is 0 when k > n − c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_equals_the_binomial_formula_for_every_small_case():
    for n in range(1, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_exact_pass_at_k(n, c, k)), rel=1e-13, abs=1e-15)


def test_pass_at_k_hand_cases():
    assert pass_at_k(2, 1, 1) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 − C(3,2)/C(5,2)
    assert pass_at_k(10, 1, 5) == pytest.approx(0.5)  # one correct sample among 10, half the 5-subsets hold it
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 3) == 1.0  # n − c = 2 < k = 3: every 3-subset holds a correct sample


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 500), st.data())
def test_pass_at_1_is_the_fraction_correct(n, data):
    c = data.draw(st.integers(0, n))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-12, abs=1e-15)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.data())
def test_pass_at_k_is_monotone_in_k_and_c_and_a_probability(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    p = pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= p - 1e-15
    if c < n:
        assert pass_at_k(n, c + 1, k) >= p - 1e-15
    assert (p == 0.0) == (c == 0)
    if n - c < k:  # every k-subset holds a correct sample
        assert p == 1.0


@settings(max_examples=200, deadline=None)
@given(st.integers(1_000, 10**6), st.floats(0.0, 1.0), st.integers(1, 64))
def test_pass_at_k_tends_to_sampling_with_replacement(n, p, k):
    """C(n−c,k)/C(n,k) = ∏_{j<k} (n−c−j)/(n−j) lies between ((n−c−k+1)/(n−k+1))^k and (1 − c/n)^k, so
    pass@k → 1 − (1 − p)^k as n grows with c/n = p (k independent draws)."""
    c = round(p * n)
    value = pass_at_k(n, c, k)
    lower = 1 - (1 - c / n) ** k
    upper = 1 - max(0.0, (n - c - k + 1) / (n - k + 1)) ** k
    assert lower - 1e-12 <= value <= upper + 1e-12
    assert value == pytest.approx(1 - (1 - c / n) ** k, abs=k * k / n + 1e-12)


def test_pass_at_k_has_no_overflow_at_large_n():
    assert pass_at_k(10**7, 10**6, 100) == pytest.approx(1 - 0.9**100, rel=1e-4)
    assert pass_at_k(10**7, 1, 1) == pytest.approx(1e-7, rel=1e-9)  # small values keep their digits


@pytest.mark.parametrize(("n", "c", "k", "name"), [(4, 5, 1, "c"), (4, -1, 1, "c"), (4, 2, 0, "k"), (4, 2, 5, "k")])
def test_pass_at_k_refuses_impossible_counts(n, c, k, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_is_the_mean_over_problems():
    assert mean_pass_at_k([0, 2, 4], 4, 1) == pytest.approx((0 + 0.5 + 1) / 3)
    assert mean_pass_at_k([0, 1, 4], 4, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 4, 1)
