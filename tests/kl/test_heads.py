"""Tests for klgrad.kl: estimators, the head registry, coefficients and the KL loss.

Every test here would fail if the math were wrong: hand-worked values (math in the comments), exact
enumeration of expectations, autograd as the reference for coefficients, a plain-Python loop as the
reference for token_to_go, and property tests (hypothesis) for padding, finiteness and micro-batching.
All numerics are float64 with tight tolerances (rtol/atol 1e-12 or bitwise equality) unless a test is
about float32.

Tests marked ``# Regression`` document defects this file found in klgrad.kl (cancellation near u = 0), since
fixed.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from decimal import Decimal, localcontext
from typing import get_args

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import klgrad.kl as kl
from klgrad.choices import LEVELS, RATIO_LEVELS, HeadName
from klgrad.kl import (
    EXP_CAP,
    KL_HEADS,
    MAX_LOG_RATIO,
    KLHead,
    clipped_surrogate_penalty,
    custom_kl_head,
    exp_linear_tail,
    get_kl_head,
    importance_ratio,
    kl_estimate,
    kl_loss,
    kl_loss_per_sequence,
    level_coefficients,
)

pytestmark = pytest.mark.numerics

F64 = torch.float64
F32 = torch.float32
TIGHT = {"rtol": 1e-12, "atol": 1e-12}
HEAD_NAMES = (
    "none",
    "k1_in_reward",
    "k2_as_loss",
    "k3_as_loss",
    "k3_in_reward",
    "k1_as_loss",
    "mse_in_reward",
    "fkl_as_loss",
    "js_in_reward",
    "js_as_loss",
)
AS_LOSS = ("k2_as_loss", "k3_as_loss", "k1_as_loss", "fkl_as_loss", "js_as_loss")
STYLES = {
    "none": "none",
    "k1_in_reward": "in_reward",
    "k2_as_loss": "as_loss",
    "k3_as_loss": "as_loss",
    "k3_in_reward": "in_reward",
    "k1_as_loss": "as_loss",
    "mse_in_reward": "in_reward",
    "fkl_as_loss": "as_loss",
    "js_in_reward": "in_reward",
    "js_as_loss": "as_loss",
}
FAST = settings(max_examples=60, deadline=None)
F32_MAX_1E18 = 9.999999843067494e17  # the largest float32 <= 1e18 (hypothesis needs representable bounds)

# How kl_loss is called, off-policy or not. "bug" = the common bug: old_logp given, is_correction=False.
MODES: dict[str, dict] = {
    "on": {},
    "off_seq": {"ratio_level": "sequence"},
    "off_tok": {"ratio_level": "token"},
    "off_seq_clip": {"ratio_level": "sequence", "clip_eps": 0.2},
    "off_tok_clip": {"ratio_level": "token", "clip_eps": 0.2},
    "bug": {"is_correction": False},
}


# --------------------------------------------------------------------------------------------------
# helpers


def t64(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def closed_coefficient(name: str, l: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The coefficient column of docs/math.md, “KL heads”, written independently of klgrad.kl (naive float64)."""
    u = l - r
    return {
        "none": torch.zeros_like(u),
        "k1_in_reward": u,
        "k2_as_loss": u,
        "k3_as_loss": 1.0 - torch.exp(-u),
        "k3_in_reward": 1.0 - torch.exp(-u),
        "k1_as_loss": torch.ones_like(u),
        "mse_in_reward": torch.exp(l) - torch.exp(r),
        "fkl_as_loss": -torch.exp(-u),
        "js_in_reward": 0.5 * torch.log(2.0 / (1.0 + torch.exp(-u))),
        "js_as_loss": -0.5 * torch.exp(-u) * torch.log(2.0 * torch.exp(-u) / (1.0 + torch.exp(-u))),
    }[name]


def coef_py(name: str, l: float, r: float) -> float:
    """The same table in plain Python floats, for the loop references."""
    u = l - r
    return {
        "none": 0.0,
        "k1_in_reward": u,
        "k2_as_loss": u,
        "k3_as_loss": 1.0 - math.exp(-u),
        "k3_in_reward": 1.0 - math.exp(-u),
        "k1_as_loss": 1.0,
        "mse_in_reward": math.exp(l) - math.exp(r),
        "fkl_as_loss": -math.exp(-u),
        "js_in_reward": 0.5 * math.log(2.0 / (1.0 + math.exp(-u))),
        "js_as_loss": -0.5 * math.exp(-u) * math.log(2.0 * math.exp(-u) / (1.0 + math.exp(-u))),
    }[name]


def make_batch(seed: int, B: int, T: int, *, holes: bool = True, u_scale: float = 0.7):
    """Random log-probs (B, T), reference, behaviour, and a right-padded mask with optional holes."""
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.01  # (B, T) in (-3.01, -0.01)
    ref = logp + u_scale * torch.randn(B, T, generator=g, dtype=F64)  # (B, T)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)  # (B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # (B,)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    if holes:
        mask &= torch.rand(B, T, generator=g) > 0.25
        mask[:, 0] = True  # every row keeps a token
    return logp, ref, old, mask


def run(head, logp, ref, mask, level, mode, old=None, **extra):
    """Per-sequence loss (B,) and d(sum of it)/d logp (B, T) for a mode of MODES."""
    x = logp.detach().clone().requires_grad_(True)
    kw = dict(MODES[mode])
    old_logp = None if mode == "on" else old
    per = kl_loss_per_sequence(head, x, ref, mask, old_logp=old_logp, level=level, **kw, **extra)
    (grad,) = torch.autograd.grad(per.sum(), x)
    return per.detach(), grad


def head(name: str):
    return KL_HEADS[name]  # the registry: no k1_as_loss warning


# --------------------------------------------------------------------------------------------------
# 1. kl_estimate (docs/math.md, “Value estimators”)


def test_registry_names_and_styles():
    assert set(KL_HEADS) == set(HEAD_NAMES)
    for name, h in KL_HEADS.items():
        assert h.name == name
        assert h.style == STYLES[name]
        assert (h.penalty(t64([0.0]), t64([0.0])) is None) == (STYLES[name] != "as_loss")


def test_kl_estimate_hand_values():
    # u = l - r.  u = log 2:  k1 = log 2, k2 = (log 2)^2 / 2, k3 = 1/2 - 1 + log 2 = log 2 - 1/2 (δ = 1/2)
    #             u = -log 2: k3 = 2 - 1 - log 2 = 1 - log 2                             (δ = 2)
    #             u = 1:      k3 = e^-1 - 1 + 1 = e^-1;   u = -1: k3 = e - 1 - 1 = e - 2;  u = 0: all 0
    #             u = 3:      k2 = 9/2,  k3 = e^-3 - 1 + 3 = e^-3 + 2
    ln2 = math.log(2.0)
    r = t64([-1.5, 0.0, -2.0, -0.25, -7.0, -3.0])
    u = t64([ln2, -ln2, 1.0, -1.0, 0.0, 3.0])
    l = r + u
    uu = l - r  # what the library sees (rounded like this)
    torch.testing.assert_close(kl_estimate(l, r, "k1"), uu, rtol=0, atol=0)
    k2 = t64([ln2**2 / 2, ln2**2 / 2, 0.5, 0.5, 0.0, 4.5])
    torch.testing.assert_close(kl_estimate(l, r, "k2"), k2, **TIGHT)
    k3 = t64([ln2 - 0.5, 1.0 - ln2, math.exp(-1.0), math.e - 2.0, 0.0, math.exp(-3.0) + 2.0])
    torch.testing.assert_close(kl_estimate(l, r, "k3"), k3, **TIGHT)


