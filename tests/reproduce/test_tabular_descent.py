"""klgrad.reproduce.tabular_descent: exact-gradient training on klgrad's own loss ends at the closed forms."""

from __future__ import annotations

import pytest
import torch

from klgrad.audit.tabular import build_space, random_logits, sequence_logps, token_logps
from klgrad.exact.optima import forward_kl_optimum, kl_divergence, reverse_kl_optimum
from klgrad.reproduce.fixed_points import FixedPointConfig, build_problem
from klgrad.reproduce.fixed_points_checks import EXACT_FKL, EXACT_RKL
from klgrad.reproduce.tabular_descent import (
    descend,
    exact_loss_gradient,
    method_form,
    natural_direction,
    per_sequence_loss,
)

EPS = torch.finfo(torch.float64).eps
CFG = FixedPointConfig()


def _problem(regime: str):
    """The `fixed-points` problem: space, reference logits, reference log-probs (N, T), reward (N,)."""
    space, ref, rewards = build_problem(CFG)
    return space, ref, token_logps(space, ref), rewards[regime]


def _train(regime: str, key: str, cfg: FixedPointConfig = CFG):
    space, ref, ref_lp, reward = _problem(regime)
    head, level = key.split("/")
    loss = per_sequence_loss(head, level, method_form(head, level, cfg.beta), cfg.beta, reward, ref_lp, space.mask)
    return space, ref_lp.sum(-1).exp(), reward, descend(space, loss, ref, cfg)


def _fisher_gap(space, theta: torch.Tensor) -> float:
    """Smallest non-gauge eigenvalue of the Fisher F = Jᵀ diag(π) J, J = ∂ log π(y)/∂θ (N, S·V).

    Each state's logits have one exactly flat direction (a common shift), so F has S zero eigenvalues; the
    tabular policy reaches every full-support distribution, so the other S·(V-1) = N - 1 are positive.
    """
    jac = torch.autograd.functional.jacobian(lambda t: sequence_logps(space, t.view_as(theta)), theta.flatten())
    pi = sequence_logps(space, theta).exp()  # (N,)
    fisher = jac.T @ (pi[:, None] * jac)  # (S·V, S·V)
    return float(torch.linalg.eigvalsh(fisher)[space.num_states])


@pytest.mark.parametrize("regime", ["sharpening", "discovery"])
@pytest.mark.parametrize("key", EXACT_RKL)
def test_exact_reverse_kl_heads_end_at_pi_star(regime, key):
    space, ref_prob, reward, traj = _train(regime, key)
    assert traj.converged
    pi = sequence_logps(space, traj.theta).exp()
    star = reverse_kl_optimum(ref_prob, reward, CFG.beta)
    # E[R] - β KL(π‖π_ref) = β log Z - β KL(π‖π*), so klgrad's loss gradient is g = β ∇KL(π‖π*) =
    # β Jᵀ diag(π)(δ - E_π δ), δ = log π - log π*. The vector √π(δ - E_π δ) lies in the range of diag(√π) J, so
    # ‖g‖² ≥ β² λ⁺ Var_π(δ) with λ⁺ the smallest non-gauge Fisher eigenvalue; KL(π‖π*) = ½ Var_π(δ) + O(δ³), so
    # KL ≤ ‖g‖² / (β² λ⁺) with a factor 2 to spare. Plus the rounding of the KL sum itself: each log-prob is a
    # sum of T log-softmax values, (T + 2) roundings of relative size ε, weighted by π(y)(|log π| + |log π*| + 1).
    bound = traj.grad_norm**2 / (CFG.beta**2 * _fisher_gap(space, traj.theta))
    rounding = (CFG.length + 2) * EPS * float((pi * (pi.log().abs() + star.log().abs() + 1)).sum())
    kl = kl_divergence(pi, star)
    assert abs(kl) <= bound + rounding, (kl, bound, rounding)
    assert kl <= 1e-6  # the acceptance level


