r"""Closed forms for the k1/k2/k3 value estimators when the sampler and the reference are Gaussians.

Setting (paper, appendix I). Samples x ~ q (the sampling distribution, the policy π); p is the reference
π_ref; r(x) = p(x)/q(x). In klgrad's notation (:func:`klgrad.kl.kl_estimate`) u = log q(x) - log p(x) = -log r,
and the value estimators of KL(q‖p) are

    k1 = -log r = u,   k2 = ½ (log r)² = ½u²,   k3 = (r - 1) - log r = e^{-u} - 1 + u.

Gaussians q = N(μq, σq²), p = N(μp, σp²), d = μq - μp:

- KL(q‖p) = log(σp/σq) + (σq² + d²)/(2σp²) - ½.
- With x = μq + σq z, z ~ N(0, 1): log r = c0 + a z² + b z exactly, where c0 = log(σq/σp) - d²/(2σp²),
  a = ½ - σq²/(2σp²), b = -dσq/σp².
- E_q[r^t] = e^{t c0} (1 - 2ta)^{-½} e^{t²b²/(2(1 - 2ta))} when 1 - 2ta > 0, else ∞.
- Var_q[k3] is finite iff E_q[r²] is, iff 1 - 4a > 0, iff 2σq² > σp² (E_q[(log r)²] is always finite for
  Gaussians): the paper's condition σq² > σp²/2.

Every function takes and returns Python floats (no tensors); the tests check them against quadrature.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np


class Moments(TypedDict):
    """Mean, variance and standard deviation of one estimator under x ~ q (``var``/``std`` may be ∞)."""

    mean: float
    var: float
    std: float


class EstimatorMoments(TypedDict):
    """:func:`gaussian_estimator_moments`'s result."""

    kl_qp: float
    """KL(q‖p), the divergence the estimators target."""
    kl_pq: float
    """KL(p‖q), the reverse direction."""
    E_r: float
    """E_q[r] (= 1: p is absolutely continuous w.r.t. q)."""
    E_r2: float
    """E_q[r²] = 1 + χ²(p‖q), ∞ iff 2σq² ≤ σp²."""
    estimators: dict[str, Moments]
    """Per estimator name ``"k1"``, ``"k2"``, ``"k3"``."""


def gaussian_kl(mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> float:
    r"""KL(N(μq, σq²) ‖ N(μp, σp²)) = log(σp/σq) + (σq² + (μq - μp)²)/(2σp²) - ½, in nats."""
    return math.log(sigma_p / sigma_q) + (sigma_q**2 + (mu_q - mu_p) ** 2) / (2.0 * sigma_p**2) - 0.5


def log_ratio_quadratic(mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> tuple[float, float, float]:
    """(c0, a, b) with log(p/q)(μq + σq z) = c0 + a z² + b z exactly (see the module docstring)."""
    d = mu_q - mu_p
    c0 = math.log(sigma_q / sigma_p) - d * d / (2.0 * sigma_p**2)
    a = 0.5 - sigma_q**2 / (2.0 * sigma_p**2)
    b = -d * sigma_q / sigma_p**2
    return c0, a, b


def gaussian_ratio_moment(t: float, mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> float:
    r"""E_{x~q}[r(x)^t] with r = p/q, t > 0: e^{t c0} (1 - 2ta)^{-½} e^{t² b² / (2(1 - 2ta))}, or ∞.

    E[e^{t(a z² + b z)}] for z ~ N(0, 1) is a Gaussian integral that converges iff 1 - 2ta > 0. t = 1 gives
    ∫p = 1 for every pair of Gaussians; t = 2 gives ∫ p²/q = 1 + χ²(p‖q), finite iff 2σq² > σp².
    """
    c0, a, b = log_ratio_quadratic(mu_q, sigma_q, mu_p, sigma_p)
    s = 1.0 - 2.0 * t * a
    if s <= 0.0:
        return math.inf
    try:
        return math.exp(t * c0 + t * t * b * b / (2.0 * s)) / math.sqrt(s)
    except OverflowError:  # finite, but beyond float range (far-apart means, right above the threshold)
        return math.inf


def k3_variance_is_finite(sigma_q: float, sigma_p: float) -> bool:
    r"""Whether Var_{x~q}[k3] < ∞ for q = N(·, σq²) the sampler and p = N(·, σp²) the reference.

    Var[k3] < ∞ iff E_q[r²] = ∫ p²/q < ∞ (E_q[(log r)²] is a Gaussian moment of a quadratic, always finite).
    p²/q ∝ exp(-x²/σp² + x²/(2σq²) + linear), integrable iff 1/σp² > 1/(2σq²), i.e. 2σq² > σp²: the paper's
    "σq² > σp²/2". The means do not matter; at equality the integrand is exp(linear) and diverges.
    """
    if not (sigma_q > 0 and sigma_p > 0):
        raise ValueError(f"sigmas must be > 0, got sigma_q={sigma_q}, sigma_p={sigma_p}")
    return 2.0 * sigma_q**2 > sigma_p**2


def gaussian_estimator_moments(mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> EstimatorMoments:
    r"""Exact mean and per-sample variance of k1, k2, k3 under x ~ q (Gaussians).

    With Y = log r = c0 + a z² + b z: E[Y] = c0 + a = -KL(q‖p), Var[Y] = 2a² + b². k1 = -Y and k2 = Y²/2 are
    polynomials in z, so their moments are exact by Gauss-Hermite quadrature (40 nodes, exact to degree 79).
    k3 = r - 1 - Y: E[k3] = E[r] - 1 + KL(q‖p) = KL(q‖p) and, using E_q[r Y] = E_p[log(p/q)] = KL(p‖q),
    Var[k3] = (E[r²] - 1) - 2 (KL(p‖q) + KL(q‖p)) + 2a² + b², which is ∞ iff E[r²] = ∞.
    """
    c0, a, b = log_ratio_quadratic(mu_q, sigma_q, mu_p, sigma_p)
    kl_qp = gaussian_kl(mu_q, sigma_q, mu_p, sigma_p)
    kl_pq = gaussian_kl(mu_p, sigma_p, mu_q, sigma_q)
    z, w = np.polynomial.hermite_e.hermegauss(40)  # (40,) nodes, (40,) weights
    w = w / w.sum()  # probabilists' Hermite: weights of N(0, 1)
    y = c0 + a * z * z + b * z  # (40,) log r at the nodes
    moments: dict[str, Moments] = {}
    for name, k in (("k1", -y), ("k2", 0.5 * y * y)):
        m = float(w @ k)
        var = float(w @ (k - m) ** 2)
        moments[name] = {"mean": m, "var": var, "std": math.sqrt(var)}
    m2 = gaussian_ratio_moment(2.0, mu_q, sigma_q, mu_p, sigma_p)
    # E[k3²] = E[(r-1)²] - 2E[(r-1)Y] + E[Y²] with E[r] = 1, E[rY] = E_p[Y] = KL(p‖q), E[Y] = -KL(q‖p)
    e_k3_sq = (m2 - 1.0) - 2.0 * (kl_pq + kl_qp) + (2 * a * a + b * b + kl_qp**2)
    var_k3 = math.inf if math.isinf(m2) else e_k3_sq - kl_qp**2
    moments["k3"] = {"mean": kl_qp, "var": var_k3, "std": math.sqrt(var_k3) if math.isfinite(var_k3) else math.inf}
    return {
        "kl_qp": kl_qp,
        "kl_pq": kl_pq,
        "E_r": gaussian_ratio_moment(1.0, mu_q, sigma_q, mu_p, sigma_p),
        "E_r2": m2,
        "estimators": moments,
    }