def test_kl_estimate_broadcasts_and_rejects_unknown_kind():
    l = t64([[0.0], [-1.0]])  # (2, 1)
    r = t64([-1.0, 0.0, -2.0])  # (3,)
    out = kl_estimate(l, r, "k1")
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, l - r, rtol=0, atol=0)
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(l, l, "k4")


# Regression (fixed). kl_estimate(..., "k3") (and the k3_as_loss penalty, same
# formula) computes (exp(-u) - 1) + u, which cancels near u = 0 and returns NEGATIVE values, e.g.
# u = 1e-10 -> -8.27e-18 and u = -1e-17 -> -1e-17 (exp(1e-17) rounds to 1). The docstring promises
# k3 >= 0 always. Fixed with expm1(-u) + u for -u <= EXP_CAP (expm1(-u) >= -u survives rounding, so the sum is
# >= 0).
@FAST
@given(
    r=st.floats(-100.0, 100.0),
    u=st.floats(-1e6, 1e6) | st.floats(-1e-6, 1e-6),
)
@example(r=0.0, u=1e-10)
@example(r=0.0, u=-1e-17)
def test_k3_is_nonnegative_everywhere(r, u):
    l = t64([r + u])
    assert kl_estimate(l, t64([r]), "k3").item() >= 0.0
    assert head("k3_as_loss").penalty(l, t64([r])).item() >= 0.0


@FAST
@given(
    q=st.lists(st.floats(1e-3, 1.0), min_size=2, max_size=6),
    p=st.lists(st.floats(1e-3, 1.0), min_size=6, max_size=6),
)
def test_k1_and_k3_are_unbiased_under_q_by_enumeration(q, p):
    # E_q[k1] = Σ q log(q/p) = KL(q‖p);  E_q[k3] = Σ q (p/q - 1 + log(q/p)) = Σp - Σq + KL = KL.
    qt = t64(q) / sum(q)  # (K,)
    pt = t64(p[: len(q)]) / sum(p[: len(q)])  # (K,)
    exact = math.fsum(qi * math.log(qi / pi) for qi, pi in zip(qt.tolist(), pt.tolist(), strict=True))
    for kind in ("k1", "k3"):
        est = (qt * kl_estimate(qt.log(), pt.log(), kind)).sum()
        torch.testing.assert_close(est, t64(exact), **TIGHT)


def test_k2_is_biased_hand_example():
    # q = [1/2, 1/2], p = [1/4, 3/4]: KL = ½ log 2 + ½ log(2/3) = ½ log(4/3) ≈ 0.143841.
    # E_q[k3] = ½(½ - 1 + log 2) + ½(3/2 - 1 + log(2/3)) = KL exactly; E_q[k2] = ¼(log²2 + log²(2/3)) ≠ KL.
    q, p = t64([0.5, 0.5]), t64([0.25, 0.75])
    kl_exact = 0.5 * math.log(4.0 / 3.0)
    torch.testing.assert_close((q * kl_estimate(q.log(), p.log(), "k3")).sum(), t64(kl_exact), **TIGHT)
    k2 = 0.25 * (math.log(2.0) ** 2 + math.log(2.0 / 3.0) ** 2)
    torch.testing.assert_close((q * kl_estimate(q.log(), p.log(), "k2")).sum(), t64(k2), **TIGHT)
    assert abs(k2 - kl_exact) > 1e-3


# --------------------------------------------------------------------------------------------------
# 2. coefficients and styles (docs/math.md, “KL heads”)


def test_coefficients_hand_values():
    # l = log 0.5, r = log 0.25: u = log 2, δ = 1/2:
    #   k1/k2 c = log 2; k3 c = 1 - 1/2 = 1/2; mse c = 0.5 - 0.25 = 0.25; k1_as_loss c = 1; none 0.
    # l = log 0.1, r = log 0.4: u = -log 4, δ = 4: k3 c = 1 - 4 = -3; mse c = 0.1 - 0.4 = -0.3.
    l = t64([math.log(0.5), math.log(0.1)])
    r = t64([math.log(0.25), math.log(0.4)])
    expect = {
        "none": [0.0, 0.0],
        "k1_in_reward": [math.log(2.0), -math.log(4.0)],
        "k2_as_loss": [math.log(2.0), -math.log(4.0)],
        "k3_as_loss": [0.5, -3.0],
        "k3_in_reward": [0.5, -3.0],
        "k1_as_loss": [1.0, 1.0],
        "mse_in_reward": [0.25, -0.3],
    }
    for name, vals in expect.items():
        torch.testing.assert_close(head(name).coefficient(l, r), t64(vals), **TIGHT, msg=name)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_coefficient_matches_closed_form_random(name):
    logp, ref, _, _ = make_batch(0, 4, 9, u_scale=3.0)
    torch.testing.assert_close(head(name).coefficient(logp, ref), closed_coefficient(name, logp, ref), **TIGHT)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_coefficient_is_detached(name):
    l = t64([-0.3, -2.0, -5.0]).requires_grad_(True)
    r = t64([-1.0, -1.0, -1.0]).requires_grad_(True)
    c = head(name).coefficient(l, r)
    assert not c.requires_grad
    assert c.grad_fn is None
    assert c.shape == l.shape
    assert c.dtype == F64


def test_custom_coefficient_is_detached():
    h = custom_kl_head(lambda l, r: 0.5 * (l - r) ** 2, "k2_custom")
    c = h.coefficient(t64([-0.3, -2.0]).requires_grad_(True), t64([-1.0, -1.0]))
    assert not c.requires_grad
    assert c.grad_fn is None


# --------------------------------------------------------------------------------------------------
# 3. as-loss heads: coefficient == autograd d(penalty)/d(logp) (paper eq. kn')

EXTREME_L = [0.0, -50.0, -25.0, 0.0, -1e18, 1e18, -20.0, 0.0, -20.5, 21.0, -1e-300, -700.0]
EXTREME_R = [-50.0, 0.0, 0.0, -25.0, 1e18, -1e18, 0.0, -20.0, 0.0, 0.0, 0.0, -1400.0]


