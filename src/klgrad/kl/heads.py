"""KL heads (docs/math.md, “KL heads”): a registry of pure functions and one frozen record per head.

Pure coefficient functions c(l̄, r) and pure penalties ψ(l, r), and a :class:`KLHead` record per head that names
them with the text docs/math.md prints. Every function is elementwise: inputs of one (any) shape, float32 or
wider (:meth:`KLHead.coefficient` and :meth:`KLHead.penalty` promote), output of that shape. Expected-gradient
targets and levels are explained in :mod:`klgrad.kl`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from klgrad.import_path import import_object
from klgrad.kl.numerics import EXP_CAP, at_least_f32, closed_form_slope, exp_linear_tail, expm1_linear_tail

HeadStyle = Literal["in_reward", "as_loss", "none", "analytic"]
"""``analytic``: a head that reads whole next-token distributions (:mod:`klgrad.kl.analytic`), not c(l̄, r)."""
Target = Literal[
    "rkl", "fkl", "mse", "js", "local_rkl", "local_fkl", "local_mse", "local_js", "expected_length", "zero"
]
"""The expected on-policy gradient a head produces at a level (the meanings are in :mod:`klgrad.kl`)."""

CoefficientFn = Callable[[Tensor, Tensor], Tensor]
"""c(l̄, r) -> c: the detached weight a head puts on the score function ∇l."""

PenaltyFn = Callable[[Tensor, Tensor], Tensor]
"""ψ(l, r) -> ψ: an as-loss head's differentiable penalty; its coefficient is c = ∂ψ/∂l at l = l̄."""


def zero_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """c ≡ 0 (no KL regularisation)."""
    return torch.zeros_like(logp - ref_logp)


def log_ratio_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """c = u = l̄ - r: the exact reverse-KL coefficient (k1 in reward; ∂ψ/∂l of k2's ψ = ½(l - r)²)."""
    return logp - ref_logp


def k3_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    r"""c = 1 - e^{r - l̄} = 1 - δ (paper's k3′), ∂ψ/∂l of :func:`k3_penalty`.

    A first-order (Taylor) surrogate of the exact coefficient u = -log δ: it saturates at 1 when π ≫ π_ref
    (weak restoring force) and explodes like -δ when π ≪ π_ref. Computed as -expm1(r - l̄), so there is no
    cancellation near u = 0. Exact for u ≥ -20 (= -``EXP_CAP``); below, c = 1 - e^20: saturated, finite, sign
    kept, and equal to the slope of the penalty's linear tail there.
    """
    return -torch.expm1((ref_logp - logp).clamp(max=EXP_CAP))  # 1 - e^{-u}, no cancellation near u = 0


def unit_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """c ≡ 1, ∂ψ/∂l of :func:`k1_penalty`: independent of π_ref."""
    return torch.ones_like(logp - ref_logp)


def mse_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    r"""c = π̄ - π_ref = e^{l̄} - e^{r} (MiniMax-01's MSE head), in [-1, 1] for log-probs.

    Computed as sign(l̄ - r) · e^{max(l̄, r)} · (1 - e^{-|l̄ - r|}): exact, no cancellation near l̄ = r. The
    exponential is :func:`exp_linear_tail` (exact for log-probs ≤ 20, i.e. always for real ones).
    """
    d = logp - ref_logp
    return torch.sign(d) * exp_linear_tail(torch.maximum(logp, ref_logp)) * -torch.expm1(-d.abs())


def k1_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ψ = l - r; c = 1 (:func:`unit_coefficient`)."""
    return logp - ref_logp


def k2_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ψ = ½(l - r)²; c = u (:func:`log_ratio_coefficient`)."""
    u = logp - ref_logp
    return 0.5 * u * u


def k3_slope(u: Tensor) -> Tensor:
    """dψ/du of :func:`k3_penalty` = 1 - e^{-u}, as -expm1(min(-u, EXP_CAP)): no cancellation near u = 0, and
    the linear tail's slope 1 - e^20 for u < -20; elementwise, any shape (the coefficient :func:`k3_coefficient`
    in u)."""
    return -torch.expm1((-u).clamp(max=EXP_CAP))


