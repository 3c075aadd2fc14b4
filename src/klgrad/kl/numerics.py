"""Float promotion, the capped exponentials and the closed-form derivatives every KL computation uses (see
:mod:`klgrad.kl`, "Numerics").

exp(x) is exact up to ``EXP_CAP`` and continues linearly above it, so values and gradients stay finite and keep
their sign; importance log-ratios are capped in value only (straight-through), so no clamp zeroes a gradient.

Precision rule: every KL computation promotes half-precision log-probs (bfloat16, float16) to float32
(:func:`at_least_f32`) *before* it takes a log-ratio, so u = l − r of two half-precision log-probs is exact in
float32 (or within one float32 rounding when their exponents differ by more than 16), and the term is computed in
float32; the gradient of a half-precision ``logp`` is that float32 gradient rounded once to its dtype. A penalty's
derivative is a closed form evaluated as written (:func:`closed_form_slope`), never autograd through the value's
operations, which cancel (e.g. ∂/∂l of expm1(−u) + u is e^{−u}·(−1) + 1, all of whose digits cancel near u = 0).
"""

from __future__ import annotations

from collections.abc import Callable

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


class _ClosedFormSlope(torch.autograd.Function):
    """y = value_fn(x), whose derivative dy/dx is slope_fn(x) as written (see :func:`closed_form_slope`)."""

    @staticmethod
    def forward(ctx, x: Tensor, value_fn: Callable[[Tensor], Tensor], slope_fn: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.save_for_backward(x)
        ctx.slope_fn = slope_fn
        return value_fn(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (x,) = ctx.saved_tensors
        return grad * ctx.slope_fn(x), None, None


def closed_form_slope(x: Tensor, value_fn: Callable[[Tensor], Tensor], slope_fn: Callable[[Tensor], Tensor]) -> Tensor:
    r"""value_fn(x) in value, with derivative slope_fn(x): elementwise, any shape, output of value_fn's dtype.

    Autograd through value_fn's own operations can cancel where the value does not (∂/∂u of expm1(−u) + u is
    e^{−u}·(−1) + 1, computed as (expm1(−u) + 1)·(−1) + 1); slope_fn is the derivative in a form that does not
    (−expm1(−u)). The backward pass is differentiable, so higher derivatives are slope_fn's.
    """
    return _ClosedFormSlope.apply(x, value_fn, slope_fn)