def autograd_coefficient(h, l: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    x = l.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(h.penalty(x, r).sum(), x)
    return g


@pytest.mark.parametrize("name", AS_LOSS)
def test_coefficient_is_gradient_of_penalty_random(name):
    logp, ref, _, _ = make_batch(1, 5, 7, u_scale=8.0)  # u up to ~±30: both sides of the cap
    h = head(name)
    torch.testing.assert_close(h.coefficient(logp, ref), autograd_coefficient(h, logp, ref), **TIGHT)


@pytest.mark.parametrize("name", AS_LOSS)
def test_coefficient_is_gradient_of_penalty_extreme(name):
    # includes the clamp region |u| > 20 of k3 (u = -50, -25, -1e18·2, -20.5, ±1e18·2)
    l, r = t64(EXTREME_L), t64(EXTREME_R)
    h = head(name)
    c = h.coefficient(l, r)
    g = autograd_coefficient(h, l, r)
    assert torch.isfinite(c).all()
    assert torch.isfinite(g).all()
    torch.testing.assert_close(c, g, **TIGHT)


@FAST
@given(l=st.floats(-1e18, 1e18), r=st.floats(-1e18, 1e18))
def test_coefficient_is_gradient_of_penalty_hypothesis(l, r):
    for name in AS_LOSS:
        h = head(name)
        torch.testing.assert_close(
            h.coefficient(t64([l]), t64([r])), autograd_coefficient(h, t64([l]), t64([r])), **TIGHT
        )


# --------------------------------------------------------------------------------------------------
# 4. custom heads


def test_custom_k2_and_k3_match_builtins():
    logp, ref, _, _ = make_batch(2, 3, 6, u_scale=4.0)  # |u| well inside 20
    k2c = custom_kl_head(lambda l, r: 0.5 * (l - r) ** 2, "k2c")
    k3c = custom_kl_head(lambda l, r: torch.exp(r - l) - 1 + (l - r), "k3c")
    assert k2c.style == "as_loss"
    assert k2c.name == "k2c"
    torch.testing.assert_close(k2c.coefficient(logp, ref), head("k2_as_loss").coefficient(logp, ref), **TIGHT)
    torch.testing.assert_close(k3c.coefficient(logp, ref), head("k3_as_loss").coefficient(logp, ref), **TIGHT)
    torch.testing.assert_close(k2c.penalty(logp, ref), head("k2_as_loss").penalty(logp, ref), **TIGHT)


def test_custom_quartic_penalty():
    # ψ = (l - r)^4 / 4  ->  c = (l - r)^3.  At u = 2: c = 8; u = -0.5: c = -0.125.
    h = custom_kl_head(lambda l, r: (l - r) ** 4 / 4, "quartic")
    l, r = t64([1.0, -1.5, -3.0]), t64([-1.0, -1.0, -0.25])
    torch.testing.assert_close(h.coefficient(l, r), t64([8.0, -0.125, -(2.75**3)]), **TIGHT)
    logp, ref, _, _ = make_batch(3, 2, 5, u_scale=2.0)
    torch.testing.assert_close(h.coefficient(logp, ref), (logp - ref) ** 3, **TIGHT)


def test_custom_head_in_kl_loss_sequence_level():
    # on-policy, sequence level: gradient on every valid token is c(U) = U^3 for the quartic penalty
    h = custom_kl_head(lambda l, r: (l - r) ** 4 / 4, "quartic")
    logp, ref, _, mask = make_batch(4, 3, 5)
    _, g = run(h, logp, ref, mask, "sequence", "on")
    U = torch.where(mask, logp - ref, 0.0).sum(-1)  # (B,)
    torch.testing.assert_close(g, torch.where(mask, (U**3)[:, None], 0.0), **TIGHT)


def test_custom_head_errors():
    bad = custom_kl_head(lambda l, r: (l - r).sum(), "bad")
    l, r = t64([-1.0, -2.0]), t64([-1.5, -1.0])
    with pytest.raises(ValueError, match="shape"):
        bad.coefficient(l, r)
    with pytest.raises(ValueError, match="shape"):
        bad.penalty(l, r)
    not_tensor = custom_kl_head(lambda l, r: 3.0, "scalar")
    with pytest.raises(ValueError, match=r"bad|scalar"):
        not_tensor.coefficient(l, r)
    with pytest.raises(TypeError):
        custom_kl_head(3.0, "x")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# 5. exactness within |u| <= 20 and finiteness everywhere


def _exact(quantity: str, l: float, r: float) -> Decimal:
    """60-digit value of a head's coefficient (".c") or penalty (".psi") at the exact floats (l, r)."""
    with localcontext() as ctx:
        ctx.prec = 60
        L, R = Decimal(l), Decimal(r)
        u = L - R
        one = Decimal(1)
        return {
            "none.c": Decimal(0),
            "k1_in_reward.c": u,
            "k2_as_loss.c": u,
            "k2_as_loss.psi": u * u / 2,
            "k3_as_loss.c": one - (-u).exp(),
            "k3_in_reward.c": one - (-u).exp(),
            "k3_as_loss.psi": (-u).exp() - one + u,
            "k3_estimate": (-u).exp() - one + u,
            "k1_as_loss.c": one,
            "k1_as_loss.psi": u,
            "mse_in_reward.c": L.exp() - R.exp(),
        }[quantity]


def _library(quantity: str, l: float, r: float) -> float:
    lt, rt = t64([l]), t64([r])
    if quantity == "k3_estimate":
        return kl_estimate(lt, rt, "k3").item()
    name, what = quantity.split(".")
    return (head(name).coefficient(lt, rt) if what == "c" else head(name).penalty(lt, rt)).item()


def _not_exact(quantity: str, l: float, r: float) -> str | None:
    """None if the library value is within rtol 1e-12 of the exact value, else a description."""
    got, exact = _library(quantity, l, r), _exact(quantity, l, r)
    if abs(Decimal(got) - exact) <= Decimal("1e-12") * abs(exact):
        return None
    return f"{quantity} at l={l!r}, r={r!r}: got {got!r}, exact {float(exact)!r}"


ALL_QUANTITIES = (
    "none.c",
    "k1_in_reward.c",
    "k2_as_loss.c",
    "k2_as_loss.psi",
    "k3_as_loss.c",
    "k3_in_reward.c",
    "k3_as_loss.psi",
    "k3_estimate",
    "k1_as_loss.c",
    "k1_as_loss.psi",
    "mse_in_reward.c",
)


@FAST
@given(r=st.floats(-100.0, 0.0), mag=st.floats(0.05, 20.0), sign=st.sampled_from([-1.0, 1.0]))
@example(r=0.0, mag=20.0, sign=-1.0)  # the cap itself: exp(r - l) = e^20 exactly, no linear tail
@example(r=-3.0, mag=20.0, sign=1.0)
def test_heads_exact_within_cap(r, mag, sign):
    # Every coefficient, penalty and the k3 estimate equals its exact value (60-digit Decimal reference,
    # rtol 1e-12) for 0.05 <= |u| <= 20: no clamp or linear tail alters a value inside the cap.
    # (Near u = 0 cancellation is a separate matter: see test_coefficients_exact_near_zero.)
    l = r + sign * mag
    bad = [msg for q in ALL_QUANTITIES if (msg := _not_exact(q, l, r)) is not None]
    assert not bad, bad


# (l, r) with tiny log-ratios u = 1e-3 ... 1e-17, both signs
NEAR_ZERO_POINTS = [
    (-2.0, -2.001),
    (-2.0, -1.999),
    (-1.0, -1.0 - 1e-6),
    (-1.0, -1.0 + 1e-6),
    (1e-10, 0.0),
    (-1e-10, 0.0),
    (1e-17, 0.0),
    (-1e-17, 0.0),
]


# Regression (fixed). Near u = 0 the k3 coefficient
# 1 - exp(r - l) and the MSE coefficient exp(l) - exp(r) cancel catastrophically: relative error ~1e-16/|u|
# (e.g. l = -1, r = -0.999999: k3 c = -1.00000049999e-6 vs exact -1.0000005e-6, rtol 5e-11), and for
# 0 < |u| < 1.1e-16 the coefficient is exactly 0: a nonzero gradient is zeroed (l = 1e-17, r = 0 -> c = 0).
# Fixed: k3 c = -expm1(min(r - l, EXP_CAP)); MSE c = sign(l - r)·e^{max(l, r)}·(-expm1(-|l - r|)).
@pytest.mark.parametrize(
    "quantity", ["k1_in_reward.c", "k2_as_loss.c", "k3_as_loss.c", "k3_in_reward.c", "mse_in_reward.c"]
)
def test_coefficients_exact_near_zero(quantity):
    bad = [msg for l, r in NEAR_ZERO_POINTS if (msg := _not_exact(quantity, l, r)) is not None]
    assert not bad, "\n".join(bad)


def _finite_floats(dtype: torch.dtype):
    if dtype == F32:
        return st.floats(-F32_MAX_1E18, F32_MAX_1E18, width=32)
    return st.floats(-1e18, 1e18)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([F32, F64]))
