r"""Audit rows of the two exact KL gradients: the analytic KL head and the per-decision importance ratio.

Both by enumeration over the audit's tabular problem (:mod:`klgrad.audit.run`), in float64, through the loss code
the trainer runs: :func:`klgrad.kl.analytic.next_token_kl` on each position's logits and
:func:`klgrad.kl.analytic.analytic_kl_per_sequence` for the analytic head, :func:`klgrad.kl.kl_loss_per_sequence`
with ``ratio_level="per_decision"`` for the ratio. The expected gradient E_{y~q}[∇ℓ(y)] is
∇_θ Σ_y q(y) ℓ(y) with q detached (the sampling distribution), compared with the exact ∇KL(π‖π_ref) (or the
local target at ``token``). Behaviour policies: ``stale`` (θ_{t−k}, k exact steps back, :func:`stale_trajectory`),
``perturbed`` (the audit's behaviour, θ + d_beh·N(0, 1)) and ``engine`` (θ + 1e-3·N(0, 1): a sampler whose
arithmetic differs slightly from the trainer's).

Per-decision rows also carry tr Cov of the per-sample gradient (``variance``), so the mean squared error of a
batch mean of n samples is ‖bias‖² + variance/n exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.audit.tabular import exact_gradient, expected_gradient, token_logps
from klgrad.choices import LEVELS
from klgrad.kl import get_kl_head, kl_loss_per_sequence
from klgrad.kl.analytic import ANALYTIC_KL, analytic_kl_per_sequence, next_token_kl

ENGINE_DISTANCE = 1e-3
"""Std of the logit perturbation of the ``engine`` behaviour (a sampler in other arithmetic)."""
PER_DECISION_CAP = 2.0
"""C of the capped per-decision rows: min(ρ_{1:t}, C)."""


def analytic_expected_gradient(space, theta: Tensor, ref: Tensor, sampler: Tensor | None, level: str) -> Tensor:
    """E_{y~q}[∇ℓ(y)] of the analytic head's loss, (S, V); q = π_θ on-policy (``sampler`` None), else softmax of
    ``sampler`` with its log-probs as ``old_logp``."""
    th = theta.detach().clone().requires_grad_(True)
    logp = token_logps(space, th)  # (N, T)
    kl = next_token_kl(th[space.state_index], ref[space.state_index])  # (N, T) each position's KL_t
    old = None if sampler is None else token_logps(space, sampler.detach())  # (N, T)
    q = (logp.detach() if old is None else old).sum(-1).exp()  # (N,)
    loss = analytic_kl_per_sequence(kl, logp, space.mask, old_logp=old, level=level)  # (N,)
    (g,) = torch.autograd.grad((q * loss).sum(), th)
    return g


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def behaviours(problem, stale: Tensor) -> dict[str, Tensor]:
    """The off-policy behaviour policies of the rows: stale, perturbed, engine."""
    g = torch.Generator().manual_seed(12345)
    noise = torch.randn(problem.theta.shape, generator=g, dtype=torch.float64)
    return {"stale": stale, "perturbed": problem.behaviour, "engine": problem.theta + ENGINE_DISTANCE * noise}


def analytic_rows(problem, behaviour: dict[str, Tensor]) -> list[dict]:
    """analytic_kl at every level, on-policy and from each behaviour: rel. error vs its target (rkl, local_rkl)."""
    sp, theta, ref = problem.space, problem.theta, problem.ref
    rows = []
    for level in LEVELS:
        target = ANALYTIC_KL.targets[level]
        g_target = exact_gradient(sp, target, theta, ref)
        for regime, sampler in {"on_policy": None, **behaviour}.items():
            g = analytic_expected_gradient(sp, theta, ref, sampler, level)
            rows.append(
                dict(head="analytic_kl", level=level, regime=regime, target=target, err_target=_rel(g, g_target))
            )
    return rows


def per_decision_rows(problem, behaviour: dict[str, Tensor], heads=("k1_in_reward", "k2_as_loss")) -> list[dict]:
    """KL heads at token_to_go from each behaviour with the token, sequence, per-decision and capped per-decision
    ratios: rel. error vs ∇KL(π‖π_ref) and the per-sample gradient variance."""
    sp, theta = problem.space, problem.theta
    ref_lp = token_logps(sp, problem.ref)
    g_rkl = exact_gradient(sp, "rkl", theta, problem.ref)
    rows = []
    ratios = {"token": {}, "sequence": {}, "per_decision": {}, "per_decision_capped": {"ratio_cap": PER_DECISION_CAP}}
    for name in heads:
        head = get_kl_head(name)
        for regime, sampler in behaviour.items():
            for ratio, extra in ratios.items():
                level = ratio.removesuffix("_capped")

                def loss(logp, old, head=head, level=level, extra=extra):
                    return kl_loss_per_sequence(
                        head, logp, ref_lp, sp.mask, old_logp=old, level="token_to_go", ratio_level=level, **extra
                    )

                g, var = expected_gradient(sp, loss, theta, sampler, with_variance=True)
                rows.append(
                    dict(
                        head=name,
                        level="token_to_go",
                        regime=regime,
                        ratio=ratio,
                        err_rkl=_rel(g, g_rkl),
                        bias_sq=float((g - g_rkl).pow(2).sum()),
                        variance=var,
                    )
                )
    return rows


def exact_heads_audit(problem, stale: Tensor) -> dict:
    """The two row sets, as JSON-ready lists (``result["exact_heads"]`` of :func:`klgrad.audit.run.run_audit`)."""
    beh = behaviours(problem, stale)
    return dict(analytic=analytic_rows(problem, beh), per_decision=per_decision_rows(problem, beh))
