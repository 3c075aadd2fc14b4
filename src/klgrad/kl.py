r"""KL value estimators, KL heads and the KL loss.

Notation (docs/math.md, “Notation”). Per token: ``logp`` = l (trainable policy, carries gradient), its
detached copy l̄, ``ref_logp`` = r, ``old_logp`` = o (behaviour policy). Log-ratio u = l̄ - r; sequence
log-ratio U = Σ_t m_t u_t. Importance ratio ρ = exp(l - o) per token, or exp(Σ_t m_t (l_t - o_t)) per sequence (the
reward head also offers GSPO's length-normalised exp((1/|y|) Σ_t m_t (l_t - o_t)), :func:`gspo_ratio`).

A *head* is a scalar rule on (logp, ref_logp). Every head has an in-reward coefficient c(l̄, r): a detached
weight on the score function ∇l. An "as loss" head also has a differentiable penalty ψ(l, r) whose
on-policy gradient is c·∇l with c = ∂ψ/∂l at l = l̄ (paper eq. kn′). A head is a :class:`KLHead` record in the
registry :data:`KL_HEADS` naming two pure elementwise functions, c = ``coefficient_fn(l̄, r)`` and, for an as-loss
head only, ψ = ``penalty_fn(l, r)`` (e.g. :func:`k3_coefficient`, :func:`k3_penalty`); heads share functions
instead of inheriting them (k1_in_reward and k2_as_loss both use :func:`log_ratio_coefficient`).

*Level* says what a head acts on (docs/math.md, “Where a head acts: level”):
  - ``sequence``: c(U) on every response token (as loss: ψ(Σ l, Σ r)). The paper's bandit view.
  - ``token_to_go``: token t gets Σ_{t'≥t} m_t' c(u_t') (KL in the reward, summed as a return).
  - ``token``: token t gets c(u_t) alone (GRPO / TRL / verl).

Expected-gradient targets used below (all gradients of divergences are w.r.t. θ of π_θ):
  - ``rkl``: ∇ KL(π‖π_ref) over whole sequences, the quantity every RLHF KL term means to regularise.
  - ``fkl``: ∇ KL(π_ref‖π) over whole sequences (forward KL).
  - ``mse``: ∇ ½ Σ_y (π(y) - π_ref(y))².
  - ``local_rkl`` / ``local_fkl`` / ``local_mse``: Σ_t E_{y<t ~ π̄}[∇ D(π(·|y<t), π_ref(·|y<t))], the per-step
    divergence gradient with the prefix distribution held fixed (the effect of today's token on the
    distribution of future prefixes is dropped). This is what token-level heads optimise.
  - ``expected_length``: ∇ E_π[|y|] (k1-as-loss at token_to_go: c ≡ 1 summed over the remaining tokens).
  - ``zero``: no gradient in expectation.

Numerics. Heads compute in float32 or better. The only non-polynomial pieces are exponentials (k3, MSE);
they use :func:`exp_linear_tail` / ``expm1`` forms, exact for arguments ≤ ``EXP_CAP`` = 20 and without
cancellation near u = 0, continuing linearly (value and gradient finite and of the right sign) above the
cap. So every head is exact for |log-ratio| ≤ 20 and finite for every input it sees with |l|, |r| ≤ 1e18
(float32); at ``sequence`` level a head sees the sums Σ_t l_t and Σ_t r_t, so the bound is on the sums.
No clamp ever zeroes a gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import torch
from torch import Tensor

EstimatorKind = Literal["k1", "k2", "k3"]
Level = Literal["sequence", "token_to_go", "token"]
RatioLevel = Literal["token", "sequence"]
RewardRatioLevel = Literal["token", "sequence", "gspo"]
HeadStyle = Literal["in_reward", "as_loss", "none"]
Target = Literal["rkl", "fkl", "mse", "local_rkl", "local_fkl", "local_mse", "expected_length", "zero"]

LEVELS: tuple[str, ...] = get_args(Level)
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
REWARD_RATIO_LEVELS: tuple[str, ...] = get_args(RewardRatioLevel)
"""The reward head's ratio levels: the KL head's (exact IS weights) plus ``gspo`` (:func:`gspo_ratio`)."""

EXP_CAP = 20.0
"""exp(x) is exact for x ≤ EXP_CAP and linear above (see :func:`exp_linear_tail`)."""

MAX_LOG_RATIO = 20.0
"""Default cap on an importance log-ratio: ρ ≤ e^20 ≈ 4.9e8 in value; the gradient passes unchanged."""


# ----------------------------------------------------------------------------------------------------------
# numerics


def _at_least_f32(x: Tensor) -> Tensor:
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


def _straight_through_cap(x: Tensor, cap: float) -> Tensor:
    """min(x, cap) in value, identity in gradient (the gradient is never zeroed)."""
    return x - (x - cap).clamp(min=0).detach()


# ----------------------------------------------------------------------------------------------------------
# value estimators (docs/math.md, “Value estimators”)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: EstimatorKind) -> Tensor:
    r"""Elementwise KL value estimators with u = logp - ref_logp and δ = π_ref/π = e^{-u}.

    k1 = u,  k2 = ½u²,  k3 = δ - 1 + u (= e^{-u} - 1 + u).

    Shapes: any, broadcastable -> broadcast shape. Values only: these carry no statement about gradients
    (that is what heads are for). Under samples from π, E[k1] = E[k3] = KL(π‖π_ref); k2 is biased;
    k3 ≥ 0 always but its variance is χ²-like. k3 uses :func:`exp_linear_tail` (exact for u ≥ -20).
    """
    u = _at_least_f32(logp) - _at_least_f32(ref_logp)
    if kind == "k1":
        return u
    if kind == "k2":
        return 0.5 * u * u
    if kind == "k3":
        return expm1_linear_tail(-u) + u
    raise ValueError(f"kind must be one of ('k1', 'k2', 'k3'), got {kind!r}")


# ----------------------------------------------------------------------------------------------------------
# heads (docs/math.md, “KL heads”): pure coefficient functions c(l̄, r), pure penalties ψ(l, r), and one
# frozen record per head that names them. Every function is elementwise: inputs of one (any) shape, float32 or
# wider (KLHead.coefficient / KLHead.penalty promote), output of that shape.

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


def k3_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ψ = e^{r - l} - 1 + (l - r) ≥ 0; c = 1 - e^{r - l̄} (:func:`k3_coefficient`).

    e^{r - l} - 1 is :func:`expm1_linear_tail`: exact for u ≥ -20, linear (slope e^20) below.
    """
    return expm1_linear_tail(ref_logp - logp) + (logp - ref_logp)


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
        targets: per level, the expected on-policy gradient this head produces (see module docstring),
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
            return self.coefficient_fn(_at_least_f32(logp.detach()), _at_least_f32(ref_logp.detach()))

    def penalty(self, logp: Tensor, ref_logp: Tensor) -> Tensor | None:
        """Differentiable penalty ψ(l, r) for as-loss heads (gradient flows through ``logp``), else None."""
        if self.penalty_fn is None:
            return None
        return self.penalty_fn(_at_least_f32(logp), _at_least_f32(ref_logp.detach()))

    def __repr__(self) -> str:
        return f"KLHead(name={self.name!r}, style={self.style!r})"


