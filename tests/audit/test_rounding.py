"""klgrad.audit.rounding: inside ``correctly_rounded`` a low-precision operation is its float64 value rounded once to
its dtype (what makes docs/frameworks.md the same on every CPU), outside it torch's own kernels."""

from __future__ import annotations

import pytest
import torch

from klgrad.audit.precision import precision_report, preset_gradient
from klgrad.audit.presets import PRESETS
from klgrad.audit.rounding import correctly_rounded

U = torch.linspace(-30.0, 30.0, 200_001, dtype=torch.float64)  # steps of 3e-4: many points per binade
# (torch's own float32 exp, expm1, log1p and tanh differ from this at 100-2,500 of these points on an AMD EPYC:
# the float32 cases fail without the mode; bfloat16 and float16 kernels compute in float32 and round once anyway)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [torch.exp, torch.expm1, torch.log1p, torch.tanh])
def test_a_transcendental_is_its_float64_value_rounded_once(fn, dtype):
    x = U.to(dtype)
    with correctly_rounded():
        got = fn(x)
    assert got.dtype == dtype
    # float64's own result is within an ulp of the true value (2^-52 relative), so rounding it to a dtype of at
    # most 24 bits is the correctly rounded result except within 2^-29 of a midpoint: the same bits, compared exactly
    torch.testing.assert_close(got, fn(x.double()).to(dtype), rtol=0, atol=0, equal_nan=True)


def test_autograd_runs_inside_and_rounds_the_backward_too():
    x = U[::1000].to(torch.float32).requires_grad_(True)
    with correctly_rounded():
        (g,) = torch.autograd.grad(torch.exp(x).sum(), x)
    assert g.dtype == torch.float32
    assert torch.equal(g, torch.exp(x.detach().double()).to(torch.float32))  # d/dx e^x = e^x, rounded once


def test_float64_and_integer_work_is_untouched():
    x = U[::997]
    with correctly_rounded():
        assert torch.equal(torch.exp(x), torch.exp(x))
        assert torch.equal(torch.arange(5) * 3, torch.tensor([0, 3, 6, 9, 12]))


def test_the_precision_report_of_rho_k3_does_not_depend_on_the_kernels():
    """TRL's default (k3 × a differentiable ratio) cancels in float32; its report inside the mode is the report of
    float64 values rounded op by op, so it equals the same report computed with every op done by hand that way."""
    preset = next(p for p in PRESETS if p.id == "trl/grpo-k3-bias-correction")
    with correctly_rounded():
        inside = precision_report(preset_gradient(preset), "float32")
        again = precision_report(preset_gradient(preset), "float32")
    assert inside == again
    assert inside.zero is not None
    assert inside.wrong is not None
