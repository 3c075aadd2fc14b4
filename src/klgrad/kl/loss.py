"""The KL loss: a head at a level, on- or off-policy (β not included), and the adaptive-β controller."""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.choices import LEVELS, RATIO_LEVELS, Level, RatioLevel
from klgrad.kl.heads import KLHead, get_kl_head
from klgrad.kl.levels import level_coefficients, masked_sum
from klgrad.kl.numerics import MAX_LOG_RATIO, at_least_f32, straight_through_cap
from klgrad.kl.offpolicy import clipped_surrogate_penalty, importance_ratio, per_decision_ratio


def _validate(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    old_logp: Tensor | None,
    level: str,
    ratio_level: str,
    clip_eps: float | None,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [B, T], got {tuple(logp.shape)}")
    for name, t in (("ref_logp", ref_logp), ("mask", mask), ("old_logp", old_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(t.shape)}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if clip_eps is not None and not (0.0 < clip_eps < 1.0):
        raise ValueError(f"clip_eps must be in (0, 1) or None, got {clip_eps!r}")


def kl_loss_per_sequence(
    head: KLHead | str,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    level: Level = "sequence",
    clip_eps: float | None = None,
    ratio_level: RatioLevel = "sequence",
    is_correction: bool = True,
    max_log_ratio: float = MAX_LOG_RATIO,
    ratio_cap: float | None = None,
) -> Tensor:
    r"""Per-sequence KL loss (tokens summed, β not included), shapes (B, T) -> (B,). See :func:`kl_loss`."""
    head = get_kl_head(head)
    _validate(logp, ref_logp, mask, old_logp, level, ratio_level, clip_eps)
    if head.style == "analytic":
        raise ValueError(
            f"{head.name} reads the next-token distributions: use klgrad.kl.analytic.analytic_kl_per_sequence"
        )
    if ratio_cap is not None and ratio_level != "per_decision":
        raise ValueError(f"ratio_cap is the capped per-decision ratio's; ratio_level is {ratio_level!r}")
    mask = mask.bool()
    l = torch.where(mask, at_least_f32(logp), 0.0)  # (B, T) garbage in padding never matters
    r = torch.where(mask, at_least_f32(ref_logp.detach()), 0.0)  # (B, T)
    if head.style == "none":
        return (l * 0.0).sum(-1)  # (B,) zero, but keeps the graph

    off_policy = old_logp is not None and is_correction
    if head.style == "as_loss" and not off_policy and level != "token_to_go":
        # Differentiate the penalty directly: exact on-policy; off-policy this is the common bug.
        if level == "sequence":
            return head.penalty(l.sum(-1), r.sum(-1))  # (B,)
        return masked_sum(head.penalty(l, r), mask)  # (B,)

    behaviour = old_logp if off_policy else l.detach()
    if ratio_level == "per_decision" and level != "sequence":
        # Each term c_t (token_to_go: of the return, so c per token) weighted by its own prefix's ratio ρ_{1:t}.
        coef = level_coefficients(head, l, r, mask, "token")  # (B, T) detached c_t
        ratio = per_decision_ratio(l, behaviour, mask, level, max_log_ratio, ratio_cap)  # (B, T)
        return masked_sum(clipped_surrogate_penalty(coef, ratio, clip_eps if off_policy else None), mask)  # (B,)
    if level == "sequence" and ratio_level in ("sequence", "per_decision"):
        # Bandit view: one coefficient, one ratio per sequence: max(ρ c, clip(ρ) c) with ρ = e^{L - O}.
        o = torch.where(mask, at_least_f32(behaviour.detach()), 0.0)  # (B, T)
        seq_coef = head.coefficient(l.sum(-1), r.sum(-1))  # (B,)
        seq_ratio = torch.exp(straight_through_cap((l - o).sum(-1), max_log_ratio))  # (B,)
        return clipped_surrogate_penalty(seq_coef, seq_ratio, clip_eps if off_policy else None)
    coef = level_coefficients(head, l, r, mask, level)  # (B, T) detached, from the *current* l̄
    ratio = importance_ratio(l, behaviour, mask, ratio_level, max_log_ratio)  # (B, T)
    per_token = clipped_surrogate_penalty(coef, ratio, clip_eps if off_policy else None)  # (B, T)
    return masked_sum(per_token, mask)  # (B,)


def kl_loss(
    head: KLHead | str,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    level: Level = "sequence",
    clip_eps: float | None = None,
    ratio_level: RatioLevel = "sequence",
    is_correction: bool = True,
    max_log_ratio: float = MAX_LOG_RATIO,
    ratio_cap: float | None = None,
) -> Tensor:
    r"""KL loss to minimise (β not included): mean over sequences of the per-sequence loss (tokens summed).

    Args:
        head: a :class:`KLHead` or its registry name.
        logp: (B, T) current policy log-probs l of the response tokens; gradient flows through it.
        ref_logp: (B, T) reference log-probs r (detached).
        mask: (B, T) bool or 0/1, True = the token counts. Masked entries never matter, even NaN.
        old_logp: (B, T) behaviour log-probs o; None means on-policy (o = l̄).
        level: ``sequence`` | ``token_to_go`` | ``token`` (docs/math.md, “Where a head acts: level”).
        clip_eps: off-policy only: symmetric PPO clip of the KL head, PPO-consistent side (docs/math.md,
            “Off-policy: importance sampling and the clip side”).
        ratio_level: off-policy importance ratio per ``token``, per ``sequence`` or ``per_decision`` (each term
            of the KL return weighted by its own prefix's ratio ρ_{1:t},
            :func:`~klgrad.kl.offpolicy.per_decision_ratio`;
            at ``sequence`` level the sequence ratio).
        is_correction: False reproduces the common bug: the head is applied as if on-policy (as-loss
            penalties differentiated directly, coefficients without IS), for comparisons only.
        max_log_ratio: cap of the importance log-ratio in value (overflow guard; gradient unchanged).
        ratio_cap: ``per_decision`` only: the truncated weights min(ρ_{1:t}, C) (biased; None: exact).

    Returns:
        Scalar. On-policy: as-loss heads at ``sequence``/``token`` give ψ (value and gradient); in-reward
        heads, and as-loss heads at ``token_to_go``, give the score-function surrogate Σ_t C_t ρ_t with
        ρ = 1 in value, so the gradient is Σ_t C_t ∇l_t. Off-policy (with correction): the head is converted
        to its coefficient c, recomputed from the current l̄, and applied as max(ρ C, clip(ρ) C), whose
        gradient (unclipped, sequence ratio) is the unbiased IS estimate of the on-policy gradient.
    """
    return kl_loss_per_sequence(
        head,
        logp,
        ref_logp,
        mask,
        old_logp=old_logp,
        level=level,
        clip_eps=clip_eps,
        ratio_level=ratio_level,
        is_correction=is_correction,
        max_log_ratio=max_log_ratio,
        ratio_cap=ratio_cap,
    ).mean()


# ----------------------------------------------------------------------------------------------------------
# the KL weight β (outside the loss)


def adaptive_beta(beta: float, kl: float, target: float, rate: float) -> float:
    """Proportional controller (Ziegler et al.): β ← β·(1 + rate·clip(KL/target - 1, -0.2, 0.2)/0.2)."""
    err = max(-0.2, min(0.2, kl / target - 1.0))
    return beta * (1.0 + rate * err / 0.2)
