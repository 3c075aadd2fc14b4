"""klgrad's built-in heads in float32, bfloat16 and float16: every head's coefficient and gradient against float64,
over log-ratios u = l − r ∈ [−30, 30].

Setup. Log-prob pairs (l, r) ≤ 0 with l − r = u, u on a grid of multiples of 0.01 in [−30, 30] plus ±10^k for
k ∈ [−6, −2] (where a cancelling form loses its relative accuracy), around three base log-probs (0, −log 2,
−log 10);
stored in the dtype d under test. The gradient g is d(kl_loss_per_sequence at ``token`` level)/d(logp) by
autograd, in d (as-loss heads: ∂ψ/∂l; in-reward heads: c); the coefficient is ``head.coefficient``. The
reference g64 is the head's closed form written here, evaluated in float64 on the *same* rounded log-probs, so
what is measured is klgrad's arithmetic, not the rounding of the log-probs.

Bound, derived from the arithmetic (first order in the unit roundoffs):

    |g − g64| ≤ (u_d·[d is half precision] + (κ + m)·u_32 + e_64)·|g64|

- u_d: unit roundoff of d (float32 2^-24, bfloat16 2^-8, float16 2^-11). klgrad computes in float32 (its rule:
  half-precision log-probs are promoted before the log-ratio is taken) and the gradient of a half-precision
  logp is rounded once to d: ≤ u_d. The coefficient is returned in float32: no such term.
- κ·u_32: the log-ratio u = l − r is computed once in float32: exact for half-precision inputs (two 8- or
  11-bit significands fit float32's 24 bits), ≤ u_32·|u| for float32 inputs; a relative perturbation of u moves
  g by κ = max |u·g'(u)/g(u)|, the condition number of the head's g, derived per head below.
- m·u_32: the head's own operations in float32: ≤ u_32 for each correctly rounded + − × /, ≤ 2·u_32 (1 ulp) for
  exp, expm1, log1p (glibc and SLEEF are within 1 ulp), each carried through the later operations with their
  condition numbers; counted per head below.
- e_64: the float64 references' own error. They are the plain formulas, which cancel near u = 0: ≤ 4·2^-53/|u|
  relative, |u| ≥ 10^-6 on the grid (smaller u rounds to 0 in the log-probs): e_64 = 5e-10.

Where |g64| does not fit d (above its largest number, or below its smallest normal number) the relative bound
does not apply: an overflow must saturate to ±inf with g64's sign (never nan), an underflow be within half the
subnormal spacing plus the relative bound. g64 = 0 (u = 0) must give exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from klgrad.kl import EXP_CAP, KL_HEADS, kl_loss_per_sequence

pytestmark = [pytest.mark.numerics, pytest.mark.filterwarnings("ignore:k1_as_loss has zero expected gradient")]

F64 = torch.float64
U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E64 = 5e-10  # 4·2^-53/10^-6 ≈ 4.4e-10: the float64 references' cancellation near u = 0


def _grid() -> tuple[Tensor, Tensor]:
    """(l, r) float64, (3M,): l − r = u on the grid, both ≤ 0, around the bases 0, −log 2, −log 10."""
    even = torch.arange(-3000, 3001, dtype=F64) / 100.0
    small = torch.logspace(-6.0, -2.0, 25, dtype=F64)
    u = torch.unique(torch.cat([even, small, -small]))
    base = torch.tensor([0.0, -math.log(2.0), -math.log(10.0)], dtype=F64)[:, None]
    return (base + u.clamp(max=0.0)).reshape(-1), (base - u.clamp(min=0.0)).reshape(-1)


def _log_weight(x: Tensor) -> Tensor:
    """h(x) = log(2/(1 + e^{−x})), float64, plain."""
    return math.log(2.0) - torch.log1p(torch.exp(-x))


# float64 references g64(l, r), written from the math (docs/math.md, “KL heads”), and κ + m for each head.
Reference = Callable[[Tensor, Tensor], Tensor]
HEADS: dict[str, tuple[Reference, float]] = {
    # g ≡ 0: exact.
    "none": (lambda l, r: torch.zeros_like(l), 0.0),
    # g = u: κ = 1 (g is u itself), no further operation: κ + m = 1.
    "k1_in_reward": (lambda l, r: l - r, 1.0),
    "k2_as_loss": (lambda l, r: l - r, 1.0),
    # g = 1 − e^{−u} (constant 1 − e^20 below u = −20, the linear tail): computed as −expm1(min(−u, 20)).
    # κ = max |u e^{−u}/(1 − e^{−u})| = 20·e^20/(e^20 − 1) ≈ 20 at u = −20 (≤ 1 for u ≥ 0; 0 on the tail);
    # m = 2 (expm1, 1 ulp). κ + m = 22.
    "k3_as_loss": (lambda l, r: 1.0 - torch.exp(-(l - r).clamp(min=-EXP_CAP)), 22.0),
    "k3_in_reward": (lambda l, r: 1.0 - torch.exp(-(l - r).clamp(min=-EXP_CAP)), 22.0),
    # g ≡ 1: exact.
    "k1_as_loss": (lambda l, r: torch.ones_like(l), 0.0),
    # g = e^l − e^r, computed as sign(d)·e^{max(l, r)}·(−expm1(−|d|)), d = l − r: exp of an exact argument
    # (2), d's rounding through −expm1(−|d|), whose condition |d|e^{−|d|}/(1 − e^{−|d|}) ≤ 1 (1), expm1 (2),
    # the product (1). κ + m = 6.
    "mse_in_reward": (lambda l, r: torch.exp(l) - torch.exp(r), 6.0),
    # g = −e^{−u} (−e^20 below u = −20), computed as −exp(min(−u, 20)): κ = |u| ≤ 30, m = 2 (exp). κ + m = 32.
    "fkl_as_loss": (lambda l, r: -torch.exp(-(l - r).clamp(min=-EXP_CAP)), 32.0),
    # g = ½ h(u), h(x) = log(2/(1 + e^{−x})) computed as −log1p(½ expm1(−x)) for x ≥ −1: expm1 (2) through
    # log1p's condition |y/((1 + y) log1p(y))| ≤ 1/(½ log 2) ≈ 1.45 on y ∈ (−½, ∞) (2.9), log1p (2): 4.9;
    # as log 2 + x − log1p(e^x) below: the roundings of log 2, of log 2 + x, exp and log1p (4·0.31) and the last
    # subtraction, summed over |h(x)| ≥ 0.62, ≤ 4.6. κ = max |x h'(x)/h(x)| ≈ 1.23 (at x ≈ −2). κ + m ≤ 7.
    "js_in_reward": (lambda l, r: 0.5 * _log_weight(l - r), 7.0),
    # g = −½ e^{−v} h(−v), v = max(u, −20) (the linear tail's slope below): κ = |u|·|1 + h'(−u)/h(−u)|, which
    # is ≤ |u| + 1 ≤ 31; m = exp (2) + h at an exact argument (≤ 5, as above) + two products (2) = 9.
    # κ + m = 40.
    "js_as_loss": (
        lambda l, r: -0.5 * torch.exp(-(l - r).clamp(min=-EXP_CAP)) * _log_weight(-(l - r).clamp(min=-EXP_CAP)),
        40.0,
    ),
}


def test_every_built_in_head_has_a_reference_and_a_bound():
    assert set(HEADS) == set(KL_HEADS)


def _gradient(name: str, l: Tensor, r: Tensor) -> Tensor:
    """d(per-token KL loss)/d(logp) through the public loss, in the dtype of ``l``, (N,) -> (N,)."""
    leaf = l[:, None].clone().requires_grad_(True)
    mask = torch.ones_like(leaf, dtype=torch.bool)
    loss = kl_loss_per_sequence(KL_HEADS[name], leaf, r[:, None], mask, level="token").sum()
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    return torch.zeros_like(l) if grad is None else grad[:, 0]


def _check(got: Tensor, want: Tensor, dtype: torch.dtype, rel_bound: float) -> None:
    """The module's bound: relative where |want| fits ``dtype``; saturation on overflow; 0 where want is 0."""
    info = torch.finfo(dtype)
    got = got.double()
    mag = want.abs()
    over = mag > info.max
    assert torch.equal(got[over], torch.copysign(torch.full_like(got[over], math.inf), want[over]))
    zero = mag == 0
    assert torch.equal(got[zero], torch.zeros_like(got[zero])), "a zero gradient must be exactly 0"
    normal = (mag >= info.tiny) & ~over
    err = ((got - want).abs() / mag)[normal]
    assert bool(torch.isfinite(got[~over]).all())
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= rel_bound, f"max relative error {worst:.3g} > bound {rel_bound:.3g}"
    sub = (mag > 0) & (mag < info.tiny)
    half_spacing = 0.5 * info.tiny * info.eps
    assert bool(((got - want).abs() <= half_spacing + rel_bound * mag)[sub].all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(HEADS))
