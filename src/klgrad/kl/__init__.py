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
  - ``js``: ∇ JS(π‖π_ref) = ∇ ½[KL(π‖m) + KL(π_ref‖m)], m = (π + π_ref)/2 (Jensen–Shannon).
  - ``local_rkl`` / ``local_fkl`` / ``local_mse`` / ``local_js``: Σ_t E_{y<t ~ π̄}[∇ D(π(·|y<t), π_ref(·|y<t))],
    the per-step divergence gradient with the prefix distribution held fixed (the effect of today's token on the
    distribution of future prefixes is dropped). This is what token-level heads optimise.
  - ``expected_length``: ∇ E_π[|y|] (k1-as-loss at token_to_go: c ≡ 1 summed over the remaining tokens).
  - ``zero``: no gradient in expectation.

Numerics. Heads compute in float32 or better: bfloat16 and float16 log-probs are promoted to float32 before
the log-ratio is taken (so u = l − r of two half-precision log-probs is exact, or within one float32 rounding),
and the gradient of a half-precision ``logp`` is the float32 one rounded once to its dtype. The non-polynomial
pieces (k3, forward KL, MSE, JS) use :func:`exp_linear_tail` / ``expm1`` / ``log1p`` forms, exact for arguments
≤ ``EXP_CAP`` = 20 and without cancellation near u = 0, continuing linearly (value and gradient finite and of
the right sign) above the cap; a penalty's derivative is its closed form
(:func:`~klgrad.kl.numerics.closed_form_slope`), not autograd through the value's operations, so every head's
coefficient and gradient is within a few units of roundoff of the dtype over |u| ≤ 30 (tests/kl/test_precision.py
derives the bounds). So every head is exact
for |log-ratio| ≤ 20 and finite for every input it sees with |l|, |r| ≤ 1e18 (float32); at ``sequence`` level a
head sees the sums Σ_t l_t and Σ_t r_t, so the bound is on the sums. No clamp ever zeroes a gradient.

Modules: :mod:`~klgrad.kl.numerics` (float promotion, capped exponentials), :mod:`~klgrad.kl.estimators` (k1, k2,
k3 values), :mod:`~klgrad.kl.heads` (the head registry: pure functions and :class:`KLHead` records),
:mod:`~klgrad.kl.levels` (coefficients at a level), :mod:`~klgrad.kl.offpolicy` (importance ratios, the clipped
surrogate) and :mod:`~klgrad.kl.loss` (:func:`kl_loss`, :func:`adaptive_beta`). Everything is importable from
``klgrad.kl``.
"""

from klgrad.choices import LEVELS, RATIO_LEVELS, REWARD_RATIO_LEVELS, HeadName, Level, RatioLevel, RewardRatioLevel
from klgrad.kl.analytic import ANALYTIC_KL, analytic_kl_per_sequence, next_token_kl  # registers analytic_kl
from klgrad.kl.estimators import (
    ESTIMATORS,
    EstimatorKind,
    kl_estimate,
    sequence_kl_estimates,
    sequence_log_ratio,
)
from klgrad.kl.heads import (
    KL_HEADS,
    CoefficientFn,
    HeadStyle,
    KLHead,
    PenaltyFn,
    Target,
    autograd_coefficient,
    custom_kl_head,
    get_kl_head,
    k1_penalty,
    k2_penalty,
    k3_coefficient,
    k3_penalty,
    load_kl_head,
    log_ratio_coefficient,
    mse_coefficient,
    register_kl_head,
    unit_coefficient,
    zero_coefficient,
)
from klgrad.kl.levels import level_coefficients, masked_sum, reverse_cumsum
from klgrad.kl.loss import adaptive_beta, kl_loss, kl_loss_per_sequence
from klgrad.kl.numerics import EXP_CAP, MAX_LOG_RATIO, exp_linear_tail, expm1_linear_tail
from klgrad.kl.offpolicy import clipped_surrogate_penalty, gspo_ratio, importance_ratio, per_decision_ratio

__all__ = [
    "ANALYTIC_KL",
    "ESTIMATORS",
    "EXP_CAP",
    "KL_HEADS",
    "LEVELS",
    "MAX_LOG_RATIO",
    "RATIO_LEVELS",
    "REWARD_RATIO_LEVELS",
    "CoefficientFn",
    "EstimatorKind",
    "HeadName",
    "HeadStyle",
    "KLHead",
    "Level",
    "PenaltyFn",
    "RatioLevel",
    "RewardRatioLevel",
    "Target",
    "adaptive_beta",
    "analytic_kl_per_sequence",
    "autograd_coefficient",
    "clipped_surrogate_penalty",
    "custom_kl_head",
    "exp_linear_tail",
    "expm1_linear_tail",
    "get_kl_head",
    "gspo_ratio",
    "importance_ratio",
    "k1_penalty",
    "k2_penalty",
    "k3_coefficient",
    "k3_penalty",
    "kl_estimate",
    "kl_loss",
    "kl_loss_per_sequence",
    "level_coefficients",
    "load_kl_head",
    "log_ratio_coefficient",
    "masked_sum",
    "mse_coefficient",
    "next_token_kl",
    "per_decision_ratio",
    "register_kl_head",
    "reverse_cumsum",
    "sequence_kl_estimates",
    "sequence_log_ratio",
    "unit_coefficient",
    "zero_coefficient",
]
