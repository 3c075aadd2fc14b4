"""klgrad.reproduce.uniform_theory: k1/k2/k3 when the reference's support is wider than the sampler's."""

from __future__ import annotations

import math

import pytest
from scipy import integrate

from klgrad.reproduce.uniform_theory import uniform_estimator_values, uniform_kl

LOG2 = math.log(2.0)


def test_the_papers_example_by_hand():
    # q = U[0, 1], p = U[0, 2]: r = 1/2 on [0, 1], KL = log 2, k3 = 1/2 - 1 + log 2 (biased by E_q[r] - 1 = -1/2)
    v = uniform_estimator_values(1.0, 2.0)
    assert v == {"k1": LOG2, "k2": 0.5 * LOG2**2, "k3": LOG2 - 0.5, "E_q_r": 0.5}
    assert uniform_kl(1.0, 2.0) == LOG2


@pytest.mark.parametrize(("w_q", "w_p"), [(1.0, 2.0), (0.3, 0.5), (2.0, 7.0), (1.5, 1.5)])
def test_against_quadrature_over_supp_q(w_q, w_p):
    # E_q[f(r)] = ∫_0^{w_q} f(p/q) / w_q dx with p = 1/w_p, q = 1/w_q
    r = w_q / w_p
    mean = lambda f: integrate.quad(lambda x: f(r) / w_q, 0.0, w_q)[0]  # noqa: E731
    v = uniform_estimator_values(w_q, w_p)
    assert v["k1"] == pytest.approx(mean(lambda r: -math.log(r)), abs=1e-14)
    assert v["k2"] == pytest.approx(mean(lambda r: 0.5 * math.log(r) ** 2), abs=1e-14)
    assert v["k3"] == pytest.approx(mean(lambda r: r - 1 - math.log(r)), abs=1e-14)
    assert v["E_q_r"] == pytest.approx(mean(lambda r: r), abs=1e-14)
    assert v["k3"] - v["k1"] == pytest.approx(v["E_q_r"] - 1.0, abs=1e-15)  # E[k3] = (E_q[r] - 1) + KL
    assert (v["k3"] == v["k1"]) == (w_q == w_p)  # unbiased only when the supports agree


def test_out_of_range_widths():
    assert uniform_kl(2.0, 1.0) == math.inf  # q has mass where p has none
    with pytest.raises(ValueError, match="width_q"):
        uniform_estimator_values(2.0, 1.0)
    with pytest.raises(ValueError, match="width_q"):
        uniform_kl(0.0, 1.0)
