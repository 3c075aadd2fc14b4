"""Where a head acts (docs/math.md, “Where a head acts: level”): per-token coefficients at a level."""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.choices import LEVELS, Level
from klgrad.kl.heads import KLHead
from klgrad.kl.numerics import at_least_f32


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Σ_t m_t x_t over the last dim, (B, T) -> (B,); masked entries never matter (even NaN)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def reverse_cumsum(x: Tensor) -> Tensor:
    """y_t = Σ_{t'≥t} x_t' along the last dim, (B, T) -> (B, T)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def level_coefficients(head: KLHead, logp: Tensor, ref_logp: Tensor, mask: Tensor, level: Level) -> Tensor:
    r"""Per-token detached KL coefficients C_t at a level, (B, T) -> (B, T); zero at masked positions.

    sequence: C_t = c(Σ l̄, Σ r) for every response token; token_to_go: C_t = Σ_{t'≥t} m_t' c(l̄_t', r_t');
    token: C_t = c(l̄_t, r_t).
    """
    mask = mask.bool()
    l = torch.where(mask, at_least_f32(logp.detach()), 0.0)  # (B, T)
    r = torch.where(mask, at_least_f32(ref_logp.detach()), 0.0)  # (B, T)
    if level == "sequence":
        c_seq = head.coefficient(l.sum(-1), r.sum(-1))  # (B,)
        coef = c_seq[:, None].expand_as(l)  # (B, T)
    elif level == "token":
        coef = head.coefficient(l, r)  # (B, T)
    elif level == "token_to_go":
        coef = reverse_cumsum(torch.where(mask, head.coefficient(l, r), 0.0))  # (B, T)
    else:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return torch.where(mask, coef, 0.0)