HeadName = Literal["none", "k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward", "k1_as_loss", "mse_in_reward"]
"""The built-in heads' names, in registry (and docs table) order."""

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
)

KL_HEADS: dict[str, KLHead] = {h.name: h for h in _BUILT_IN_HEADS}
"""Registry of the built-in heads, keyed by :data:`HeadName` (docs/math.md, “KL heads”)."""

_warned_k1_as_loss = False


def get_kl_head(name: str | KLHead) -> KLHead:
    """Look up a head by name (or pass a head through). ``k1_as_loss`` warns once per process."""
    global _warned_k1_as_loss
    if isinstance(name, KLHead):
        return name
    if name not in KL_HEADS:
        raise ValueError(f"unknown KL head {name!r}; choose one of {sorted(KL_HEADS)}")
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


# ----------------------------------------------------------------------------------------------------------
# coefficients at a level, ratios, and the KL loss


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
    l = torch.where(mask, _at_least_f32(logp.detach()), 0.0)  # (B, T)
    r = torch.where(mask, _at_least_f32(ref_logp.detach()), 0.0)  # (B, T)
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
    l = torch.where(mask, _at_least_f32(logp), 0.0)  # (B, T)
    o = torch.where(mask, _at_least_f32(old_logp.detach()), 0.0)  # (B, T)
    length = mask.sum(-1, keepdim=True).clamp(min=1).to(l.dtype)  # (B, 1) |y_i|
    mean_log_ratio = _straight_through_cap((l - o).sum(-1, keepdim=True) / length, max_log_ratio)  # (B, 1)
    return torch.exp(mean_log_ratio.detach() + (l - l.detach()))  # (B, T)


