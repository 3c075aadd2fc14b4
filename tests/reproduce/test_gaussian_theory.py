"""klgrad.reproduce.gaussian_theory: the Gaussian closed forms of the paper's appendix I.

Checked by hand-worked values and by quadrature (scipy). Tolerances: float64 (u = 2^-53 ≈ 1.1e-16) closed forms
of magnitude O(1) agree with a second correct evaluation to a few ulps, ≲ 1e-15 absolute; Gauss-Hermite sums of
40 terms to ≲ 1e-12; the quadrature checks use the integrator's requested relative accuracy (1e-11) with room
for its error estimate (1e-9 to 1e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import integrate

from klgrad.reproduce.gaussian_theory import (
    gaussian_estimator_moments,
    gaussian_kl,
    gaussian_ratio_moment,
    k3_variance_is_finite,
    log_ratio_quadratic,
)
from klgrad.reproduce.k3_gaussian import PAPER_TRUE_KL

pytestmark = pytest.mark.numerics


def test_gaussian_kl_is_the_papers_true_kl_in_the_q_to_p_direction():
    # KL(q||p), q = N(0.1, 0.2^2) the sampler, p = N(0, 1): log(1/0.2) + (0.04 + 0.01)/2 - 1/2 = log 5 - 0.475
    kl = gaussian_kl(0.1, 0.2, 0.0, 1.0)
    assert kl == pytest.approx(math.log(5.0) - 0.475, abs=1e-15)
    assert abs(kl - PAPER_TRUE_KL) < 1e-4  # paper: "True KL Divergence: 1.1344"
    q, p = torch.distributions.Normal(0.1, 0.2), torch.distributions.Normal(0.0, 1.0)
    assert kl == pytest.approx(float(torch.distributions.kl_divergence(q, p)), rel=1e-6)
    # the other direction is not what the paper means: KL(p||q) = log 0.2 + (1 + 0.01)/0.08 - 1/2
    assert gaussian_kl(0.0, 1.0, 0.1, 0.2) == pytest.approx(math.log(0.2) + 1.01 / 0.08 - 0.5, abs=1e-12)
    assert abs(gaussian_kl(0.0, 1.0, 0.1, 0.2) - PAPER_TRUE_KL) > 9.0


def test_estimator_moments_hand_worked():
    # log r = c0 + a z^2 + b z with a = 1/2 - 0.04/2 = 0.48, b = -0.1*0.2 = -0.02:
    # Var[log r] = 2a^2 + b^2 = 0.4612, E[k2] = (Var + KL^2)/2, E[k1] = E[k3] = KL.
    m = gaussian_estimator_moments(0.1, 0.2, 0.0, 1.0)
    kl = gaussian_kl(0.1, 0.2, 0.0, 1.0)
    e = m["estimators"]
    assert e["k1"]["mean"] == pytest.approx(kl, abs=1e-12)
    assert e["k1"]["var"] == pytest.approx(0.4612, abs=1e-12)
    assert e["k2"]["mean"] == pytest.approx(0.5 * (0.4612 + kl * kl), abs=1e-12)
    assert e["k2"]["mean"] < kl  # k2 is biased low here
    assert e["k3"]["mean"] == pytest.approx(kl, abs=1e-15)
    assert e["k3"]["var"] == math.inf
    assert m["E_r2"] == math.inf
    assert m["E_r"] == pytest.approx(1.0, abs=1e-12)


def _log_normal_pdf(x: float, mu: float, sigma: float) -> float:
    return -0.5 * ((x - mu) / sigma) ** 2 - math.log(sigma * math.sqrt(2.0 * math.pi))


@pytest.mark.parametrize(("mu_q", "sigma_q"), [(0.1, 0.8), (0.1, 1.2), (-0.5, 2.0), (0.3, 0.72)])
def test_ratio_moments_and_k3_variance_against_quadrature(mu_q, sigma_q):
    mu_p, sigma_p = 0.0, 1.0
    lq = lambda x: _log_normal_pdf(x, mu_q, sigma_q)  # noqa: E731
    lp = lambda x: _log_normal_pdf(x, mu_p, sigma_p)  # noqa: E731
    quad = lambda f: integrate.quad(f, -math.inf, math.inf, epsabs=0.0, epsrel=1e-11, limit=500)[0]  # noqa: E731
    e_r = quad(lambda x: math.exp(lp(x)))
    e_r2 = quad(lambda x: math.exp(2 * lp(x) - lq(x)))  # ∫ p^2/q
    assert gaussian_ratio_moment(1.0, mu_q, sigma_q, mu_p, sigma_p) == pytest.approx(e_r, rel=1e-9)
    assert gaussian_ratio_moment(2.0, mu_q, sigma_q, mu_p, sigma_p) == pytest.approx(e_r2, rel=1e-8)
    kl = gaussian_kl(mu_q, sigma_q, mu_p, sigma_p)

    def k3_dev_sq(x: float) -> float:  # (k3 - KL)^2 q with k3 = r - 1 - log r, in log space where r is huge
        log_r = lp(x) - lq(x)
        if log_r < 30.0:
            return (math.exp(log_r) - 1.0 - log_r - kl) ** 2 * math.exp(lq(x))
        log_dev = log_r + math.log1p(-(1.0 + log_r + kl) * math.exp(-log_r))  # log(r - 1 - log r - KL)
        return math.exp(2.0 * log_dev + lq(x))

    var = quad(k3_dev_sq)
    moments = gaussian_estimator_moments(mu_q, sigma_q, mu_p, sigma_p)["estimators"]
    assert moments["k3"]["var"] == pytest.approx(var, rel=1e-7)
    assert moments["k1"]["var"] == pytest.approx(quad(lambda x: (lq(x) - lp(x) - kl) ** 2 * math.exp(lq(x))), rel=1e-9)


@pytest.mark.parametrize("sigma_q", [0.2, 0.6, 0.7, 0.7071])
def test_ratio_second_moment_diverges_below_threshold(sigma_q):
    # p^2/q = e^{c x^2 + linear} up to a constant, c = 1/(2 sigma_q^2) - 1 > 0 when 2 sigma_q^2 < sigma_p^2:
    # ∫_{-L}^{L} p^2/q grows without bound. L is chosen so that c L^2 = 30.
    c = 1.0 / (2 * sigma_q**2) - 1.0
    L = math.sqrt(30.0 / c)

    def partial(a: float) -> float:
        f = lambda x: math.exp(2 * _log_normal_pdf(x, 0.0, 1.0) - _log_normal_pdf(x, 0.1, sigma_q))  # noqa: E731
        return integrate.quad(f, -a, a, points=[0.0], limit=500)[0]

    assert partial(L) > 1e6 * partial(L / 2)
    assert gaussian_ratio_moment(2.0, 0.1, sigma_q, 0.0, 1.0) == math.inf
    assert not k3_variance_is_finite(sigma_q, 1.0)


@pytest.mark.parametrize("sigma_p", [0.5, 1.0, 3.0])
def test_k3_variance_is_finite_on_both_sides_of_threshold(sigma_p):
    thr = sigma_p / math.sqrt(2.0)  # 2 sigma_q^2 = sigma_p^2
    for mu_q in (0.0, 0.1, -0.7):
        assert k3_variance_is_finite(thr * (1 + 1e-6), sigma_p)
        assert not k3_variance_is_finite(thr * (1 - 1e-6), sigma_p)
        for f in (0.1, 0.5, 0.99, 1.01, 2.0, 10.0):
            finite = math.isfinite(gaussian_ratio_moment(2.0, mu_q, thr * f, 0.0, sigma_p))
            assert k3_variance_is_finite(thr * f, sigma_p) == finite == (f > 1)
    assert not k3_variance_is_finite(0.2, 1.0)  # the paper's example: 0.04 < 0.5
    with pytest.raises(ValueError, match="sigmas must be > 0"):
        k3_variance_is_finite(0.0, 1.0)


@pytest.mark.parametrize(("mu_q", "sigma_q", "mu_p", "sigma_p"), [(0.1, 0.2, 0.0, 1.0), (-0.5, 2.0, 0.3, 0.7)])
def test_log_ratio_is_the_stated_quadratic_in_z(mu_q, sigma_q, mu_p, sigma_p):
    c0, a, b = log_ratio_quadratic(mu_q, sigma_q, mu_p, sigma_p)
    for z in (-3.0, -0.4, 0.0, 1.3, 2.5):
        x = mu_q + sigma_q * z
        log_r = _log_normal_pdf(x, mu_p, sigma_p) - _log_normal_pdf(x, mu_q, sigma_q)
        assert c0 + a * z * z + b * z == pytest.approx(log_r, abs=1e-13)
    # E[log r] = c0 + a = -KL(q‖p)
    assert c0 + a == pytest.approx(-gaussian_kl(mu_q, sigma_q, mu_p, sigma_p), abs=1e-15)


def test_ratio_moment_is_one_at_t_one_and_infinite_past_the_pole():
    # t = 1: ∫ p = 1 for any pair; t = 2 with 2σq² ≤ σp²: 1 - 2ta ≤ 0, no Gaussian integral
    for args in ((0.1, 0.2, 0.0, 1.0), (2.0, 3.0, -1.0, 0.5)):
        assert gaussian_ratio_moment(1.0, *args) == pytest.approx(1.0, abs=1e-12)
    assert gaussian_ratio_moment(2.0, 0.0, 1.0 / math.sqrt(2.0), 0.0, 1.0) == math.inf
    assert gaussian_ratio_moment(2.0, 50.0, 0.71, 0.0, 1.0) == math.inf  # finite, but beyond float range
