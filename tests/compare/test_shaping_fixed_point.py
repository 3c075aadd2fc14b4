"""Which reward shaping keeps the fixed point that ``klgrad regime`` predicts?

``klgrad regime`` predicts the fixed points of J_β = E_π[R] − β·KL(π‖π_ref) with the raw reward: the reverse-KL
heads (k2_as_loss, k1_in_reward) stop at π* ∝ π_ref·e^{R/β}. A trainer reaches that point only if its expected
update is ∇J_β. Exactly, on one prompt with a tabular policy π = softmax(θ) over n responses, group size G:

    d(θ) = E_{y_1..y_G ~ π}[ (1/G) Σ_i A_i(R(y_1..y_G)) ∇_θ log π(y_i) ] − β·∇_θ KL(π‖π_ref),
    ∇_θ log π(y) = e_y − π,   ∇_θ KL(π‖π_ref) = Σ_y π(y)·log(π(y)/π_ref(y))·(e_y − π),

the expectation enumerated over all n^G groups, A the shaping (:func:`klgrad.advantages.shape_rewards`) and the
second term k2_as_loss's exact on-policy expected gradient (sequence level). RLOO's A_i = R_i − mean_{j≠i} R_j
has E[A_i ∇log π(y_i)] = E[R ∇log π] (the other samples are independent of y_i and E[∇log π] = 0), so d = ∇J_β
and π* is its fixed point; GRPO's division by the group's standard deviation reweights groups by 1/std, a
different objective, whose fixed point is not π*. The sharpening grid on SmolLM2 therefore trains with RLOO
(docs/reproduction.md, "Converged on a real model").
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from klgrad.advantages import shape_rewards

DT = torch.float64
BETA = 0.5
G = 4
REWARD = torch.tensor([1.0, 0.0, 0.0], dtype=DT)  # one right answer among three, as on the arithmetic tasks
REF = torch.softmax(torch.tensor([-0.3, 0.4, 0.1], dtype=DT), 0)  # the reference gets it right 24% of the time


def optimum() -> torch.Tensor:
    """π* ∝ π_ref·e^{R/β}."""
    w = REF * torch.exp(REWARD / BETA)
    return w / w.sum()


GROUPS = torch.tensor(list(itertools.product(range(REWARD.numel()), repeat=G)))  # (n^G, G): every group


def expected_update(theta: torch.Tensor, shaping: str) -> torch.Tensor:
    """d(θ) of the module docstring, (n,), by enumerating every group of G responses."""
    pi = torch.softmax(theta, 0)
    eye = torch.eye(pi.numel(), dtype=DT)
    prob = pi[GROUPS].prod(1)  # (n^G,)
    adv = shape_rewards(REWARD[GROUPS].reshape(-1), G, shaping).reshape(GROUPS.shape)  # (n^G, G), groups contiguous
    score = eye[GROUPS] - pi  # (n^G, G, n): ∇_θ log π(y_i)
    pg = (prob[:, None] * (adv[:, :, None] * score).sum(1) / G).sum(0)  # (n,)
    kl_grad = (pi * torch.log(pi / REF))[:, None] * (eye - pi)  # (n, n): row y is π(y)·log-ratio·(e_y − π)
    return pg - BETA * kl_grad.sum(0)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p * torch.log(p / q)).sum())


def fixed_point(shaping: str, steps: int = 4000, lr: float = 0.5) -> torch.Tensor:
    """Follow the exact expected update from the reference to where it stops."""
    theta = torch.log(REF).clone()
    for _ in range(steps):
        theta = theta + lr * expected_update(theta, shaping)
    return torch.softmax(theta, 0)


def test_rloo_update_vanishes_at_the_optimum_and_grpo_does_not():
    """At π* the expected update is ∇J_β = 0 under RLOO (up to the float64 rounding of summing 81 groups of
    terms of size ≤ 2: 81·2·2⁻⁵² ≈ 4e-14, bound 1e-12) and is far from 0 under GRPO."""
    theta = torch.log(optimum())
    assert expected_update(theta, "rloo").abs().max() < 1e-12
    assert expected_update(theta, "grpo").abs().max() > 1e-2


@pytest.mark.slow
def test_rloo_reaches_the_predicted_optimum_and_grpo_stops_elsewhere():
    """Following the exact expected update: RLOO ends at π* (KL(π‖π*) below 1e-10, the iteration's own
    convergence, contraction factor < 0.99 per step over 4000 steps), hence at the KL to the reference that
    ``klgrad regime`` predicts; GRPO ends measurably elsewhere, at another KL to the reference."""
    star = optimum()
    rloo, grpo = fixed_point("rloo"), fixed_point("grpo")
    assert kl(rloo, star) < 1e-10
    assert math.isclose(kl(rloo, REF), kl(star, REF), rel_tol=1e-6)
    assert kl(grpo, star) > 1e-3
    assert expected_update(torch.log(grpo), "grpo").abs().max() < 1e-8  # it is GRPO's own fixed point
