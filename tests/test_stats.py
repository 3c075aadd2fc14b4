"""Statistics: CIs against textbook values; verdicts on synthetic data with a known answer."""

from __future__ import annotations

import random

import pytest

from klgrad.experiments.stats import (
    NOT_SUPPORTED,
    SUPPORTED,
    UNRESOLVED,
    mean_ci,
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
