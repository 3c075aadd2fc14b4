r"""Closed-form optima of KL-regularised reward maximisation over a finite set of responses.

Every function is pure and works on (N,) float64 tensors indexed by the N enumerated responses y: the reference
probabilities π_ref(y), a reward R(y), a KL weight β > 0. Derivations: docs/math.md, "Where training ends:
forward vs reverse KL".

- reverse KL: maximise E_π[R] - β·KL(π‖π_ref): π*(y) = π_ref(y)·exp(R(y)/β) / Z;
- forward KL: maximise E_π[R] - β·KL(π_ref‖π): π_f(y) = β·π_ref(y) / (λ - R(y)), λ > max R fixed by Σ π_f = 1;
- MSE: maximise E_π[R] - (β/2)·Σ_y (π(y) - π_ref(y))²: π_m(y) = max(0, π_ref(y) + (R(y) - λ)/β).
"""

from __future__ import annotations

import torch
from torch import Tensor


def kl_divergence(p: Tensor, q: Tensor) -> float:
    r"""KL(p‖q) = Σ_y p(y) log(p(y)/q(y)) with 0·log 0 = 0; p, q: (N,) probabilities."""
    safe_p = torch.where(p > 0, p, torch.ones_like(p))
    return float(torch.where(p > 0, p * (safe_p.log() - q.log()), torch.zeros_like(p)).sum())


def reverse_kl_optimum(ref_prob: Tensor, reward: Tensor, beta: float) -> Tensor:
    r"""π*(y) = π_ref(y)·exp(R(y)/β) / Σ_y' π_ref(y')·exp(R(y')/β), the maximiser of E_π[R] - β·KL(π‖π_ref).

    Shapes: ref_prob (N,), reward (N,) -> (N,).
    """
    logits = ref_prob.log() + reward / beta  # (N,)
    return torch.softmax(logits, dim=0)


def forward_kl_optimum(ref_prob: Tensor, reward: Tensor, beta: float, iters: int = 200) -> tuple[Tensor, float]:
    r"""π_f(y) = β·π_ref(y) / (λ - R(y)), the maximiser of E_π[R] - β·KL(π_ref‖π); returns (π_f (N,), λ).

    λ > max R is the Lagrange multiplier of Σ π = 1. f(λ) = Σ_y β·π_ref(y)/(λ - R(y)) decreases from +∞ at
    λ → max R⁺ to ≤ 1 at λ = max R + β (each term ≤ π_ref there), so the root is bracketed in (max R, max R + β]
    and found by bisection (``iters`` halvings of a width-β bracket: far below float64 resolution).
    """
    r_max = float(reward.max())
    lo, hi = r_max, r_max + beta
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        total = float((beta * ref_prob / (mid - reward)).sum())
        lo, hi = (mid, hi) if total > 1.0 else (lo, mid)
    lam = hi
    pf = beta * ref_prob / (lam - reward)  # (N,)
    return pf / pf.sum(), lam  # the division absorbs the last bisection step's ≤ 1 ulp residue


def mse_optimum(ref_prob: Tensor, reward: Tensor, beta: float, iters: int = 200) -> tuple[Tensor, float]:
    r"""π_m(y) = max(0, π_ref(y) + (R(y) - λ)/β), the maximiser of E_π[R] - (β/2)·Σ_y (π(y) - π_ref(y))²; (N,).

    KKT on the simplex: R(y) - β(π(y) - π_ref(y)) = λ where π(y) > 0, ≤ λ where π(y) = 0. Σ_y π_m is decreasing in
    λ, ≥ 1 at λ = min R and 0 at λ = max R + β, so bisection on [min R, max R + β] finds λ. Unlike the two KLs,
    this penalty is bounded, so the optimum can put zero mass on responses: it lies on the boundary.
    """
    lo, hi = float(reward.min()), float(reward.max()) + beta
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        total = float((ref_prob + (reward - mid) / beta).clamp(min=0).sum())
        lo, hi = (mid, hi) if total > 1.0 else (lo, mid)
    pm = (ref_prob + (reward - hi) / beta).clamp(min=0)  # (N,)
    return pm / pm.sum(), hi


def rewarded_set(ref_prob: Tensor, target_mass: float, most_likely: bool) -> Tensor:
    """R(y) ∈ {0, 1}, (N,) -> (N,): the reference's most (or least) likely responses, added in order of π_ref
    until their mass reaches ``target_mass``."""
    order = torch.argsort(ref_prob, descending=most_likely, stable=True)  # (N,)
    reward = torch.zeros_like(ref_prob)
    mass = 0.0
    for i in order.tolist():
        if mass >= target_mass:
            break
        reward[i] = 1.0
        mass += float(ref_prob[i])
    return reward
