r"""klgrad's objective as a verl policy loss: ``actor.policy_loss.loss_mode: klgrad`` (verl 0.9.1).

Importing this module registers, with verl's own registry (``verl.trainer.ppo.core_algos.register_policy_loss``),
the policy loss ``klgrad``: klgrad's reward head (PPO clip with ε_low/ε_high, dual clip, token or sequence ratio)
plus klgrad's *decoupled* KL head with klgrad's off-policy treatment (docs/math.md, “Off-policy: importance
sampling and the clip side”) — the head is turned into its coefficient C (recomputed from the current detached
log-probs at every PPO epoch) and applied as β·max(ρC, clip(ρ, 1-ε, 1+ε)C) with importance ratio ρ against
verl's ``old_log_prob``. verl's own KL loss
(``actor.use_kl_loss``) differentiates ``kl_penalty(log_prob, ref_log_prob)`` directly: no importance sampling,
no clipping, which is correct only on the first mini-batch of an on-policy update (the "common bug" of
docs/math.md, “Off-policy: importance sampling and the clip side”).

verl loads the module in every process through its external-module setting, read when ``verl`` is imported
(``verl/__init__.py``)::

    export VERL_USE_EXTERNAL_MODULES=klgrad.integrations.verl

(a ``verl.plugins`` entry point in klgrad's package metadata would do the same without the variable).

The klgrad settings live in the policy-loss config: :class:`KlgradPolicyLossConfig` extends verl's
``PolicyLossConfig`` and is selected with ``policy_loss._target_`` in the YAML (docs/verl.md has a full config).

Reference log-probs. verl's policy-loss signature (``PolicyLossFn``) carries no reference log-probs, so the
decoupled KL head gets them in one of two ways:

- ``ref_log_prob=`` passed directly (an extra keyword-only argument; verl's call never passes it);
- :func:`klgrad_ppo_loss`, a drop-in for verl's actor loss ``verl.workers.utils.losses.ppo_loss`` that takes
  ``ref_log_prob`` from the micro-batch, makes it visible to the ``klgrad`` policy loss for the duration of the
  call, and delegates everything else to verl's ``ppo_loss``. Install it with verl's worker method
  ``actor_rollout_wg.set_loss_fn(partial(klgrad_ppo_loss, config=actor_config))`` (docs/verl.md). verl computes
  reference log-probs only when ``use_kl_loss`` or ``use_kl_in_reward`` is on: set ``use_kl_loss: true`` with
  ``kl_loss_coef: 0`` so that verl's own, uncorrected KL term adds nothing (it is still logged as ``kl_loss``).

With the KL head off (``kl_head: none`` or ``kl_beta: 0``) the loss needs no reference log-probs and runs in
stock verl. The *combined* form (docs/math.md, “How a head joins the reward: form”) with the k1 head is verl's
own ``algorithm.use_kl_in_reward`` with ``kl_penalty: k1``: the coefficient joins the token rewards before the
advantage estimator, and IS and clipping come with the reward head; it needs nothing from klgrad.

Differences from verl's ``vanilla`` loss, on purpose: importance log-ratios are capped at ``max_log_ratio`` in
value only (verl clamps at ±20, which zeroes the gradient there); ``rollout_is_weights`` (w ≥ 0, detached)
multiply the reward head's per-token loss exactly as in ``vanilla`` (done as A·w, identical for w ≥ 0) and do
not touch the KL head, whose ratio is taken against ``old_log_prob``.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError
from torch import Tensor
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.workers.config import PolicyLossConfig

from klgrad.config import AlgoConfig, KLConfig
from klgrad.kl import MAX_LOG_RATIO
from klgrad.objective import ObjectiveSpec, objective_diagnostics, policy_objective

LOSS_MODE = "klgrad"
"""Name under which the policy loss is registered (``actor.policy_loss.loss_mode``)."""

AGGREGATIONS = {
    "token-mean": "token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-mean": "seq_mean_token_mean",
}
"""verl ``loss_agg_mode`` -> klgrad aggregation. verl's token-sum and seq-mean-token-sum-norm have no klgrad twin."""

_REF_LOG_PROB: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar("klgrad_ref_log_prob", default=None)