def test_heads_and_kl_loss_finite_on_extreme_inputs(data, dtype):
    B, T = 2, 3  # sums over <= 3 tokens (see test_kl_loss_sequence_level_float32_overflow for long rows)
    floats = _finite_floats(dtype)
    vals = data.draw(st.lists(floats, min_size=3 * B * T, max_size=3 * B * T))
    logp, ref, old = torch.tensor(vals, dtype=dtype).reshape(3, B, T).unbind(0)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).reshape(B, T)
    for name in HEAD_NAMES:
        h = head(name)
        c = h.coefficient(logp, ref)
        assert torch.isfinite(c).all(), name
        if h.style == "as_loss":
            x = logp.clone().requires_grad_(True)
            psi = h.penalty(x, ref)
            (g,) = torch.autograd.grad(psi.sum(), x)
            assert torch.isfinite(psi).all(), name
            assert torch.isfinite(g).all(), name
        for level, mode in itertools.product(LEVELS, MODES):
            x = logp.clone().requires_grad_(True)
            kw = MODES[mode]
            loss = kl_loss(h, x, ref, mask, old_logp=None if mode == "on" else old, level=level, **kw)
            (g,) = torch.autograd.grad(loss, x)
            assert torch.isfinite(loss), (name, level, mode, loss)
            assert torch.isfinite(g).all(), (name, level, mode)
    for kind in ("k1", "k2", "k3"):
        assert torch.isfinite(kl_estimate(logp, ref, kind)).all()
    # beyond the clamp the k3 coefficient keeps its sign: u < -20 -> c < 0 (never zeroed)
    u = logp - ref
    c3 = head("k3_as_loss").coefficient(logp, ref)
    assert (c3[u < -EXP_CAP] < 0).all()
    assert (c3[u > EXP_CAP] > 0).all()


# Documented bound (klgrad.kl's module docstring): a head sees |x| <= 1e18; at sequence level x are the sums.
# Inside it the float32 loss is finite; beyond it (½U² > 3.4e38) only the gradient is promised finite.
def test_kl_loss_sequence_level_float32_bound_is_on_the_sums():
    T = 20
    m = torch.ones(1, T, dtype=torch.bool)
    l = torch.full((1, T), 2.5e16, dtype=F32, requires_grad=True)  # Σl = 5e17, Σr = -5e17
    r = torch.full((1, T), -2.5e16, dtype=F32)
    loss = kl_loss(head("k2_as_loss"), l, r, m, level="sequence")
    (g,) = torch.autograd.grad(loss, l)
    assert torch.isfinite(loss)
    assert torch.isfinite(g).all()
    big = torch.full((1, T), 1e18, dtype=F32, requires_grad=True)  # sums 2e19: loss overflows, gradient not
    (g,) = torch.autograd.grad(kl_loss(head("k2_as_loss"), big, -big.detach(), m, level="sequence"), big)
    assert torch.isfinite(g).all()
    assert float(g.min()) > 0


def test_k3_gradient_sign_beyond_the_clamp():
    # u = -30 (π ≪ π_ref): c = 1 - e^{20} < 0 (saturated, not e^{30}), so minimising pushes logp UP.
    l, r = t64([[-30.0]]), t64([[0.0]])
    m = torch.ones(1, 1, dtype=torch.bool)
    for name in ("k3_as_loss", "k3_in_reward"):
        for level in LEVELS:
            _, g = run(head(name), l, r, m, level, "on")
            torch.testing.assert_close(g, t64([[1.0 - math.exp(EXP_CAP)]]), **TIGHT)
    # u = 1e6 (π ≫ π_ref): c = 1 - e^{-1e6} = 1
    torch.testing.assert_close(head("k3_as_loss").coefficient(t64([1e6]), t64([0.0])), t64([1.0]), **TIGHT)


def test_exp_linear_tail():
    cap = EXP_CAP
    x = t64([-1e3, -30.0, -1.0, 0.0, 1.5, 19.0, cap - 1e-9, cap])
    torch.testing.assert_close(exp_linear_tail(x), torch.exp(x), rtol=0, atol=0)  # exact below and at cap
    # above: e^cap (1 + x - cap); at cap + 1: 2 e^cap; at cap + 1e6: e^cap (1 + 1e6)
    above = t64([cap + 1e-9, cap + 1.0, cap + 1e6, 1e18])
    expect = math.exp(cap) * (1.0 + (above - cap))
    torch.testing.assert_close(exp_linear_tail(above), expect, **TIGHT)
    # continuous at the cap (C¹): value and slope from both sides agree
    eps = 1e-7
    lo, hi = exp_linear_tail(t64([cap - eps])), exp_linear_tail(t64([cap + eps]))
    assert abs((hi - lo).item()) <= 2.0 * eps * math.exp(cap) * (1 + 1e-6)
    for xs, slope in (
        ([cap + 1e-9, cap + 3.0, 1e18], math.exp(cap)),
        ([cap], math.exp(cap)),
        ([-2.0], math.exp(-2.0)),
    ):
        xt = t64(xs).requires_grad_(True)
        (g,) = torch.autograd.grad(exp_linear_tail(xt).sum(), xt)
        torch.testing.assert_close(g, torch.full_like(g, slope), **TIGHT)
    # a custom cap
    torch.testing.assert_close(exp_linear_tail(t64([3.0]), cap=1.0), t64([math.e * 3.0]), **TIGHT)


