r"""Closed forms for the k1/k2/k3 value estimators when the reference's support is wider than the sampler's.

Setting (paper, appendix I.1): x ~ q = U[0, w_q] (the sampler), p = U[0, w_p] (the reference), w_q < w_p, so
supp(p) ⊄ supp(q). On supp(q) the ratio is constant, r = p/q = w_q/w_p, hence every estimator is a constant:

    KL(q‖p) = log(w_p/w_q),   k1 = -log r = KL,   k2 = ½ (log r)² = ½ KL²,   k3 = (r - 1) - log r = KL + (r - 1).

k1 is unbiased; k3 is biased by E_q[r] - 1 = w_q/w_p - 1 < 0, because p puts mass where q never samples
(the precondition E_q[r] = 1 of k3's unbiasedness fails). The paper's example: w_q = 1, w_p = 2:
KL = log 2, E[k3] = log 2 - ½, E_q[r] = ½.
"""

from __future__ import annotations

import math
from typing import TypedDict


class UniformEstimatorValues(TypedDict):
    """:func:`uniform_estimator_values`'s result: the constant value of each estimator, and E_q[r]."""

    k1: float
    k2: float
    k3: float
    E_q_r: float


def uniform_kl(width_q: float, width_p: float) -> float:
    """KL(U[0, w_q] ‖ U[0, w_p]) = log(w_p/w_q), for 0 < w_q ≤ w_p (∞ otherwise: q has mass where p has none)."""
    if not 0 < width_q:
        raise ValueError(f"width_q must be > 0, got {width_q}")
    return math.log(width_p / width_q) if width_q <= width_p else math.inf


def uniform_estimator_values(width_q: float, width_p: float) -> UniformEstimatorValues:
    """k1, k2, k3 (each constant on supp(q)) and E_q[r] for q = U[0, w_q] samples, p = U[0, w_p], w_q ≤ w_p."""
    if not 0 < width_q <= width_p:
        raise ValueError(f"need 0 < width_q <= width_p, got width_q={width_q}, width_p={width_p}")
    kl = uniform_kl(width_q, width_p)
    ratio = width_q / width_p  # r = p/q on supp(q)
    return {"k1": kl, "k2": 0.5 * kl * kl, "k3": kl + (ratio - 1.0), "E_q_r": ratio}