@pytest.mark.parametrize("regime", ["sharpening", "discovery"])
@pytest.mark.parametrize("key", EXACT_FKL)
def test_sequence_k3_ends_at_the_forward_kl_optimum(regime, key):
    space, ref_prob, reward, traj = _train(regime, key)
    assert traj.converged
    pi = sequence_logps(space, traj.theta).exp()
    pf, lam = forward_kl_optimum(ref_prob, reward, CFG.beta)
    # k3 at sequence level has expected gradient ∇KL(π_ref‖π), so g = -Jᵀ diag(π) e with
    # e(y) = R(y) + β π_ref(y)/π(y) (any constant may be added: Σ_y π ∇log π = 0). The stationarity condition of
    # π_f is e ≡ λ. As above, ‖g‖² ≥ λ⁺ Var_π(e); rounding of e: β π_ref/π ≤ λ carries (2T + 2) ε relative.
    e = reward + CFG.beta * ref_prob / pi
    var_e = float((pi * (e - (pi * e).sum()) ** 2).sum())
    bound = traj.grad_norm**2 / _fisher_gap(space, traj.theta) + (lam * (2 * CFG.length + 2) * EPS) ** 2
    assert var_e <= bound, (var_e, bound)
    # KL(π‖π_f) ≈ ½ E_π[((e - λ)/(λ - R))²] is second order in that residual; the acceptance level:
    assert kl_divergence(pi, pf) <= 1e-6


@pytest.mark.parametrize("regime", ["sharpening", "discovery"])
def test_k1_as_loss_follows_none_step_by_step(regime):
    steps = 12  # mid-trajectory, before either converges (both need > 20 steps here)
    cfg = FixedPointConfig(tol=0.0, max_steps=steps)
    space, _, _, none = _train(regime, "none/sequence", cfg)
    p_none = sequence_logps(space, none.theta).exp()
    for key in ("k1_as_loss/sequence", "k1_as_loss/token"):
        _, _, _, k1 = _train(regime, key, cfg)
        assert k1.steps == none.steps == steps
        # k1_as_loss adds β E[Σ_t ∇l_t] = 0 exactly; computed, it is a sum of ≤ N·T terms of size ≤ 1 per logit,
        # so each step perturbs the probabilities by ≤ η β N T ε (the natural step's 1/(P(s)π(v|s)) is undone by
        # the probability's own factor P(s)π(v|s)); summed over the steps, assuming no amplification.
        tol = steps * CFG.step_size * CFG.beta * space.num_sequences * CFG.length * EPS
        p_k1 = sequence_logps(space, k1.theta).exp()
        assert float((p_k1 - p_none).abs().max()) <= tol


def test_method_form_asks_objective_spec():
    assert method_form("k1_in_reward", "sequence", 0.5) == "combined"
    assert method_form("k1_in_reward", "token", 0.5) == "decoupled"  # combined refuses token: not a return
    assert method_form("k2_as_loss", "sequence", 0.5) == "decoupled"
    assert method_form("none", "sequence", 0.5) == "decoupled"


def test_natural_direction_solves_the_fisher_system():
    # F = Jᵀ diag(π) J over whole responses (J = ∂ log π(y)/∂θ, built independently of natural_direction):
    # F·d = g for the direction d = natural_direction(g) of an exact softmax gradient g
    space = build_space(3, 3, eos=True)
    theta = random_logits(space, torch.Generator().manual_seed(1))
    ref = random_logits(space, torch.Generator().manual_seed(2))
    reward = (torch.arange(space.num_sequences) % 2).to(torch.float64)  # (N,)
    loss = per_sequence_loss("k2_as_loss", "sequence", "decoupled", 0.5, reward, token_logps(space, ref), space.mask)
    g = exact_loss_gradient(space, loss, theta)  # (S, V)
    d = natural_direction(space, theta, g)  # (S, V)
    jac = torch.autograd.functional.jacobian(lambda t: sequence_logps(space, t.view_as(theta)), theta.flatten())
    pi = sequence_logps(space, theta).exp()  # (N,)
    fisher = jac.T @ (pi[:, None] * jac)  # (S·V, S·V)
    # entries of F·d are sums of S·V products of O(1) numbers: a few hundred ε
    torch.testing.assert_close(fisher @ d.flatten(), g.flatten(), rtol=0, atol=256 * EPS * float(g.abs().max()))