# --------------------------------------------------------------------------------------------------
# 6. registry

WITH_PENALTY = tuple(name for name, h in KL_HEADS.items() if h.penalty_fn is not None)  # from the registry itself


def test_registry_names_are_the_head_name_literal():
    # the config's choices (HeadName) and the registry are one list, in one order (the docs table's)
    assert tuple(KL_HEADS) == get_args(HeadName) == HEAD_NAMES
    assert WITH_PENALTY == AS_LOSS


@pytest.mark.parametrize("name", WITH_PENALTY)
def test_every_record_coefficient_fn_is_the_gradient_of_its_penalty_fn(name):
    # The record's pure functions themselves (paper eq. kn′): coefficient_fn(l̄, r) = ∂ penalty_fn / ∂l at l̄, on
    # both sides of the exp cap (u up to ~±30), and autograd_coefficient (what custom heads use) agrees.
    h = KL_HEADS[name]
    logp, ref, _, _ = make_batch(16, 4, 7, u_scale=8.0)
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(h.penalty_fn(x, ref).sum(), x)
    torch.testing.assert_close(h.coefficient_fn(logp, ref), g, **TIGHT)
    torch.testing.assert_close(kl.autograd_coefficient(h.penalty_fn, logp, ref), g, rtol=0, atol=0)


def test_records_share_functions_where_the_heads_are_gradient_twins():
    # in-reward twins of as-loss heads use the very same coefficient function (no subclassing)
    assert KL_HEADS["k1_in_reward"].coefficient_fn is KL_HEADS["k2_as_loss"].coefficient_fn
    assert KL_HEADS["k3_in_reward"].coefficient_fn is KL_HEADS["k3_as_loss"].coefficient_fn
    for name, h in KL_HEADS.items():
        assert (h.penalty_fn is None) == (h.style != "as_loss"), name


def test_records_are_frozen_and_a_penalty_goes_with_the_as_loss_style():
    h = KL_HEADS["k2_as_loss"]
    assert repr(h) == "KLHead(name='k2_as_loss', style='as_loss')"
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.style = "in_reward"  # type: ignore[misc]
    common = {"targets": {}, "coefficient_formula": "u", "verdict": "x"}
    with pytest.raises(ValueError, match="as_loss"):
        KLHead(name="a", style="in_reward", coefficient_fn=kl.log_ratio_coefficient, penalty_fn=kl.k2_penalty, **common)
    with pytest.raises(ValueError, match="as_loss"):
        KLHead(name="b", style="as_loss", coefficient_fn=kl.log_ratio_coefficient, **common)


def test_custom_kl_head_is_a_record():
    def quartic(l, r):
        """ψ = (l - r)^4 / 4."""
        return (l - r) ** 4 / 4

    h = custom_kl_head(quartic, "quartic")
    assert isinstance(h, KLHead)
    assert (h.name, h.style) == ("quartic", "as_loss")
    assert repr(h) == "KLHead(name='quartic', style='as_loss')"
    assert h.targets == {"sequence": None, "token_to_go": None, "token": None}
    assert h.doc.startswith("ψ = (l - r)^4 / 4.")
    assert get_kl_head(h) is h


def test_adaptive_beta_is_a_clipped_proportional_controller():
    # β·(1 + rate·clip(KL/target - 1, -0.2, 0.2)/0.2): KL at 2× (½×) the target clips the error to +0.2 (-0.2)
    assert kl.adaptive_beta(1.0, 2.0, 1.0, 0.1) == pytest.approx(1.1)
    assert kl.adaptive_beta(1.0, 0.5, 1.0, 0.1) == pytest.approx(0.9)
    assert kl.adaptive_beta(2.0, 1.1, 1.0, 0.1) == pytest.approx(2.0 * (1.0 + 0.1 * 0.1 / 0.2))  # inside the clip
    assert kl.adaptive_beta(2.0, 1.0, 1.0, 0.1) == 2.0  # on target: unchanged


def test_k1_as_loss_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(kl.heads, "_warned_k1_as_loss", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        h1 = get_kl_head("k1_as_loss")
        h2 = get_kl_head("k1_as_loss")
        for name in HEAD_NAMES:
            if name != "k1_as_loss":
                get_kl_head(name)
    user = [w for w in rec if issubclass(w.category, UserWarning)]
    assert len(user) == 1
    assert "zero expected gradient" in str(user[0].message)
    assert h1 is h2 is KL_HEADS["k1_as_loss"]


def test_get_kl_head_unknown_and_passthrough():
    with pytest.raises(ValueError, match="unknown KL head") as err:
        get_kl_head("k4_as_loss")
    for name in HEAD_NAMES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="framework preset id, not a KL head"):  # the trainer builds its term
        get_kl_head("trl/grpo-k3")
    h = custom_kl_head(lambda l, r: l - r)
    assert get_kl_head(h) is h
    assert get_kl_head("k2_as_loss") is KL_HEADS["k2_as_loss"]


# --------------------------------------------------------------------------------------------------
# 7. kl_loss


