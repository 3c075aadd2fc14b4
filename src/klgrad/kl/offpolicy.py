"""Off-policy pieces (docs/math.md, “Off-policy: importance sampling and the clip side”): importance ratios
and the PPO-consistent clipped surrogate of a penalty coefficient."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klgrad.choices import RATIO_LEVELS, REWARD_RATIO_LEVELS, RatioLevel, RewardRatioLevel
from klgrad.kl.numerics import MAX_LOG_RATIO, at_least_f32, straight_through_cap


def gspo_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, max_log_ratio: float = MAX_LOG_RATIO) -> Tensor:
    r"""GSPO's length-normalised sequence ratio in its token form (GSPO-token), (B, T) -> (B, T).

    s_i = exp((1/|y_i|) Σ_t m_t (l_t - o_t)), the geometric mean of the token ratios of response i with
    |y_i| = Σ_t m_t (Zheng et al. 2025, "Group Sequence Policy Optimization"); per token
    s_{i,t} = sg(s_i) · exp(l_t - l̄_t): value s_i on every token, gradient s_i ∇l_t. With the same advantage on
    every token and a per-sequence token mean (aggregation ``seq_mean_token_mean``) this is GSPO's loss and
    gradient s_i A_i (1/|y_i|) Σ_t ∇l_t exactly. GSPO clips s_i with its own small ranges (3e-4 / 4e-4 in the
    paper). s_i is not an importance weight of the sequence distribution (that is exp(Σ_t m_t (l_t - o_t)),
    :func:`importance_ratio` at ``sequence``), so it is offered for the reward head only. A response with no
    token gets s = 1. The mean log-ratio is capped at ``max_log_ratio`` in value only (straight-through).
    """
    mask = mask.bool()
    l = torch.where(mask, at_least_f32(logp), 0.0)  # (B, T)
    o = torch.where(mask, at_least_f32(old_logp.detach()), 0.0)  # (B, T)
    length = mask.sum(-1, keepdim=True).clamp(min=1).to(l.dtype)  # (B, 1) |y_i|
    mean_log_ratio = straight_through_cap((l - o).sum(-1, keepdim=True) / length, max_log_ratio)  # (B, 1)
    return torch.exp(mean_log_ratio.detach() + (l - l.detach()))  # (B, T)


def per_decision_ratio(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    level: str = "token_to_go",
    max_log_ratio: float = MAX_LOG_RATIO,
    cap: float | None = None,
) -> Tensor:
    r"""Per-decision importance weights ρ_{1:t} = exp(Σ_{t'≤t} m_t' (l_t' − o_t')), (B, T) -> (B, T).

    Each term c_t of a KL return is weighted by the ratio of its own prefix y_{≤t} (Precup et al. 2000), not the
    whole response's: E_π[Σ_t c_t Σ_{t'≤t} ∇l_t'] = E_μ[Σ_t ρ_{1:t} c_t Σ_{t'≤t} ∇l_t'], since term t depends on y_{≤t}
    only. Gradient per level: ``token_to_go`` through every l_{t'≤t} (ρ_{1:t} Σ_{t'≤t} ∇l_t', so Σ_t ρ_{1:t} c_t is the
    reward-to-go estimator rearranged); ``token``: sg(ρ_{1:t−1}) e^{l_t − o_t}, through l_t only (the unbiased IS of
    the local target); ``sequence``: the sequence ratio (the one term's prefix is the whole response). ``cap`` C:
    the truncated form min(ρ, C) in value (the gradient's direction kept, scaled by min(ρ, C)/ρ): biased, bounded.
    The log-ratio is capped at ``max_log_ratio`` in value only.
    """
    mask = mask.bool()
    l = torch.where(mask, at_least_f32(logp), 0.0)  # (B, T)
    o = torch.where(mask, at_least_f32(old_logp.detach()), 0.0)  # (B, T)
    delta = l - o  # (B, T)
    cum = delta.cumsum(-1)  # (B, T) log ρ_{1:t}
    if level == "sequence":
        cum = cum[:, -1:].expand_as(cum)  # (B, T) log ρ_{1:T}
    elif level == "token":
        cum = (cum - delta).detach() + delta  # (B, T) value log ρ_{1:t}, gradient through l_t only
    log_rho = straight_through_cap(cum, max_log_ratio)  # (B, T)
    if cap is None:
        return torch.exp(log_rho)
    value = torch.clamp(log_rho.detach(), max=math.log(cap))  # (B, T) log min(ρ, C)
    return torch.exp(value + (log_rho - log_rho.detach()))  # (B, T)


def importance_ratio(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    ratio_level: RewardRatioLevel | RatioLevel = "token",
    max_log_ratio: float = MAX_LOG_RATIO,
) -> Tensor:
    r"""Per-token importance ratio with gradient through ``logp`` of its own token only, (B, T) -> (B, T).

    token: ρ_t = exp(l_t - o_t). sequence: ρ̃_t = sg(ρ) · exp(l_t - l̄_t) with ρ = exp(Σ_t m_t (l_t - o_t)):
    value ρ (the unnormalised sequence ratio, the exact importance weight of the whole response) and gradient
    ρ ∇l_t, so Σ_t ρ̃_t C_t has gradient ρ Σ_t C_t ∇l_t (unbiased sequence-level IS for any per-token
    coefficient). per_decision: ρ_{1:t} at ``token_to_go`` (:func:`per_decision_ratio`). gspo: GSPO's
    length-normalised ratio, :func:`gspo_ratio` (reward head only; not an IS
    weight). Log-ratios are capped at ``max_log_ratio`` in value only (straight-through), so ρ never overflows
    and its gradient is never zeroed.
    """
    if ratio_level == "gspo":
        return gspo_ratio(logp, old_logp, mask, max_log_ratio)
    mask = mask.bool()
    l = torch.where(mask, at_least_f32(logp), 0.0)  # (B, T)
    o = torch.where(mask, at_least_f32(old_logp.detach()), 0.0)  # (B, T)
    if ratio_level == "token":
        return torch.exp(straight_through_cap(l - o, max_log_ratio))  # (B, T)
    if ratio_level == "per_decision":
        return per_decision_ratio(logp, old_logp, mask, "token_to_go", max_log_ratio)  # (B, T)
    if ratio_level == "sequence":
        seq_log_ratio = straight_through_cap((l - o).sum(-1, keepdim=True), max_log_ratio)  # (B, 1)
        return torch.exp(seq_log_ratio.detach() + (l - l.detach()))  # (B, T)
    raise ValueError(f"ratio_level must be one of {sorted({*REWARD_RATIO_LEVELS, *RATIO_LEVELS})}, got {ratio_level!r}")


def clipped_surrogate_penalty(coef: Tensor, ratio: Tensor, clip_eps: float | None) -> Tensor:
    r"""PPO-consistent clipped surrogate for a penalty coefficient, elementwise (to minimise).

    A penalty c is an advantage of -c, so the loss is max(ρ·c, clip(ρ, 1-ε, 1+ε)·c) (docs/math.md, “Off-policy:
    importance sampling and the clip side”; the paper's min(ρc, clip(ρ)c) clips the wrong side). Its gradient
    stops once ρ has moved ε in the direction the penalty pushes: down for c > 0, up for c < 0.
    ``clip_eps=None``: plain ρ·c (IS, no clipping).
    """
    unclipped = ratio * coef
    if clip_eps is None:
        return unclipped
    return torch.maximum(unclipped, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * coef)