def importance_ratio(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    ratio_level: RewardRatioLevel = "token",
    max_log_ratio: float = MAX_LOG_RATIO,
) -> Tensor:
    r"""Per-token importance ratio with gradient through ``logp`` of its own token only, (B, T) -> (B, T).

    token: ρ_t = exp(l_t - o_t). sequence: ρ̃_t = sg(ρ) · exp(l_t - l̄_t) with ρ = exp(Σ_t m_t (l_t - o_t)):
    value ρ (the unnormalised sequence ratio, the exact importance weight of the whole response) and gradient
    ρ ∇l_t, so Σ_t ρ̃_t C_t has gradient ρ Σ_t C_t ∇l_t (unbiased sequence-level IS for any per-token
    coefficient). gspo: GSPO's length-normalised ratio, :func:`gspo_ratio` (reward head only; not an IS
    weight). Log-ratios are capped at ``max_log_ratio`` in value only (straight-through), so ρ never overflows
    and its gradient is never zeroed.
    """
    if ratio_level == "gspo":
        return gspo_ratio(logp, old_logp, mask, max_log_ratio)
    mask = mask.bool()
    l = torch.where(mask, _at_least_f32(logp), 0.0)  # (B, T)
    o = torch.where(mask, _at_least_f32(old_logp.detach()), 0.0)  # (B, T)
    if ratio_level == "token":
        return torch.exp(_straight_through_cap(l - o, max_log_ratio))  # (B, T)
    if ratio_level == "sequence":
        seq_log_ratio = _straight_through_cap((l - o).sum(-1, keepdim=True), max_log_ratio)  # (B, 1)
        return torch.exp(seq_log_ratio.detach() + (l - l.detach()))  # (B, T)
    raise ValueError(f"ratio_level must be one of {REWARD_RATIO_LEVELS}, got {ratio_level!r}")


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
) -> Tensor:
    r"""Per-sequence KL loss (tokens summed, β not included), shapes (B, T) -> (B,). See :func:`kl_loss`."""
    head = get_kl_head(head)
    _validate(logp, ref_logp, mask, old_logp, level, ratio_level, clip_eps)
    mask = mask.bool()
    l = torch.where(mask, _at_least_f32(logp), 0.0)  # (B, T) garbage in padding never matters
    r = torch.where(mask, _at_least_f32(ref_logp.detach()), 0.0)  # (B, T)
    if head.style == "none":
        return (l * 0.0).sum(-1)  # (B,) zero, but keeps the graph

    off_policy = old_logp is not None and is_correction
    if head.style == "as_loss" and not off_policy and level != "token_to_go":
        # Differentiate the penalty directly: exact on-policy; off-policy this is the common bug.
        if level == "sequence":
            return head.penalty(l.sum(-1), r.sum(-1))  # (B,)
        return masked_sum(head.penalty(l, r), mask)  # (B,)

    behaviour = old_logp if off_policy else l.detach()
    if level == "sequence" and ratio_level == "sequence":
        # Bandit view: one coefficient, one ratio per sequence: max(ρ c, clip(ρ) c) with ρ = e^{L - O}.
        o = torch.where(mask, _at_least_f32(behaviour.detach()), 0.0)  # (B, T)
        seq_coef = head.coefficient(l.sum(-1), r.sum(-1))  # (B,)
        seq_ratio = torch.exp(_straight_through_cap((l - o).sum(-1), max_log_ratio))  # (B,)
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
) -> Tensor:
    r"""KL loss to minimise (β not included): mean over sequences of the per-sequence loss (tokens summed).

    Args:
        head: a :class:`KLHead` or its registry name.
        logp: (B, T) current policy log-probs l of the response tokens; gradient flows through it.
        ref_logp: (B, T) reference log-probs r (detached).
        mask: (B, T) bool or 0/1, True = the token counts. Masked entries never matter, even NaN.
        old_logp: (B, T) behaviour log-probs o; None means on-policy (o = l̄).
        level: ``sequence`` | ``token_to_go`` | ``token`` (module docstring).
        clip_eps: off-policy only: symmetric PPO clip of the KL head, PPO-consistent side (docs/math.md,
            “Off-policy: importance sampling and the clip side”).
        ratio_level: off-policy importance ratio per ``token`` or per ``sequence``.
        is_correction: False reproduces the common bug: the head is applied as if on-policy (as-loss
            penalties differentiated directly, coefficients without IS), for comparisons only.
        max_log_ratio: cap of the importance log-ratio in value (overflow guard; gradient unchanged).

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
    ).mean()


# ----------------------------------------------------------------------------------------------------------
# adaptive β


def adaptive_beta(beta: float, kl: float, target: float, rate: float) -> float:
    """Proportional controller (Ziegler et al.): β ← β·(1 + rate·clip(KL/target - 1, -0.2, 0.2)/0.2)."""
    err = max(-0.2, min(0.2, kl / target - 1.0))
    return beta * (1.0 + rate * err / 0.2)