def test_kl_loss_shape_validation():
    logp, ref, old, mask = make_batch(5, 2, 4)
    h = head("k2_as_loss")
    with pytest.raises(ValueError, match="logp"):
        kl_loss(h, logp[0], ref[0], mask[0])
    with pytest.raises(ValueError, match="ref_logp"):
        kl_loss(h, logp, ref[:, :3], mask)
    with pytest.raises(ValueError, match="mask"):
        kl_loss(h, logp, ref, mask[:1])
    with pytest.raises(ValueError, match="old_logp"):
        kl_loss(h, logp, ref, mask, old_logp=old.T)
    with pytest.raises(ValueError, match="level"):
        kl_loss(h, logp, ref, mask, level="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ratio_level"):
        kl_loss(h, logp, ref, mask, old_logp=old, ratio_level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_eps"):
        kl_loss(h, logp, ref, mask, old_logp=old, clip_eps=1.5)


def test_kl_loss_is_mean_of_per_sequence_and_accepts_01_masks():
    logp, ref, old, mask = make_batch(6, 4, 6)
    for name, level, mode in itertools.product(HEAD_NAMES, LEVELS, MODES):
        old_logp = None if mode == "on" else old
        per = kl_loss_per_sequence(head(name), logp, ref, mask, old_logp=old_logp, level=level, **MODES[mode])
        for m in (mask, mask.long(), mask.double()):
            loss = kl_loss(head(name), logp, ref, m, old_logp=old_logp, level=level, **MODES[mode])
            assert torch.equal(loss, per.mean()), (name, level, mode)


def test_none_head_is_zero_with_graph():
    logp, ref, _, mask = make_batch(7, 3, 4)
    for level in LEVELS:
        per, g = run(head("none"), logp, ref, mask, level, "on")
        assert torch.equal(per, torch.zeros(3, dtype=F64))
        assert torch.equal(g, torch.zeros_like(g))


def test_masked_sum_ignores_masked_nan():
    x = t64([[1.0, float("nan"), 2.5], [float("inf"), -1.0, float("-inf")]])
    m = torch.tensor([[True, False, True], [False, True, False]])
    assert torch.equal(kl.masked_sum(x, m), t64([3.5, -1.0]))


GARBAGE = [float("nan"), float("inf"), float("-inf"), 1e300, -1e300, 3e38]


@pytest.mark.parametrize("name", HEAD_NAMES)
@pytest.mark.parametrize("level", LEVELS)
def test_padding_garbage_changes_nothing(name, level):
    logp, ref, old, mask = make_batch(8, 4, 7)
    n_masked = int((~mask).sum())
    junk = t64([GARBAGE[i % len(GARBAGE)] for i in range(n_masked)])
    clean = [torch.where(mask, x, 0.0) for x in (logp, ref, old)]
    dirty = []
    for k, x in enumerate((logp, ref, old)):
        y = x.clone()
        y[~mask] = junk.roll(k)
        dirty.append(y)
    for mode in MODES:
        per_c, g_c = run(head(name), clean[0], clean[1], mask, level, mode, old=clean[2])
        per_d, g_d = run(head(name), dirty[0], dirty[1], mask, level, mode, old=dirty[2])
        assert torch.equal(per_c, per_d), (mode, per_c, per_d)
        assert torch.equal(g_c, g_d), mode
        assert torch.equal(g_d[~mask], torch.zeros(n_masked, dtype=F64)), mode


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_left_padding_equals_right_padding(name):
    B, T = 4, 6
    logp, ref, old, _ = make_batch(9, B, T)
    n = torch.tensor([6, 1, 3, 4])  # valid tokens per row
    right = torch.arange(T)[None, :] < n[:, None]  # (B, T)
    left = torch.arange(T)[None, :] >= (T - n)[:, None]  # (B, T) leading zeros

    def to_left(x):
        return torch.stack([x[b].roll(int(T - n[b])) for b in range(B)])

    for level, mode in itertools.product(LEVELS, MODES):
        per_r, g_r = run(head(name), logp, ref, right, level, mode, old=old)
        per_l, g_l = run(head(name), to_left(logp), to_left(ref), left, level, mode, old=to_left(old))
        torch.testing.assert_close(per_l, per_r, **TIGHT, msg=f"{level} {mode}")
        torch.testing.assert_close(g_l, to_left(g_r), **TIGHT, msg=f"{level} {mode}")


def test_k2_sequence_value_is_half_U_squared():
    logp, ref, _, mask = make_batch(10, 5, 8)
    per = kl_loss_per_sequence(head("k2_as_loss"), logp, ref, mask, level="sequence")
    for b in range(5):
        U = math.fsum((logp[b, t] - ref[b, t]).item() for t in range(8) if mask[b, t])
        assert abs(per[b].item() - 0.5 * U * U) <= 1e-12 * max(1.0, 0.5 * U * U)


@pytest.mark.parametrize("level", LEVELS)
def test_k1_in_reward_and_k2_as_loss_identical_per_sample_gradients(level):
    B = 4
    logp, ref, _, mask = make_batch(11, B, 6)
    grads = {}
    for name in ("k1_in_reward", "k2_as_loss"):
        x = logp.clone().requires_grad_(True)
        per = kl_loss_per_sequence(head(name), x, ref, mask, level=level)
        grads[name] = [torch.autograd.grad(per[b], x, retain_graph=True)[0] for b in range(B)]
    for b in range(B):
        assert torch.equal(grads["k1_in_reward"][b], grads["k2_as_loss"][b]), b
        others = torch.ones(B, dtype=torch.bool)
        others[b] = False
        assert torch.equal(grads["k2_as_loss"][b][others], torch.zeros_like(logp[others]))  # per-sample


def token_to_go_loop(name: str, logp, ref, mask) -> list[list[float]]:
    """C[b][t] = Σ_{t' >= t} m[b, t'] c(l[b, t'], r[b, t']) at valid t, 0 at masked t (plain Python)."""
    B, T = logp.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                out[b][t] = sum(coef_py(name, logp[b, s].item(), ref[b, s].item()) for s in range(t, T) if mask[b, s])
    return out


@pytest.mark.parametrize("name", HEAD_NAMES)
@pytest.mark.parametrize(("seed", "B", "T"), [(0, 1, 1), (1, 2, 5), (2, 3, 9), (3, 5, 4), (4, 1, 12)])
def test_token_to_go_matches_python_loop(name, seed, B, T):
    logp, ref, _, mask = make_batch(100 + seed, B, T, holes=True)
    expect = t64(token_to_go_loop(name, logp, ref, mask))
    torch.testing.assert_close(level_coefficients(head(name), logp, ref, mask, "token_to_go"), expect, **TIGHT)
    _, g = run(head(name), logp, ref, mask, "token_to_go", "on")  # on-policy gradient = C (per-seq sum)
    torch.testing.assert_close(g, expect, **TIGHT)


def test_level_coefficients_sequence_and_token():
    logp, ref, _, mask = make_batch(12, 3, 5)
    for name in HEAD_NAMES:
        L = torch.where(mask, logp, 0.0).sum(-1)  # (B,)
        R = torch.where(mask, ref, 0.0).sum(-1)  # (B,)
        seq = torch.where(mask, closed_coefficient(name, L, R)[:, None], 0.0)
        tok = torch.where(mask, closed_coefficient(name, logp, ref), 0.0)
        torch.testing.assert_close(level_coefficients(head(name), logp, ref, mask, "sequence"), seq, **TIGHT)
        torch.testing.assert_close(level_coefficients(head(name), logp, ref, mask, "token"), tok, **TIGHT)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_off_policy_with_old_equal_current_is_on_policy(name):
    logp, ref, _, mask = make_batch(13, 4, 6)
    old = logp.detach().clone()
    for level in LEVELS:
        _, g_on = run(head(name), logp, ref, mask, level, "on")
        for mode in ("off_seq", "off_tok", "off_seq_clip", "off_tok_clip"):
            _, g_off = run(head(name), logp, ref, mask, level, mode, old=old)
            torch.testing.assert_close(g_off, g_on, **TIGHT, msg=f"{level} {mode}")


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_is_correction_false_is_the_on_policy_computation(name):
    # the common bug: an off-policy batch treated as on-policy -> exactly the on-policy value and gradient
    logp, ref, old, mask = make_batch(14, 4, 6)
    for level in LEVELS:
        per_on, g_on = run(head(name), logp, ref, mask, level, "on")
        per_bug, g_bug = run(head(name), logp, ref, mask, level, "bug", old=old)
        assert torch.equal(per_on, per_bug), level
        assert torch.equal(g_on, g_bug), level
    # ... while the corrected off-policy gradient differs (old != logp)
    _, g_on = run(head("k1_in_reward"), logp, ref, mask, "sequence", "on")
    _, g_off = run(head("k1_in_reward"), logp, ref, mask, "sequence", "off_seq", old=old)
    assert not torch.allclose(g_on, g_off)


@pytest.mark.parametrize("name", ["k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward", "mse_in_reward"])
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_clip_side_single_sequence(name, ratio_level):
    # One sequence, sequence level; shift old_logp on one token so the ratio (token 0, and the sequence
    # ratio) is ρ = e^{δ}. Loss max(ρc, clip(ρ, 0.8, 1.2)c) (docs/math.md, “Off-policy: importance sampling and
    # the clip side”):
    #   c > 0: ρ = 1.5 -> unclipped, gradient ρ c > 0 flows (pushes logp down); ρ = 0.5 -> exactly 0.
    #   c < 0: ρ = 0.5 -> gradient ρ c < 0 flows (pushes logp up); ρ = 1.5 -> exactly 0.
    eps = 0.2
    m = torch.ones(1, 3, dtype=torch.bool)
    for sign in (+1.0, -1.0):
        logp = t64([[-1.0, -0.5, -2.0]])
        ref = logp - sign * t64([[0.3, 0.2, 0.4]])  # U = ±0.9: c has the sign of U for all these heads
        c = head(name).coefficient(logp.sum(-1), ref.sum(-1)).item()
        assert math.copysign(1.0, c) == sign
        assert c != 0.0
        for rho in (1.5, 0.5):
            old = logp - t64([[math.log(rho), 0.0, 0.0]])
            x = logp.clone().requires_grad_(True)
            loss = kl_loss(head(name), x, ref, m, old_logp=old, level="sequence", clip_eps=eps, ratio_level=ratio_level)
            (g,) = torch.autograd.grad(loss, x)
            pushes = (c > 0 and rho > 1 + eps) or (c < 0 and rho < 1 - eps)
            if ratio_level in ("sequence", "per_decision"):  # per decision at sequence level: one term, ρ_{1:T}
                expect = t64([[rho * c] * 3]) if pushes else torch.zeros(1, 3, dtype=F64)
            else:  # token ratio: tokens 1, 2 have ρ_t = 1 (inside the clip range, gradient c)
                expect = t64([[rho * c if pushes else 0.0, c, c]])
            torch.testing.assert_close(g, expect, **TIGHT, msg=f"sign={sign} rho={rho}")
            if pushes:
                assert math.copysign(1.0, g[0, 0].item()) == sign


def test_clipped_surrogate_is_ppo_with_advantage_minus_c():
    # decoupled KL head == combined form with R = 0, no normalisation: a PPO loss with advantage A = -c,
    # loss = -min(ρA, clip(ρ)A). Value and gradient in ρ must agree for every ρ and both signs of c.
    eps = 0.2
    rho = t64([0.1, 0.5, 0.79, 0.8, 0.95, 1.0, 1.1, 1.2, 1.21, 1.5, 4.0])
    for c in (0.7, -1.3):
        r1 = rho.clone().requires_grad_(True)
        r2 = rho.clone().requires_grad_(True)
        ours = clipped_surrogate_penalty(torch.full_like(rho, c), r1, eps)
        A = -c
        ppo = -torch.minimum(r2 * A, r2.clamp(1 - eps, 1 + eps) * A)
        torch.testing.assert_close(ours, ppo, **TIGHT)
        (g1,) = torch.autograd.grad(ours.sum(), r1)
        (g2,) = torch.autograd.grad(ppo.sum(), r2)
        torch.testing.assert_close(g1, g2, **TIGHT)
        # explicit: gradient c inside [1-ε, 1+ε]; outside only on the side the penalty pushes
        inside = (rho >= 1 - eps) & (rho <= 1 + eps)
        flows = inside | ((rho > 1 + eps) if c > 0 else (rho < 1 - eps))
        torch.testing.assert_close(g1, torch.where(flows, t64(c), t64(0.0)), **TIGHT)
    # clip_eps=None: plain ρc
    torch.testing.assert_close(clipped_surrogate_penalty(t64([2.0]), t64([3.0]), None), t64([6.0]), **TIGHT)


def test_importance_ratio_values_and_gradients():
    logp, _, old, mask = make_batch(15, 3, 5)
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=F64)  # (B, T) arbitrary weights
    # sequence: value ρ = exp(Σ m (l - o)) on every valid token, gradient of Σ_t w_t ρ̃_t is w_t ρ
    x = logp.clone().requires_grad_(True)
    rho_t = importance_ratio(x, old, mask, "sequence")
    rho = torch.exp(torch.where(mask, logp - old, 0.0).sum(-1, keepdim=True))  # (B, 1)
    torch.testing.assert_close(rho_t[mask], rho.expand(3, 5)[mask], **TIGHT)
    (g,) = torch.autograd.grad((w * rho_t)[mask].sum(), x)
    torch.testing.assert_close(g, torch.where(mask, w * rho, 0.0), **TIGHT)
    # token: value exp(l - o), gradient w_t exp(l_t - o_t)
    x = logp.clone().requires_grad_(True)
    rho_t = importance_ratio(x, old, mask, "token")
    torch.testing.assert_close(rho_t[mask], torch.exp(logp - old)[mask], **TIGHT)
    (g,) = torch.autograd.grad((w * rho_t)[mask].sum(), x)
    torch.testing.assert_close(g, torch.where(mask, w * torch.exp(logp - old), 0.0), **TIGHT)
    with pytest.raises(ValueError, match="ratio_level"):
        importance_ratio(logp, old, mask, "seq")  # type: ignore[arg-type]


