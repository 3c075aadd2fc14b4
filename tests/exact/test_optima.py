"""klgrad.exact.optima: the closed-form optima satisfy their optimality conditions."""

from __future__ import annotations

import math

import pytest
import torch

from klgrad.audit.tabular import token_logps
from klgrad.exact.optima import (
    forward_kl_optimum,
    kl_divergence,
    mse_optimum,
    reverse_kl_optimum,
    rewarded_set,
)
from klgrad.reproduce.fixed_points import FixedPointConfig, build_problem

EPS = torch.finfo(torch.float64).eps


def _problem(regime: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The `fixed-points` problem's reference probabilities (N,) and the regime's reward (N,)."""
    space, ref_logits, rewards = build_problem(FixedPointConfig())
    return token_logps(space, ref_logits).sum(-1).exp(), rewards[regime]


def test_closed_forms_satisfy_their_stationarity_conditions():
    ref_prob, reward = _problem("discovery")
    beta = 0.5
    star = reverse_kl_optimum(ref_prob, reward, beta)
    # log π* - log π_ref - R/β = -log Z for every y; values are O(10), each log carries a few ulps
    gap = star.log() - ref_prob.log() - reward / beta
    assert float(gap.max() - gap.min()) <= 64 * EPS * 10
    pf, lam = forward_kl_optimum(ref_prob, reward, beta)
    assert lam > float(reward.max())
    # stationarity of E[R] + β Σ π_ref log π on the simplex: R + β π_ref/π_f = λ for every y; the terms are
    # ≤ λ ≈ 1 and carry the bisection's last ulp plus a few roundings: 64 ε
    assert torch.allclose(reward + beta * ref_prob / pf, torch.full_like(pf, lam), rtol=0, atol=64 * EPS)
    assert abs(float(pf.sum()) - 1.0) <= pf.numel() * EPS  # N additions of numbers ≤ 1


@pytest.mark.parametrize("regime", ["sharpening", "discovery"])
def test_mse_optimum_satisfies_kkt(regime):
    ref_prob, reward = _problem(regime)
    beta = 0.5
    pm, lam = mse_optimum(ref_prob, reward, beta)
    assert abs(float(pm.sum()) - 1.0) <= pm.numel() * EPS
    # KKT: R - β(π - π_ref) = λ on the support, R + β π_ref ≤ λ off it. λ comes from a bisection to 1 ulp and
    # each side carries a few roundings of O(1) numbers: 64 ε
    inside = pm > 0
    score = reward - beta * (pm - ref_prob)
    assert torch.allclose(score[inside], torch.full_like(score[inside], lam), rtol=0, atol=64 * EPS)
    assert bool((reward[~inside] + beta * ref_prob[~inside] <= lam + 64 * EPS).all())
    assert int(inside.sum()) < pm.numel()  # a bounded penalty: the optimum drops responses (a boundary point)


def test_a_constant_reward_leaves_the_reference_unchanged():
    ref_prob = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    reward = torch.full_like(ref_prob, 0.7)
    torch.testing.assert_close(reverse_kl_optimum(ref_prob, reward, 0.5), ref_prob, rtol=0, atol=4 * EPS)
    pf, lam = forward_kl_optimum(ref_prob, reward, 0.5)
    torch.testing.assert_close(pf, ref_prob, rtol=0, atol=4 * EPS)
    assert lam == pytest.approx(0.7 + 0.5, abs=4 * EPS)  # λ = E_{π_f}[R] + β
    pm, _ = mse_optimum(ref_prob, reward, 0.5)
    torch.testing.assert_close(pm, ref_prob, rtol=0, atol=4 * EPS)


def test_kl_divergence_by_hand():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(2.0), abs=EPS)  # 0·log 0 = 0
    assert kl_divergence(q, q) == 0.0
    assert kl_divergence(q, p) == math.inf  # q has mass where p has none


def test_rewarded_set_by_hand():
    ref_prob = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    # most likely first until the mass reaches 0.6: 0.4, then 0.3 (0.7 ≥ 0.6)
    assert rewarded_set(ref_prob, 0.6, most_likely=True).tolist() == [0.0, 1.0, 0.0, 1.0]
    # least likely first until 0.15: 0.1, then 0.2 (0.3 ≥ 0.15)
    assert rewarded_set(ref_prob, 0.15, most_likely=False).tolist() == [1.0, 0.0, 1.0, 0.0]