def test_gradient_within_the_derived_bound(name, dtype):
    """The gradient of a ``dtype`` logp: float32 arithmetic, rounded once to ``dtype``."""
    reference, kappa_m = HEADS[name]
    l, r = (x.to(dtype) for x in _grid())
    want = reference(l.double(), r.double())
    half = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 0.0
    got = _gradient(name, l, r)
    assert got.dtype == dtype
    _check(got, want, dtype, half + kappa_m * U32 + E64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(HEADS))
def test_coefficient_within_the_derived_bound(name, dtype):
    """``head.coefficient`` of ``dtype`` log-probs: float32 (promoted), so no rounding to ``dtype``."""
    reference, kappa_m = HEADS[name]
    l, r = (x.to(dtype) for x in _grid())
    want = reference(l.double(), r.double())
    got = KL_HEADS[name].coefficient(l, r)
    assert got.dtype == torch.float32
    _check(got, want, torch.float32, kappa_m * U32 + E64)


# Regression: before the closed-form derivatives, autograd through the values cancelled. In float32:
# k3_as_loss computed 1 − e^{−u} as −(expm1(−u) + 1) + 1 (rel. error 6% at u = 10^-6), fkl_as_loss e^{−u} as
# expm1(−u) + 1 (0 for u ≥ 16.6), js_in_reward ½(log 2 − softplus(−u)) (7% at u = 10^-6); and js_as_loss's
# gradient at u = 0 exactly was 0.5, not 0 (autograd through the kinks of max(x, 0) + log1p(e^{−|x|})).
@pytest.mark.parametrize(
    ("name", "u", "want"),
    [
        ("k3_as_loss", 1e-6, -math.expm1(-1e-6)),
        ("fkl_as_loss", 18.0, -math.exp(-18.0)),
        ("js_in_reward", 1e-6, -0.5 * math.log1p(0.5 * math.expm1(-1e-6))),
        ("js_as_loss", 0.0, 0.0),
    ],
)
def test_regression_cancelling_gradients(name, u, want):
    l = torch.tensor([u], dtype=torch.float32)
    got = float(_gradient(name, l, torch.zeros_like(l))[0])
    assert got == pytest.approx(want, rel=4 * U32, abs=0.0)


def test_second_derivative_of_a_closed_form_penalty():
    """The backward pass is differentiable: ∂²ψ/∂l² is e^{−u} for k3 (ψ′ = 1 − e^{−u}) and for the forward KL
    (ψ′ = −e^{−u})."""
    l = torch.tensor([0.3, -1.2], dtype=F64, requires_grad=True)
    r = torch.zeros_like(l)
    for name, second in (("k3_as_loss", torch.exp(-l.detach())), ("fkl_as_loss", torch.exp(-l.detach()))):
        psi = KL_HEADS[name].penalty(l, r).sum()
        (g,) = torch.autograd.grad(psi, l, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), l)
        torch.testing.assert_close(h, second, rtol=1e-15, atol=0.0)