@dataclasses.dataclass
class KlgradPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus klgrad's KL-head settings (``policy_loss._target_`` selects it).

    The reward head's clip comes from verl's actor config: ``clip_ratio_low`` / ``clip_ratio_high`` (ε_low, ε_high)
    and ``clip_ratio_c`` (dual clip). Aggregation follows ``actor.loss_agg_mode``.
    """

    loss_mode: str = LOSS_MODE
    """Registered policy loss; ``klgrad`` selects :func:`compute_policy_loss_klgrad`."""
    kl_head: str = "k2_as_loss"
    """KL head name (klgrad.KL_HEADS): k2_as_loss, k1_in_reward, k3_as_loss, k3_in_reward, mse_in_reward, ..."""
    kl_beta: float = 0.0
    """KL weight β (≥ 0), outside any normalisation. 0 turns the KL head off."""
    kl_level: str = "sequence"
    """Where the head acts: sequence | token_to_go | token (docs/math.md, “Where a head acts: level”)."""
    kl_clip_eps: Any = 0.2
    """Symmetric clip ε of the KL head off-policy, on the PPO-consistent side (docs/math.md, “Off-policy:
    importance sampling and the clip side”); null: IS without clipping."""
    kl_ratio_level: str = "sequence"
    """KL head importance ratio per token or per sequence (sequence: unbiased)."""
    kl_is_correction: bool = True
    """False reproduces the common bug (as-loss head differentiated off-policy without IS); comparisons only."""
    ratio_level: str = "token"
    """Reward head ratio: token (PPO/GRPO), sequence (unnormalised exp(Σ_t Δ_t), the exact IS weight) or gspo
    (GSPO's length-normalised exp(mean_t Δ_t), with GSPO's small clip_ratio_low/high)."""
    dual_clip: bool = True
    """Apply verl's ``clip_ratio_c`` dual clip to negative advantages, as verl's ``vanilla`` does."""
    max_log_ratio: float = MAX_LOG_RATIO
    """Cap of importance log-ratios in value only (overflow guard; gradients pass unchanged)."""


_DEFAULTS = KlgradPolicyLossConfig()
_ABSENT = object()


def _setting(policy_loss: Any, name: str) -> Any:
    """A klgrad setting from verl's policy-loss config (dataclass or DictConfig), else klgrad's default.

    An absent key takes the default; an explicit null is kept only for ``kl_clip_eps`` (null = no KL clip).
    """
    value = _ABSENT
    if policy_loss is not None:
        value = policy_loss.get(name, _ABSENT) if hasattr(policy_loss, "get") else getattr(policy_loss, name, _ABSENT)
    if value is _ABSENT or (value is None and name != "kl_clip_eps"):
        return getattr(_DEFAULTS, name)
    return value


def spec_from_verl(config: Any, loss_agg_mode: str) -> ObjectiveSpec:
    """The klgrad :class:`~klgrad.objective.ObjectiveSpec` a verl actor config describes (decoupled form)."""
    if loss_agg_mode not in AGGREGATIONS:
        raise ValueError(
            f"actor.loss_agg_mode {loss_agg_mode!r} has no klgrad aggregation; with loss_mode 'klgrad' use one of "
            f"{sorted(AGGREGATIONS)}"
        )
    pl = config.get("policy_loss", None)
    clip = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    kl_clip_eps = _setting(pl, "kl_clip_eps")
    try:  # verl names klgrad's KL options kl_<field>
        kl = KLConfig(
            head=_setting(pl, "kl_head"),
            beta=float(_setting(pl, "kl_beta")),
            level=_setting(pl, "kl_level"),
            form="decoupled",
            clip_eps=None if kl_clip_eps is None else float(kl_clip_eps),
            ratio_level=_setting(pl, "kl_ratio_level"),
            is_correction=bool(_setting(pl, "kl_is_correction")),
        )
    except ValidationError as e:
        fields = sorted({f"kl_{err['loc'][0]}" for err in e.errors() if err["loc"]})
        raise ValueError(f"actor.policy_loss (loss_mode 'klgrad') {', '.join(fields)}: {e}") from e
    pg = AlgoConfig(
        clip_eps_low=float(clip if low is None else low),
        clip_eps_high=float(clip if high is None else high),
        dual_clip=float(config.get("clip_ratio_c", 3.0)) if _setting(pl, "dual_clip") else None,
        ratio_level=_setting(pl, "ratio_level"),
        aggregation=AGGREGATIONS[loss_agg_mode],
    )
    return ObjectiveSpec(kl, pg, max_log_ratio=float(_setting(pl, "max_log_ratio")))


def _normalisers(config: Any) -> dict[str, float | None]:
    """klgrad's global normalisers from verl's ``global_batch_info`` (set by verl's actor loss per micro-batch).

    verl multiplies a loss normalised by the global batch by ``dp_size`` (data-parallel gradients are averaged);
    dividing the global count by ``dp_size`` does the same in klgrad's ``aggregate``.
    """
    info = dict(config.get("global_batch_info", None) or {})
    dp = float(info.get("dp_size", 1) or 1)
    tokens, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    return {
        "num_tokens": None if tokens is None else float(tokens) / dp,
        "num_sequences": None if seqs is None else float(seqs) / dp,
    }


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_klgrad(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
    *,
    ref_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    r"""klgrad's policy objective with verl's ``PolicyLossFn`` signature: reward head + β·decoupled KL head.

    Args:
        old_log_prob: (B, T) behaviour log-probs o (verl's π_old, recomputed by the trainer).
        log_prob: (B, T) current log-probs l, carrying gradient.
        advantages: (B, T) advantages from verl's estimator (A = shape(R)).
        response_mask: (B, T) True = response token.
        loss_agg_mode: verl's aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean.
        config: verl's ``ActorConfig`` (its ``policy_loss`` a :class:`KlgradPolicyLossConfig` or a mapping with
            the same keys); ``global_batch_info`` supplies the global normalisers.
        rollout_is_weights: (B, T) optional rollout-correction weights w ≥ 0 for the reward head.
        ref_log_prob: (B, T) reference log-probs r; default: those :func:`klgrad_ppo_loss` made visible. Needed
            only when the KL head is on.

    Returns:
        (loss, metrics): loss = agg(reward head) + β·agg(KL head) (:func:`klgrad.objective.policy_objective`),
        metrics floats under ``actor/`` (verl's names where they mean the same) and ``klgrad/``.
    """
    if config is None:
        raise ValueError("policy loss 'klgrad' needs verl's actor config")
    spec = spec_from_verl(config, loss_agg_mode)
    mask = response_mask.bool()  # (B, T)
    kl_on = spec.head.style != "none" and spec.kl.beta > 0
    ref = ref_log_prob if ref_log_prob is not None else _REF_LOG_PROB.get()
    if ref is None:
        if kl_on:
            raise ValueError(
                "policy loss 'klgrad' with a KL head needs reference log-probs, which verl's policy-loss call does "
                "not pass: install klgrad.integrations.verl.klgrad_ppo_loss as the actor loss and set "
                "actor.use_kl_loss=true, actor.kl_loss_coef=0 (see docs/verl.md)"
            )
        ref = log_prob.detach()  # unused: the KL head is off
    adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights.detach()  # (B, T)
    terms = policy_objective(log_prob, ref, mask, adv, spec, old_logp=old_log_prob, **_normalisers(config))
    diag = objective_diagnostics(log_prob, ref, mask, adv, spec, old_logp=old_log_prob)
    metrics = {
        "actor/pg_clipfrac": diag["clip_frac"],
        "actor/pg_clipfrac_lower": diag["dual_clip_frac"],
        "klgrad/policy_loss": float(terms.policy_loss),
        "klgrad/kl_loss": float(terms.kl_loss),
        "klgrad/kl_clip_frac": diag["kl_clip_frac"],
        "klgrad/ratio_mean": diag["ratio_mean"],
        "klgrad/ratio_max": diag["ratio_max"],
    }
    if kl_on or ref_log_prob is not None or _REF_LOG_PROB.get() is not None:
        metrics.update({f"klgrad/{k}": diag[k] for k in ("kl_k1", "kl_k2", "kl_k3", "logp_gap", "logp_gap_abs")})
    return terms.loss, metrics


@contextmanager
def reference_log_probs(ref_log_prob: Tensor | None) -> Iterator[None]:
    """Make ``ref_log_prob`` (B, T) visible to the ``klgrad`` policy loss inside the ``with`` block."""
    token = _REF_LOG_PROB.set(ref_log_prob)
    try:
        yield
    finally:
        _REF_LOG_PROB.reset(token)


def klgrad_ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> tuple[Tensor, dict]:
    """verl's actor loss (``verl.workers.utils.losses.ppo_loss``) with reference log-probs for the KL head.

    Same signature and result as verl's ``ppo_loss``, which it calls; the only addition is that the
    micro-batch's ``ref_log_prob``, padded as verl pads its other fields, is visible to the ``klgrad`` policy
    loss during the call. Install per actor worker: ``set_loss_fn(partial(klgrad_ppo_loss, config=actor_config))``.
    """
    from verl.workers.utils.losses import ppo_loss  # verl's worker stack; imported on use

    ref = None
    if "ref_log_prob" in data.keys():
        ref = data.select("response_mask", "ref_log_prob").to_padded_tensor()["ref_log_prob"]
    with reference_log_probs(ref):
        return ppo_loss(config, model_output, data, dp_group)


__all__ = [
    "AGGREGATIONS",
    "LOSS_MODE",
    "KlgradPolicyLossConfig",
    "compute_policy_loss_klgrad",
    "klgrad_ppo_loss",
    "reference_log_probs",
    "spec_from_verl",
]