def k3_value(u: Tensor) -> Tensor:
    """k3 = e^{-u} - 1 + u as expm1(-u) + u (linear in u below -20, :func:`expm1_linear_tail`); elementwise."""
    return expm1_linear_tail(-u) + u


def k3_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ψ = e^{r - l} - 1 + (l - r) ≥ 0; c = 1 - e^{r - l̄} (:func:`k3_coefficient`).

    Value :func:`k3_value` (e^{r - l} - 1 is :func:`expm1_linear_tail`: exact for u ≥ -20, linear, slope e^20,
    below); its derivative is the closed form :func:`k3_slope` (:func:`closed_form_slope`): autograd through the
    value would compute -(expm1(-u) + 1) + 1, which cancels near u = 0.
    """
    return closed_form_slope(logp - ref_logp, k3_value, k3_slope)


def fkl_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    r"""c = -δ = -e^{r - l̄} = -π_ref/π: the forward-KL score weight, ∂ψ/∂l of :func:`fkl_penalty`.

    On-policy E_π[-(π_ref/π) ∇ log π] = -Σ_y π_ref ∇ log π = ∇ KL(π_ref‖π). k3's coefficient 1 - δ is this plus
    the constant 1, whose expected score is zero: the same expected gradient, with a control variate. Exact for
    u ≥ -20; below, the exponent is capped (saturated, finite, sign kept), as in :func:`k3_coefficient`.
    """
    return -torch.exp((ref_logp - logp).clamp(max=EXP_CAP))


def fkl_slope(u: Tensor) -> Tensor:
    """dψ/du of :func:`fkl_penalty` = -e^{-u}, as -exp(min(-u, EXP_CAP)) (one exponential, no cancellation);
    elementwise, any shape."""
    return -torch.exp((-u).clamp(max=EXP_CAP))


def fkl_value(u: Tensor) -> Tensor:
    """e^{-u} - 1 as :func:`expm1_linear_tail` (-u); elementwise."""
    return expm1_linear_tail(-u)


def fkl_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ψ = e^{r - l} - 1 = π_ref/π - 1 (zero mean under π); c = -e^{r - l̄} (:func:`fkl_coefficient`).

    The importance-weighted form of the forward KL's gradient (RPG's normalised forward KL); its value is not
    a KL estimate (log the k-estimators for that). Value :func:`fkl_value`; derivative the closed form
    :func:`fkl_slope` (autograd through expm1 computes e^{-u} as expm1(-u) + 1, zero for u ≥ 16.6 in float32).
    """
    return closed_form_slope(logp - ref_logp, fkl_value, fkl_slope)


def _softplus(x: Tensor) -> Tensor:
    """log(1 + e^x) = max(x, 0) + log1p(e^{-|x|}): no overflow, no cancellation, and elementwise arithmetic only
    (torch's fused softplus kernel rounds differently in its vectorised and scalar loops, so the same row would
    get another value in another batch shape)."""
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def js_log_weight(x: Tensor) -> Tensor:
    r"""h(x) = log(2/(1 + e^{-x})) = log 2 - softplus(-x), elementwise, any shape, without cancellation.

    -log1p(expm1(-x)/2) for x ≥ -1 (no cancellation near x = 0, where h ≈ x/2), log 2 + x - log1p(e^x) below
    (terms of one sign but log 2 + x, condition ≤ 3.2). Finite for every finite x; h(x) ∈ (-∞, log 2).
    """
    above = -torch.log1p(0.5 * torch.expm1(-x.clamp(min=-1.0)))  # x ≥ -1
    below_x = x.clamp(max=-1.0)
    below = math.log(2.0) + below_x - torch.log1p(torch.exp(below_x))  # x < -1
    return torch.where(x >= -1.0, above, below)