@pytest.mark.parametrize("gap", [100.0, 1e6])
def test_ratio_cap_keeps_loss_finite_and_gradient_alive(gap):
    # l - o = gap on token 0: ρ would be e^100 (or inf); capped at e^20 in value, gradient unchanged in form.
    logp = t64([[-0.5, -1.0, -0.7]])
    ref = logp - 0.4  # u = 0.4 > 0 on every token: every head's coefficient is > 0
    old = logp - t64([[gap, 0.0, 0.0]])
    m = torch.ones(1, 3, dtype=torch.bool)
    cap = math.exp(MAX_LOG_RATIO)
    for name in ("k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward", "k1_as_loss", "mse_in_reward"):
        for level, ratio_level, clip in itertools.product(LEVELS, RATIO_LEVELS, (None, 0.2)):
            x = logp.clone().requires_grad_(True)
            loss = kl_loss(head(name), x, ref, m, old_logp=old, level=level, ratio_level=ratio_level, clip_eps=clip)
            (g,) = torch.autograd.grad(loss, x)
            assert torch.isfinite(loss), (name, level, ratio_level, clip)
            assert torch.isfinite(g).all(), (name, level, ratio_level, clip)
            assert (g > 0).all(), (name, level, ratio_level, clip, g)
    # exact value: k1_in_reward, sequence level and ratio: loss = e^20 · U, gradient e^20 · U on each token
    x = logp.clone().requires_grad_(True)
    loss = kl_loss(head("k1_in_reward"), x, ref, m, old_logp=old, level="sequence", ratio_level="sequence")
    (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(loss, t64(cap * 1.2), **TIGHT)
    torch.testing.assert_close(g, torch.full((1, 3), cap * 1.2, dtype=F64), **TIGHT)


# --------------------------------------------------------------------------------------------------
# exact enumeration: the expected on-policy gradient of each head is its documented target


def _policy(theta1: torch.Tensor, theta2: torch.Tensor):
    """Two-token autoregressive policy over a 3-letter vocabulary; all 9 sequences, (9, 2) log-probs."""
    lp1 = torch.log_softmax(theta1, -1)  # (3,)
    lp2 = torch.log_softmax(theta2, -1)  # (3, 3) row = first token
    seqs = list(itertools.product(range(3), range(3)))
    logp = torch.stack([torch.stack([lp1[a], lp2[a, b]]) for a, b in seqs])  # (9, 2)
    return logp, lp1, lp2


def _expected_gradient(name: str, level: str):
    g = torch.Generator().manual_seed(3)
    th1 = torch.randn(3, generator=g, dtype=F64).requires_grad_(True)
    th2 = torch.randn(3, 3, generator=g, dtype=F64).requires_grad_(True)
    ref_logp, ref1, ref2 = _policy(torch.randn(3, generator=g, dtype=F64), torch.randn(3, 3, generator=g, dtype=F64))
    logp, lp1, lp2 = _policy(th1, th2)
    prob = logp.sum(-1).exp()  # (9,)
    mask = torch.ones(9, 2, dtype=torch.bool)
    per = kl_loss_per_sequence(head(name), logp, ref_logp, mask, level=level)  # (9,)
    # Σ_y π̄(y) ∇ loss(y): the exact on-policy expectation of the gradient
    est = torch.autograd.grad((prob.detach() * per).sum(), (th1, th2), retain_graph=True)
    return est, (th1, th2), (logp, lp1, lp2), (ref_logp, ref1, ref2), prob


@pytest.mark.parametrize(
    ("name", "level", "target"),
    [
        ("k1_in_reward", "sequence", "rkl"),
        ("k2_as_loss", "sequence", "rkl"),
        ("k1_in_reward", "token_to_go", "rkl"),
        ("k2_as_loss", "token_to_go", "rkl"),
        ("k2_as_loss", "token", "local_rkl"),
        ("k3_as_loss", "sequence", "fkl"),
        ("k3_in_reward", "sequence", "fkl"),
        ("mse_in_reward", "sequence", "mse"),
        ("k1_as_loss", "sequence", "zero"),
        ("k1_as_loss", "token", "zero"),
        ("none", "token_to_go", "zero"),
    ],
)
def test_expected_gradient_by_enumeration(name, level, target):
    est, params, (logp, lp1, lp2), (ref_logp, ref1, ref2), prob = _expected_gradient(name, level)
    L, R = logp.sum(-1), ref_logp.sum(-1)  # (9,)
    if target == "rkl":  # KL(π‖π_ref) over sequences
        div = (prob * (L - R)).sum()
    elif target == "fkl":  # KL(π_ref‖π)
        div = (R.exp() * (R - L)).sum()
    elif target == "mse":
        div = 0.5 * ((prob - R.exp()) ** 2).sum()
    elif target == "local_rkl":  # KL of step 1 + Σ_a π̄(a) KL(π(·|a)‖π_ref(·|a)), prefix weights held fixed
        p1, p2 = lp1.exp(), lp2.exp()
        div = (p1 * (lp1 - ref1)).sum() + (p1.detach()[:, None] * p2 * (lp2 - ref2)).sum()
    else:
        div = (params[0] * 0).sum()
    want = torch.autograd.grad(div, params, allow_unused=True)
    for e, w in zip(est, want, strict=True):
        torch.testing.assert_close(e, torch.zeros_like(e) if w is None else w, **TIGHT)


def test_token_level_k2_is_not_the_sequence_rkl_gradient():
    # per-token k2 misses the future terms (docs/math.md, “Where a head acts: level”); its expected gradient
    # differs from ∇ KL(π‖π_ref)
    est, params, (logp, _, _), (ref_logp, _, _), prob = _expected_gradient("k2_as_loss", "token")
    want = torch.autograd.grad((prob * (logp.sum(-1) - ref_logp.sum(-1))).sum(), params)
    assert max((e - w).abs().max().item() for e, w in zip(est, want, strict=True)) > 1e-3


# --------------------------------------------------------------------------------------------------
# 8. micro-batching


@FAST
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_micro_batching_is_exact(seed, cuts):
    B = 7
    logp, ref, old, mask = make_batch(seed, B, 5)
    bounds = sorted({0, B, *cuts})
    for name, level, mode in itertools.product(HEAD_NAMES, LEVELS, MODES):
        kw = dict(MODES[mode], level=level, old_logp=None if mode == "on" else old)
        full = kl_loss_per_sequence(head(name), logp, ref, mask, **{**kw})
        parts = []
        for a, b in itertools.pairwise(bounds):
            o = None if kw["old_logp"] is None else kw["old_logp"][a:b]
            parts.append(kl_loss_per_sequence(head(name), logp[a:b], ref[a:b], mask[a:b], **{**kw, "old_logp": o}))
        assert torch.equal(full, torch.cat(parts)), (name, level, mode)


def test_register_and_load_user_heads(tmp_path, monkeypatch):
    """register_kl_head (libraries) and package.module:name (configs): a penalty becomes a custom head named by
    its spec, a KLHead passes through; clear errors otherwise; built-in names are not taken."""
    import dataclasses

    from klgrad.kl import custom_kl_head, get_kl_head, load_kl_head, register_kl_head

    (tmp_path / "heads_for_klgrad_test.py").write_text(
        "def psi(logp, ref_logp):\n    return (logp - ref_logp) ** 2\n\nnot_a_head = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    head = get_kl_head("heads_for_klgrad_test:psi")
    assert head.name == "heads_for_klgrad_test:psi"
    assert head.style == "as_loss"
    assert load_kl_head("heads_for_klgrad_test:psi") is head  # loaded once
    l, r = torch.tensor([0.3, -1.0]), torch.tensor([0.0, 0.5])
    assert head.coefficient(l, r).tolist() == pytest.approx((2 * (l - r)).tolist())
    for spec, msg in (
        ("heads_for_klgrad_test:nope", "has no attribute"),
        ("no_such_module_for_klgrad:psi", "cannot import"),
        ("heads_for_klgrad_test:not_a_head", "neither a KLHead nor a penalty"),
        ("bad spec:x", "package.module:name"),
    ):
        with pytest.raises(ValueError, match=msg):
            get_kl_head(spec)
    mine = register_kl_head(dataclasses.replace(custom_kl_head(lambda a, b: (a - b) ** 2), name="mine_for_test"))
    assert get_kl_head("mine_for_test") is mine
    with pytest.raises(ValueError, match="already registered"):
        register_kl_head(dataclasses.replace(mine))
    with pytest.raises(ValueError, match="built-in"):
        register_kl_head(dataclasses.replace(mine, name="k2_as_loss"))
