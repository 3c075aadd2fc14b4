"""Float promotion and the capped exponentials every KL computation uses (see :mod:`klgrad.kl`, "Numerics").

exp(x) is exact up to ``EXP_CAP`` and continues linearly above it, so values and gradients stay finite and keep
their sign; importance log-ratios are capped in value only (straight-through), so no clamp zeroes a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

EXP_CAP = 20.0
"""exp(x) is exact for x ≤ EXP_CAP and linear above (see :func:`exp_linear_tail`)."""

MAX_LOG_RATIO = 20.0
"""Default cap on an importance log-ratio: ρ ≤ e^20 ≈ 4.9e8 in value; the gradient passes unchanged."""


def at_least_f32(x: Tensor) -> Tensor:
    """x promoted to float32 if it is float16 or bfloat16, else x itself (any shape)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def exp_linear_tail(x: Tensor, cap: float = EXP_CAP) -> Tensor:
    r"""exp(x) for x ≤ cap, e^cap · (1 + x - cap) above; elementwise, any shape.

    C¹ and increasing: value and derivative (exp(min(x, cap))) are finite for every finite x, so a
    clamped exponential never silently zeroes a gradient or flips its sign.
    """
    e = torch.exp(x.clamp(max=cap))
    return torch.where(x <= cap, e, e * (1.0 + (x - cap)))


def expm1_linear_tail(x: Tensor, cap: float = EXP_CAP) -> Tensor:
    """exp_linear_tail(x) - 1 without cancellation near 0 (expm1 below the cap), elementwise."""
    return torch.where(x <= cap, torch.expm1(x.clamp(max=cap)), exp_linear_tail(x, cap) - 1.0)


def straight_through_cap(x: Tensor, cap: float) -> Tensor:
    """min(x, cap) in value, identity in gradient (the gradient is never zeroed)."""
    return x - (x - cap).clamp(min=0).detach()