def js_slope(u: Tensor) -> Tensor:
    r"""dψ/du of :func:`js_penalty` = -δ f_JS'(δ) = -½ e^{-u} h(-u) (:func:`js_log_weight`) for u ≥ -20, its
    value at -20 below (the penalty's linear tail); elementwise, any shape. No cancellation: one product."""
    v = u.clamp(min=-EXP_CAP)
    return -0.5 * torch.exp(-v) * js_log_weight(-v)


def js_value(u: Tensor) -> Tensor:
    r"""f_JS(δ), δ = e^{-u}, as ½[-u δ - (1 + δ)(softplus(-u) - log 2)] for u ≥ -20, continued linearly with
    slope :func:`js_slope` (-20) below; elementwise."""
    inside = u.clamp(min=-EXP_CAP)  # equal to u where the formula is exact
    delta = torch.exp(-inside)
    value = 0.5 * (-inside * delta - (1.0 + delta) * (_softplus(-inside) - math.log(2.0)))
    return value + js_slope(inside) * (u - inside)


def js_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    r"""ψ = f_JS(δ) with δ = e^{r - l}, f_JS(t) = ½[t log t - (1 + t) log((1 + t)/2)]: E_π[ψ] = JS(π‖π_ref).

    Written in u = l - r (:func:`js_value`). Exact for u ≥ -20 (= -``EXP_CAP``); below, ψ continues linearly
    with its slope at -20 (value and gradient finite, sign kept), as every klgrad head does. Its derivative is the
    closed form :func:`js_slope`, -δ f_JS'(δ) = -½ δ log(2δ/(1 + δ)): the pathwise part of ∇JS only (the
    score-function term f_JS(δ)∇l is missing, as k3's is for the KL).
    """
    return closed_form_slope(logp - ref_logp, js_value, js_slope)


def js_coefficient(logp: Tensor, ref_logp: Tensor) -> Tensor:
    r"""c = f_JS(δ) - δ f_JS'(δ) = ½ log(2/(1 + δ)) = ½ h(u) (:func:`js_log_weight`, no cancellation near u = 0):
    the exact Jensen–Shannon score weight, on-policy E_π[c ∇ log π] = ∇ JS(π‖π_ref) at sequence level. Bounded:
    c ∈ (-∞, ½ log 2), and ≈ u/4 near π_ref (JS ≈ KL/4 there)."""
    return 0.5 * js_log_weight(logp - ref_logp)


