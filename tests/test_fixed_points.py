"""`klgrad reproduce fixed-points`: exact-gradient training ends at the closed-form optima the theory predicts."""

from __future__ import annotations

import json
import time

import pytest
import torch

from klgrad.audit.tabular import build_space, sequence_logps, token_logps
from klgrad.cli import main
from klgrad.experiments.fixed_points import (
    EXACT_FKL,
    EXACT_RKL,
    FixedPointConfig,
    descend,
    forward_kl_optimum,
    kl_divergence,
    method_form,
    per_sequence_loss,
    reverse_kl_optimum,
    rewarded_set,
)

EPS = torch.finfo(torch.float64).eps
CFG = FixedPointConfig()


@pytest.fixture(scope="module")
def cli_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fixed-points")
    t0 = time.perf_counter()
    assert main(["reproduce", "fixed-points", "--out", str(out)]) == 0
    print(f"\nklgrad reproduce fixed-points: {time.perf_counter() - t0:.1f} s")  # the issue asks for < 60 s
    for name in ("fixed_points.json", "fixed_points.png", "verdict.md"):
        assert (out / name).is_file()
    assert (out / "fixed_points.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "verdict.md").read_text().startswith("# ")
    return json.loads((out / "fixed_points.json").read_text())


def _problem(regime: str):
    """The CLI's problem, rebuilt: space, reference logits, reference log-probs (N, T), reward (N,)."""
    space = build_space(CFG.vocab, CFG.length, eos=True)
    g = torch.Generator().manual_seed(CFG.seed)
    ref = CFG.ref_scale * torch.randn(space.num_states, space.vocab, generator=g, dtype=torch.float64)
    ref_lp = token_logps(space, ref)
    ref_prob = ref_lp.sum(-1).exp()
    mass, likely = (CFG.sharpening_mass, True) if regime == "sharpening" else (CFG.discovery_mass, False)
    return space, ref, ref_lp, rewarded_set(ref_prob, mass, likely)


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


def test_closed_forms_satisfy_their_stationarity_conditions():
    _, _, ref_lp, reward = _problem("discovery")
    ref_prob = ref_lp.sum(-1).exp()
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


def test_cli_json_shape_and_the_theory_checks(cli_result):
    regimes = cli_result["regimes"]
    assert set(regimes) == {"sharpening", "discovery"}
    for reg in regimes.values():
        n = len(reg["responses"])
        assert len(reg["reference_prob"]) == len(reg["reward"]) == n
        assert reg["beta"] == CFG.beta
        assert set(reg["reward"]) == {0.0, 1.0}
        for key, m in reg["methods"].items():
            assert {"final_prob", "kl_to_optimum", "kl_to_reference", "steps"} <= set(m), key
            assert len(m["final_prob"]) == n
            # each π(y) carries (T + 2) roundings of relative size ε, the sum N more: (T + 2 + N) ε ≈ 8e-15
            assert abs(sum(m["final_prob"]) - 1.0) <= (CFG.length + 2 + n) * EPS
        # k1_as_loss (zero expected gradient) ends where none ends, after the same number of steps
        for key in ("k1_as_loss/sequence", "k1_as_loss/token"):
            assert reg["methods"][key]["steps"] == reg["methods"]["none/sequence"]["steps"]
            pairs = zip(reg["methods"][key]["final_prob"], reg["methods"]["none/sequence"]["final_prob"], strict=True)
            # the step-by-step bound of test_k1_as_loss_follows_none_step_by_step, η β N T ε per step, over
            # ≤ 30 steps: 30 · 0.5 · 31 · 4 · 2.2e-16 ≈ 4e-13
            assert max(abs(a - b) for a, b in pairs) <= 30 * CFG.step_size * CFG.beta * n * CFG.length * EPS
        # the head × level grid: none once, every other head at all three levels (token: decoupled form)
        assert len(reg["methods"]) == 1 + 6 * 3
        assert reg["methods"]["k1_in_reward/token"]["form"] == "decoupled"
        assert reg["methods"]["k1_in_reward/sequence"]["form"] == "combined"
    assert all(c["ok"] for c in cli_result["checks"]), [c for c in cli_result["checks"] if not c["ok"]]
    sharp, disc = regimes["sharpening"], regimes["discovery"]
    assert 0.6 <= sharp["rewarded_reference_mass"] <= 0.8
    assert 0.01 <= disc["rewarded_reference_mass"] <= 0.05
    # the regime map: forward KL (k3) ends closer to the reference when RL sharpens, reverse KL (k2) in discovery
    assert sharp["forward_kl_optimum"]["kl_to_reference"] < sharp["reverse_kl_optimum"]["kl_to_reference"]
    assert disc["forward_kl_optimum"]["kl_to_reference"] > disc["reverse_kl_optimum"]["kl_to_reference"]
    assert sharp["closer_to_reference"]["sequence"]["closer"] == "k3_as_loss"
    assert disc["closer_to_reference"]["sequence"]["closer"] == "k2_as_loss"
