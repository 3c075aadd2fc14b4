r"""klgrad's own loss on a tabular policy, and natural-gradient descent on its exact expected gradient.

A tabular autoregressive policy (:mod:`klgrad.audit.tabular`) has one logit vector per state (prefix). The loss
of every enumerated response is built from klgrad's functions for one (head, level, form):

- combined (in-reward heads): Σ_t :func:`klgrad.objective.policy_gradient_loss` with
  A = :func:`klgrad.objective.combined_advantages` = R - β·C;
- decoupled: Σ_t policy_gradient_loss with A = R, plus β·:func:`klgrad.kl.kl_loss_per_sequence`.

Which form a (head, level) runs in is asked of :class:`klgrad.config.KLConfig` (docs/math.md, "How a head
joins the reward: form"). The optimiser divides the exact gradient g of state s's logits by the Fisher diagonal
P(reach s)·π(v|s) (the softmax Fisher's pseudo-inverse applied to g, up to a per-state shift). The preconditioner
is positive, so its fixed points are exactly the zeros of g; it only makes states the policy rarely reaches
converge as fast as the others. Shapes: S states, V tokens, N responses, T steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from klgrad.audit.tabular import TabularSpace, expected_gradient, state_log_reach
from klgrad.config import KLConfig
from klgrad.kl import KL_HEADS, kl_loss_per_sequence, masked_sum
from klgrad.objective import combined_advantages, policy_gradient_loss

PerSequenceLoss = Callable[[Tensor, Tensor], Tensor]
"""(logp (N, T), sample_logp (N, T)) -> (N,): the loss of every response, to minimise."""
NO_CLIP = dict(clip_eps_low=0.999999, clip_eps_high=1e12)  # on-policy ρ ≡ 1: the clip never acts anyway


def method_form(head: str, level: str, beta: float) -> str:
    """The form klgrad runs the head in: combined for in-reward heads where the KL record
    (:class:`klgrad.config.KLConfig`) allows it, else decoupled. Raises ValueError where klgrad refuses both."""
    style = KL_HEADS[head].style
    if style == "in_reward":
        try:
            KLConfig(head=head, beta=beta, level=level, form="combined")
            return "combined"
        except ValueError:
            pass
    KLConfig(head=head, beta=beta, level=level, form="decoupled")
    return "decoupled"


def per_sequence_loss(
    head: str, level: str, form: str, beta: float, reward: Tensor, ref_logp: Tensor, mask: Tensor
) -> PerSequenceLoss:
    """klgrad's on-policy loss of every response, (logp (N, T), sample_logp (N, T)) -> (N,), to minimise.

    combined: Σ_t policy_gradient_loss(A) with A = combined_advantages(R, head, ..., β, level) = R - β·C;
    decoupled: Σ_t policy_gradient_loss(A = R) + β·kl_loss_per_sequence(head, ..., level).
    reward (N,), ref_logp (N, T), mask (N, T).
    """
    kl_head = KL_HEADS[head]  # the registry object (get_kl_head would warn once for k1_as_loss)

    def combined(logp: Tensor, sample_logp: Tensor) -> Tensor:
        adv = combined_advantages(
            reward, kl_head, logp.detach(), ref_logp, mask, beta=beta, level=level, group_size=1, method="none"
        )  # (N, T)
        return masked_sum(policy_gradient_loss(logp, adv, mask, **NO_CLIP), mask)  # (N,)

    def decoupled(logp: Tensor, sample_logp: Tensor) -> Tensor:
        adv = torch.where(mask, reward[:, None], 0.0)  # (N, T)
        pg = masked_sum(policy_gradient_loss(logp, adv, mask, **NO_CLIP), mask)  # (N,)
        if kl_head.style == "none":
            return pg
        return pg + beta * kl_loss_per_sequence(kl_head, logp, ref_logp, mask, level=level)  # (N,)

    return combined if form == "combined" else decoupled


def exact_loss_gradient(space: TabularSpace, loss: PerSequenceLoss, theta: Tensor) -> Tensor:
    r"""g = ∇_θ Σ_y π_θ(y)·ℓ(y; θ) with π_θ detached (the on-policy expected gradient), (S, V) -> (S, V)."""
    g, _ = expected_gradient(space, loss, theta, theta)
    return g


def natural_direction(space: TabularSpace, theta: Tensor, grad: Tensor) -> Tensor:
    r"""F⁺g for a tabular softmax policy, (S, V) -> (S, V): d[s, v] = g[s, v] / (P(reach s)·π(v|s)).

    The Fisher of state s's logits is P(reach s)·(diag p - p pᵀ); for a gradient with Σ_v g[s, v] = 0 (every
    softmax gradient), x = g / (P(s)·p) solves F x = g exactly. Entries whose Fisher weight underflowed to 0
    (then g is 0 too) get 0.
    """
    weight = state_log_reach(space, theta).exp()[:, None] * torch.softmax(theta, -1)  # (S, V)
    return torch.where(weight > 0, grad / torch.where(weight > 0, weight, 1.0), torch.zeros_like(grad))


class DescentSettings(Protocol):
    """The optimiser's settings (:class:`klgrad.reproduce.fixed_points.FixedPointConfig` has them)."""

    @property
    def step_size(self) -> float: ...  # natural-gradient step η
    @property
    def max_step(self) -> float: ...  # largest change of one logit in one step
    @property
    def tol(self) -> float: ...  # stop when ‖g‖₂ < tol
    @property
    def max_steps(self) -> int: ...  # step cap


@dataclass
class Trajectory:
    theta: Tensor
    """(S, V) final logits."""
    steps: int
    grad_norm: float
    converged: bool


def descend(space: TabularSpace, loss: PerSequenceLoss, theta0: Tensor, cfg: DescentSettings) -> Trajectory:
    """Natural-gradient descent on klgrad's exact expected loss gradient from ``theta0`` (S, V) until ‖g‖ < tol."""
    theta = theta0.detach().clone()
    steps, gnorm = 0, math.inf
    while True:
        g = exact_loss_gradient(space, loss, theta)
        gnorm = float(g.norm())
        if gnorm < cfg.tol or steps >= cfg.max_steps or not math.isfinite(gnorm):
            break
        step = cfg.step_size * natural_direction(space, theta, g)  # (S, V)
        theta = theta - step.clamp(-cfg.max_step, cfg.max_step)
        steps += 1
    return Trajectory(theta, steps, gnorm, gnorm < cfg.tol)