def autograd_coefficient(penalty_fn: PenaltyFn, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """c = ∂ψ/∂l at l = l̄ by autograd (paper eq. kn′), detached; 0 where ψ does not depend on l."""
    with torch.enable_grad():
        l = logp.detach().clone().requires_grad_(True)
        psi = penalty_fn(l, ref_logp.detach())
        (grad,) = torch.autograd.grad(psi.sum(), l, allow_unused=True)
    return torch.zeros_like(l.detach()) if grad is None else grad.detach()


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class KLHead:
    """A KL regulariser judged by its gradient: its pure functions and the text docs/math.md prints.

    Attributes:
        name: registry name.
        style: ``"in_reward"``, ``"as_loss"`` or ``"none"``.
        coefficient_fn: c(l̄, r), the detached weight on the score function ∇l (every head has one).
        penalty_fn: ψ(l, r) for an ``as_loss`` head (then c = ∂ψ/∂l at l = l̄), None for every other style.
        targets: per level, the expected on-policy gradient this head produces (see :mod:`klgrad.kl`),
            or None where it is not the gradient of a named divergence.
        penalty_formula, coefficient_formula, verdict: the head's row of the table in docs/math.md
            (generated by ``python -m klgrad.docs``): ψ(l, r), c(l̄, r) with u = l̄ - r, and what its
            gradient is.
        doc: what the head is, with its expected on-policy gradient at each level.

    Built-in heads are in :data:`KL_HEADS`; :func:`custom_kl_head` makes one from any penalty. Equality is
    identity.
    """

    name: str
    style: HeadStyle
    coefficient_fn: CoefficientFn
    penalty_fn: PenaltyFn | None = None
    targets: dict[str, Target | None]
    penalty_formula: str = "—"
    coefficient_formula: str
    verdict: str
    doc: str = ""

    def __post_init__(self) -> None:
        if (self.penalty_fn is not None) != (self.style == "as_loss"):
            raise ValueError(
                f"KL head {self.name!r}: an as_loss head has a penalty_fn and no other style does "
                f"(style {self.style!r}, penalty_fn {self.penalty_fn!r})"
            )

    def coefficient(self, logp: Tensor, ref_logp: Tensor) -> Tensor:
        """Detached score-function coefficient c(l̄, r); same shape as the inputs."""
        with torch.no_grad():
            return self.coefficient_fn(at_least_f32(logp.detach()), at_least_f32(ref_logp.detach()))

    def penalty(self, logp: Tensor, ref_logp: Tensor) -> Tensor | None:
        """Differentiable penalty ψ(l, r) for as-loss heads (gradient flows through ``logp``), else None."""
        if self.penalty_fn is None:
            return None
        return self.penalty_fn(at_least_f32(logp), at_least_f32(ref_logp.detach()))

    def __repr__(self) -> str:
        return f"KLHead(name={self.name!r}, style={self.style!r})"


_BUILT_IN_HEADS: tuple[KLHead, ...] = (
    KLHead(
        name="none",
        style="none",
        coefficient_fn=zero_coefficient,
        targets={"sequence": "zero", "token_to_go": "zero", "token": "zero"},
        coefficient_formula="0",
        verdict="baseline",
        doc="No KL regularisation: c = 0, no penalty. Expected gradient: zero at every level.",
    ),
    KLHead(
        name="k1_in_reward",
        style="in_reward",
        coefficient_fn=log_ratio_coefficient,
        targets={"sequence": "rkl", "token_to_go": "rkl", "token": "local_rkl"},
        coefficient_formula="u",
        verdict="exact reverse-KL gradient",
        doc="""k1 in reward (PPO / REINFORCE): detached coefficient c = u = l̄ - r on the score function.

        Expected gradient (on-policy):
          - sequence: E[U ∇ log π(y)] = ∇ KL(π‖π_ref), exact (paper eq. kl_grad_target).
          - token_to_go: E[Σ_t (Σ_{t'≥t} u_t') ∇l_t] = ∇ KL(π‖π_ref), exact and lower-variance (the dropped past
            terms Σ_{t'<t} u_t' are functions of the prefix, whose score has zero mean).
          - token: E[Σ_t u_t ∇l_t] = local_rkl: biased against the sequence reverse KL (future terms missing).
        """,
    ),
    KLHead(
        name="k2_as_loss",
        style="as_loss",
        coefficient_fn=log_ratio_coefficient,
        penalty_fn=k2_penalty,
        targets={"sequence": "rkl", "token_to_go": "rkl", "token": "local_rkl"},
        penalty_formula="½(l - r)²",
        coefficient_formula="u",
        verdict="exact; per-sample identical to k1_in_reward",
        doc="""k2 as loss: ψ = ½(l - r)², so c = ∂ψ/∂l = l̄ - r = u, identical to k1 in reward per sample.

        Expected gradient (on-policy): as k1_in_reward at every level — sequence: ∇ KL(π‖π_ref) exactly (ψ of
        the summed log-probs); token_to_go: exact; token: local_rkl, biased (docs/math.md, “Where a head acts:
        level”: per-token k2, what GRPO-style code does with k2, is NOT the sequence reverse-KL gradient).
        """,
    ),
    KLHead(
        name="k3_as_loss",
        style="as_loss",
        coefficient_fn=k3_coefficient,
        penalty_fn=k3_penalty,
        targets={"sequence": "fkl", "token_to_go": "local_fkl", "token": "local_fkl"},
        penalty_formula="exp(r - l) - 1 + (l - r)",
        coefficient_formula="1 - exp(-u)",
        verdict="biased first-order surrogate of the reverse-KL gradient (at sequence level it is exactly the "
        "gradient of the *forward* KL(ref‖π))",
        doc="""k3 as loss (GRPO): ψ = e^{r-l} - 1 + (l - r), so c = 1 - e^{r - l̄} = 1 - δ (paper's k3').

        A first-order surrogate of the exact coefficient u (:func:`k3_coefficient`). Expected gradient
        (on-policy):
          - sequence: E[(1 - π_ref/π) ∇ log π] = -Σ_y π_ref ∇ log π = ∇ KL(π_ref‖π): the exact gradient of the
            *forward* KL, a biased reverse-KL gradient.
          - token and token_to_go: local_fkl (the two coincide in expectation because E_π[Σ_t m_t(1 - δ_t)] ≡ 0).
        """,
    ),
    KLHead(
        name="k3_in_reward",
        style="in_reward",
        coefficient_fn=k3_coefficient,
        targets={"sequence": "fkl", "token_to_go": "local_fkl", "token": "local_fkl"},
        coefficient_formula="1 - exp(-u)",
        verdict="k3's gradient twin (paper's k3')",
        doc="""k3' in reward: the detached coefficient c = 1 - e^{r - l̄} of k3 as loss, on the score function.

        Gradient twin of k3_as_loss (identical per sample on-policy); expected gradient: sequence
        ∇ KL(π_ref‖π) (forward KL); token and token_to_go: local_fkl.
        """,
    ),
    KLHead(
        name="k1_as_loss",
        style="as_loss",
        coefficient_fn=unit_coefficient,
        penalty_fn=k1_penalty,
        targets={"sequence": "zero", "token_to_go": "expected_length", "token": "zero"},
        penalty_formula="l - r",
        coefficient_formula="1",
        verdict="zero expected gradient: a counterexample",
        doc="""k1 as loss: ψ = l - r, c ≡ 1. A counterexample, not a regulariser.

        Expected gradient (on-policy): sequence and token: E[∇ log π] = 0 exactly, independent of π_ref; only
        zero-mean noise. token_to_go: E[Σ_t (#tokens from t on) ∇l_t] = ∇ E_π[|y|] (pressure on response
        length, zero when every response has the same length), still independent of π_ref.
        """,
    ),
    KLHead(
        name="mse_in_reward",
        style="in_reward",
        coefficient_fn=mse_coefficient,
        targets={"sequence": "mse", "token_to_go": None, "token": "local_mse"},
        coefficient_formula="exp(l̄) - exp(r)",
        verdict="MiniMax-01 MSE head, bounded in [-1, 1]",
        doc="""MiniMax-01's MSE head in reward: c = π̄ - π_ref = e^{l̄} - e^{r} (:func:`mse_coefficient`).

        On-policy E_π[(π - π_ref) ∇ log π] = Σ_y (π - π_ref) ∇π = ∇ ½ Σ_y (π - π_ref)²: an MSE distance, not a
        KL. Expected gradient (on-policy): sequence: ∇ ½ Σ_y (π(y) - π_ref(y))² (``mse``); token: local_mse;
        token_to_go: no named divergence (reported against the reverse KL by the audit).
        """,
    ),
    KLHead(
        name="fkl_as_loss",
        style="as_loss",
        coefficient_fn=fkl_coefficient,
        penalty_fn=fkl_penalty,
        targets={"sequence": "fkl", "token_to_go": None, "token": "local_fkl"},
        penalty_formula="exp(r - l) - 1",
        coefficient_formula="-exp(-u)",
        verdict="the forward KL(ref‖π) by name (RPG's normalised forward KL); same expected gradient as k3_as_loss "
        "at sequence and token level, not at token_to_go",
        doc="""Forward KL as loss: ψ = e^{r-l} - 1 = π_ref/π - 1, so c = -δ = -π_ref/π (:func:`fkl_coefficient`).
        Expected gradient (on-policy):
          - sequence: -Σ_y π_ref ∇ log π = ∇ KL(π_ref‖π), the forward KL, as k3_as_loss: the two differ by c ≡ 1,
            whose expected score is zero (k3 = this head plus a control variate, lower variance near π_ref).
          - token: local_fkl, as k3_as_loss (same argument per step).
          - token_to_go: not a named divergence: Σ_{t'≥t} (-δ_t') has conditional mean -(tokens left), so unlike
            k3 (conditional mean 0) the summed return adds a length pressure; reported by the audit.
        Off-policy it is RPG's importance-weighted forward-KL gradient (with klgrad's IS and clip).
        """,
    ),
    KLHead(
        name="js_in_reward",
        style="in_reward",
        coefficient_fn=js_coefficient,
        targets={"sequence": "js", "token_to_go": None, "token": "local_js"},
        coefficient_formula="½ log(2 / (1 + exp(-u)))",
        verdict="exact Jensen–Shannon gradient (sequence level)",
        doc="""Jensen–Shannon in reward: c = f_JS(δ) - δ f_JS'(δ) = ½ log(2/(1 + δ)) (:func:`js_coefficient`), the
        full score-function weight of JS(π‖π_ref) = E_π[f_JS(π_ref/π)]. Expected gradient (on-policy):
        sequence: ∇ JS(π‖π_ref) exactly; token: local_js (per-step JS, prefix distribution held fixed);
        token_to_go: no named divergence (c is not additive over tokens). Bounded above by ½ log 2 where π ≫
        π_ref: a bounded pull, unlike the KL's.
        """,
    ),
    KLHead(
        name="js_as_loss",
        style="as_loss",
        coefficient_fn=partial(autograd_coefficient, js_penalty),
        penalty_fn=js_penalty,
        targets={"sequence": None, "token_to_go": None, "token": None},
        penalty_formula="f_JS(exp(r - l)), f_JS(t) = ½[t log t - (1+t) log((1+t)/2)]",
        coefficient_formula="-½ exp(-u) log(2 exp(-u) / (1 + exp(-u)))  (autograd)",
        verdict="unbiased JS value, but only the pathwise part of its gradient: not ∇JS (as k3 is not ∇KL)",
        doc="""Jensen–Shannon as loss: ψ = f_JS(δ) (:func:`js_penalty`), whose mean under π is JS(π‖π_ref); the
        coefficient is by autograd, c = ∂ψ/∂l = -δ f_JS'(δ). Differentiating the value estimate drops the
        score-function term f_JS(δ)∇l (the coefficient of js_in_reward is f_JS(δ) - δ f_JS'(δ)), so its expected
        gradient is -E_{π_ref}[f_JS'(δ)∇ log π], no named divergence at any level: the JS analogue of k3-as-loss
        missing the reverse KL. The audit reports it against ∇JS.
        """,
    ),
)

KL_HEADS: dict[str, KLHead] = {h.name: h for h in _BUILT_IN_HEADS}
"""Registry of the built-in heads, keyed by :data:`HeadName` (docs/math.md, “KL heads”)."""

_warned_k1_as_loss = False


_REGISTERED: dict[str, KLHead] = {}
"""Heads added by :func:`register_kl_head` or loaded from a ``module:name`` spec, by name."""


def register_kl_head(head: KLHead, *, replace: bool = False) -> KLHead:
    """Make ``head`` available by ``head.name`` to :func:`get_kl_head` (and so to ``kl.head`` in a config, the
    TRL and verl integrations and ``klgrad compare``) for this process: how a library ships its own heads.

    Raises:
        ValueError: the name is a built-in head's, or already registered and ``replace`` is False.
    """
    if not isinstance(head, KLHead):
        raise TypeError(f"register_kl_head takes a KLHead, got {type(head).__name__}")
    if head.name in KL_HEADS:
        raise ValueError(f"{head.name!r} is a built-in KL head; register yours under another name")
    if head.name in _REGISTERED and not replace and _REGISTERED[head.name] is not head:
        raise ValueError(f"a KL head named {head.name!r} is already registered (replace=True to overwrite)")
    _REGISTERED[head.name] = head
    return head


def load_kl_head(spec: str) -> KLHead:
    """The head at ``package.module:name``, imported with importlib (never ``eval``): a :class:`KLHead` as it is,
    or a penalty ψ(logp, ref_logp) (what ``klgrad audit --penalty`` takes) made a head by
    :func:`custom_kl_head`, named ``spec``. Loaded once per process and registered under ``spec``.

    Raises:
        ValueError: naming ``spec`` when it is malformed, its module cannot be imported, the attribute is
            missing, or it is neither a KLHead nor callable.
    """
    if spec in _REGISTERED:
        return _REGISTERED[spec]
    obj = import_object(spec, "KL head")  # a ValueError naming the spec when it is not package.module:name
    if isinstance(obj, KLHead):
        head = obj
    elif callable(obj):
        head = custom_kl_head(obj, name=spec)
    else:
        raise ValueError(f"KL head {spec!r}: a {type(obj).__name__} is neither a KLHead nor a penalty function")
    _REGISTERED[spec] = head
    return head


def get_kl_head(name: str | KLHead) -> KLHead:
    """Look up a head: a :class:`KLHead` passes through; a built-in name (:data:`KL_HEADS`), a name given to
    :func:`register_kl_head`, or ``package.module:name`` (:func:`load_kl_head`). ``k1_as_loss`` warns once per
    process."""
    global _warned_k1_as_loss
    if isinstance(name, KLHead):
        return name
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in KL_HEADS:
        if isinstance(name, str) and ":" in name:
            return load_kl_head(name)
        if isinstance(name, str) and "/" in name:
            raise ValueError(
                f"{name!r} is a framework preset id, not a KL head: klgrad.config.load_config turns it into its "
                "KL term (klgrad.audit.framework_head.resolve_head); for a Config made by hand, "
                "klgrad.config.resolve_heads(cfg)"
            )
        raise ValueError(
            f"unknown KL head {name!r}; choose one of {sorted(KL_HEADS)}, a registered head, or 'package.module:name'"
        )
    if name == "k1_as_loss" and not _warned_k1_as_loss:
        _warned_k1_as_loss = True
        warnings.warn(
            "k1_as_loss has zero expected gradient (E[∇log π] = 0): it adds noise and no regularisation. "
            "Use k2_as_loss or k1_in_reward for the reverse-KL gradient.",
            UserWarning,
            stacklevel=2,
        )
    return KL_HEADS[name]


def _elementwise_penalty(penalty_fn: PenaltyFn, name: str) -> PenaltyFn:
    """``penalty_fn`` that raises a ValueError naming the head unless it returns a tensor of its input's shape."""

    def checked(logp: Tensor, ref_logp: Tensor) -> Tensor:
        out = penalty_fn(logp, ref_logp)
        if not isinstance(out, Tensor) or out.shape != logp.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"custom KL head {name!r}: penalty_fn must return an elementwise tensor of shape "
                f"{tuple(logp.shape)}, got {got}"
            )
        return out

    return checked


def custom_kl_head(penalty_fn: Callable[[Tensor, Tensor], Tensor], name: str = "custom") -> KLHead:
    r"""A head from any differentiable elementwise penalty ψ(logp, ref_logp); style ``as_loss``.

    Its coefficient is derived by autograd (paper eq. kn′, :func:`autograd_coefficient`): c = ∂ψ/∂l evaluated
    at the detached l̄. Expected gradient on-policy: E[c ∇ log π] at the chosen level; the audit measures it.
    """
    if not callable(penalty_fn):
        raise TypeError(f"penalty_fn must be callable, got {type(penalty_fn).__name__}")
    psi = _elementwise_penalty(penalty_fn, name)
    return KLHead(
        name=name,
        style="as_loss",
        coefficient_fn=partial(autograd_coefficient, psi),
        penalty_fn=psi,
        targets={"sequence": None, "token_to_go": None, "token": None},
        coefficient_formula="∂ψ/∂l at l̄ (autograd)",
        verdict="measured by the gradient audit (`klgrad audit --penalty MODULE:FN`)",
        doc=(penalty_fn.__doc__ or "") + "\n(custom KL head; coefficient by autograd)",
    )
