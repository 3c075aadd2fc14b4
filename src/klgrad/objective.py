r"""The policy objective: reward head + KL head, combined or decoupled. No model code.

The math: docs/math.md, “How a head joins the reward: form” and “Off-policy: importance sampling and the clip
side”.

Reward head (PPO clip, to minimise), per token with ratio ρ_t and advantage A_t:
    ℓ_t = max(-A_t ρ_t, -A_t clip(ρ_t, 1-ε_low, 1+ε_high)),  and with dual clip c > 1, for A_t < 0:
    ℓ_t = min(ℓ_t, -c A_t).
KL head:
  - combined: the coefficient joins the reward *before* shaping, A = shape(R - β·C) (levels ``sequence``
    and ``token_to_go``); there is no separate KL loss. IS and clipping are inherited from the reward head.
  - decoupled: A = shape(R) drives the reward head; the KL head is :func:`klgrad.kl.kl_loss_per_sequence`
    with β outside, never normalised, with a symmetric clip. All levels.
Aggregation (a separate, named step) of per-token terms ℓ (B, T) with mask m:
  - ``seq_mean_token_sum``: (1/B) Σ_i Σ_t m ℓ (the paper's sequence view; default);
  - ``token_mean``: Σ_i Σ_t m ℓ / Σ_i Σ_t m;
  - ``seq_mean_token_mean``: (1/B) Σ_i (Σ_t m ℓ / Σ_t m).
The global normalisers B and Σm are passed in by the trainer, so gradients accumulated over micro-batches
equal the full-batch gradient exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klgrad.advantages import leave_one_out_scale, shape_rewards
from klgrad.choices import AGGREGATIONS, Aggregation, Level, ResolvedHead, RewardRatioLevel
from klgrad.config import AlgoConfig, KLConfig, KLHeadOptions
from klgrad.kl import (
    MAX_LOG_RATIO,
    KLHead,
    analytic_kl_per_sequence,
    get_kl_head,
    importance_ratio,
    kl_loss_per_sequence,
    level_coefficients,
    masked_sum,
    sequence_kl_estimates,
    sequence_log_ratio,
)

if TYPE_CHECKING:
    from klgrad.config import Config


KLTerm = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]
"""``term(logp, ref_logp, mask, old_logp) -> (B,)``: a decoupled KL term's per-sequence token totals Σ_t (β not
included; ``old_logp`` None on-policy), in place of a head's :func:`klgrad.kl.kl_loss_per_sequence`."""


@dataclass(frozen=True, eq=False, repr=False)
class KLTermHead(ResolvedHead):
    """``kl.head`` given as its decoupled KL term: what config load turns a framework preset id into
    (:mod:`klgrad.audit.framework_head`). The term's own rule reads the log-probs (its ratio, clamps, clip and entry
    point), so ``kl.level``, ``kl.clip_eps``, ``kl.ratio_level`` and ``kl.is_correction`` do not apply; it is
    reduced by the KL aggregation. Equal to another of the same name (two loads of one config are equal)."""

    name: str
    """What the config records (``kl.head`` in config.yaml): the preset id."""
    term: Callable[[float | None], KLTerm]
    """``term(baseline)``: the :data:`KLTerm`, given the batch's baseline b when :attr:`baseline_sums` is set."""
    baseline_sums: Callable[[Tensor, Tensor, Tensor], tuple[float, float]] | None = None
    """``(behaviour_logp, ref_logp, mask) -> (Σ, count)`` over rows (B, T): b = Σ / count over the whole step's
    batch (every rank), from the behaviour log-probs; None: the term takes no baseline."""
    note: str = ""
    """What resolving it set and overrode (``klgrad train`` prints it)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KLTermHead) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"KLTermHead({self.name!r})"


@dataclass(frozen=True)
class ObjectiveSpec:
    """What the loss is made of (docs/math.md): a run config's own records, unchanged and checked when made.

    ``kl`` is the ``kl`` section (head, level, form, off-policy correction and β; an adaptive β is a replaced
    record) and ``pg`` the ``algo`` section (reward-head clip, ratio level, aggregation, entropy bonus)."""

    kl: KLConfig = field(default_factory=lambda: KLConfig(head="none", beta=0.0))
    """The KL term and its weight β (:class:`klgrad.config.KLConfig`; default: none)."""
    pg: AlgoConfig = field(default_factory=AlgoConfig)
    """The policy-gradient options (:class:`klgrad.config.AlgoConfig`)."""
    max_log_ratio: float = MAX_LOG_RATIO
    """Cap of importance log-ratios in value (overflow guard; gradients pass unchanged)."""
    kl_baseline: float | None = None
    """The batch baseline of a :class:`KLTermHead` that takes one (its :attr:`~KLTermHead.baseline_sums`)."""

    def __post_init__(self) -> None:
        if not self.max_log_ratio > 0:
            raise ValueError(f"max_log_ratio must be > 0, got {self.max_log_ratio}")

    @property
    def head(self) -> KLHead:
        return get_kl_head(self.kl.head)

    @property
    def term_head(self) -> KLTermHead | None:
        """``kl.head`` when it is given as its term (:class:`KLTermHead`), else None."""
        return self.kl.head if isinstance(self.kl.head, KLTermHead) else None

    @property
    def kl_active(self) -> bool:
        """Whether the loss has a separate KL term: decoupled, β > 0, and a term head or a head other than
        ``none``."""
        decoupled = self.kl.form == "decoupled" and self.kl.beta > 0
        return decoupled and (self.term_head is not None or self.head.style != "none")

    @property
    def kl_aggregation(self) -> Aggregation:
        """The KL term's aggregation: ``kl.aggregation``, else ``algo.aggregation``."""
        return self.kl.aggregation or self.pg.aggregation

    @classmethod
    def from_config(cls, cfg: Config) -> ObjectiveSpec:
        """The loss a run's config describes: its ``kl`` and ``algo`` sections, as they are."""
        return cls(cfg.kl, cfg.algo)


@dataclass
class ObjectiveTerms:
    """The scalar to minimise and its parts (parts detached, for logging)."""

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    entropy: Tensor = field(default_factory=lambda: torch.zeros(()))


# ----------------------------------------------------------------------------------------------------------
# aggregation


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation = "seq_mean_token_sum",
    *,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
) -> Tensor:
    """Aggregate per-token terms (B, T) -> scalar (module docstring). Masked entries never matter.

    ``num_sequences`` / ``num_tokens`` are the global normalisers (default: this batch's own).
    """
    mask = mask.bool()
    totals = masked_sum(per_token, mask)  # (B,)
    return aggregate_totals(totals, mask, mode, num_sequences=num_sequences, num_tokens=num_tokens)


def aggregate_totals(
    totals: Tensor,
    mask: Tensor,
    mode: Aggregation = "seq_mean_token_sum",
    *,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
) -> Tensor:
    """Aggregate per-sequence token sums (B,) -> scalar, consistently with :func:`aggregate`."""
    mask = mask.bool()
    b = totals.shape[0] if num_sequences is None else num_sequences
    if mode == "seq_mean_token_sum":
        return totals.sum() / max(b, 1)
    if mode == "token_mean":
        n = mask.sum() if num_tokens is None else num_tokens
        return totals.sum() / max(float(n), 1.0)
    if mode == "seq_mean_token_mean":
        return (totals / mask.sum(-1).clamp(min=1)).sum() / max(b, 1)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


# ----------------------------------------------------------------------------------------------------------
# advantages: decoupled and combined


def decoupled_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    method: str,
    std_min: float | None = None,
    std_max: float | None = None,
) -> Tensor:
    """A = shape(R), broadcast to every response token: (B,) -> (B, T)."""
    adv = shape_rewards(rewards, group_size, method, std_min, std_max)  # (B,)
    return torch.where(mask.bool(), adv[:, None], 0.0)  # (B, T)


def combined_advantages(
    rewards: Tensor,
    head: KLHead | str,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    beta: float,
    level: Level,
    group_size: int,
    method: str,
    std_min: float | None = None,
    std_max: float | None = None,
) -> Tensor:
    r"""Combined form: A = shape(R - β·C), shapes rewards (B,), log-probs (B, T) -> (B, T).

    ``sequence``: x_i = R_i - β c(U_i), shaped, on every token. ``token_to_go``: the per-token return
    x_{i,t} = R_i - β Σ_{t'≥t} c(u_t') written as

        A_{i,t} = shape(x)_i + s_{-i} · β · Σ_{t'<t} c_t',   x_i = R_i - β Σ_t c_t   (B, T),

    so A_{i,1} = shape(x)_i, the advantage of the summed per-token coefficients, and the prefix term removes the
    KL already paid before t. s_{-i} (:func:`klgrad.advantages.leave_one_out_scale`) is the shaping's
    normalisation computed *without* sample i (1 for baseline-only shaping): independent of y_i, so the prefix
    term has zero expected gradient and the expected gradient is shape(x)_i's. That equals the sequence level's
    only when Σ_t c(u_t) = c(Σ_t u_t), i.e. for linear coefficients (k1_in_reward, k2_as_loss); for k3 the two
    levels' expected gradients differ (0.09–0.34 relative in exact enumeration). A scale using sample i's own total
    (the full group std) would not: its prefix term is correlated with y_t.. and biases the gradient. s_{-i} = 0
    (prefix term dropped, shape(x)_i on every token) where the leave-one-out std is undefined
    (G = 2 with group normalisation) or 0. The variance is not guaranteed lower than the sequence level's under
    a normalising shaper. ``logp`` is the *current* detached policy: recompute every epoch.
    """
    KLHeadOptions(form="combined", level=level)  # the record's rule: a ValueError naming level for "token"
    head = get_kl_head(head)
    mask = mask.bool()
    coef = level_coefficients(head, logp, ref_logp, mask, level)  # (B, T), zero at padding
    rewards = rewards.to(coef.dtype)
    if level == "sequence":
        seq_coef = head.coefficient(
            torch.where(mask, logp.detach(), 0.0).sum(-1), torch.where(mask, ref_logp.detach(), 0.0).sum(-1)
        )  # (B,)
        adv = shape_rewards(rewards - beta * seq_coef, group_size, method, std_min, std_max)  # (B,)
        return torch.where(mask, adv[:, None].to(coef.dtype), 0.0)  # (B, T)
    first = mask.long().argmax(-1)  # (B,) first response token (left padding allowed)
    total_coef = coef.gather(-1, first[:, None]).squeeze(-1)  # (B,) = Σ_t c_t
    totals = rewards - beta * total_coef  # (B,)
    adv_total = shape_rewards(totals, group_size, method, std_min, std_max).to(coef.dtype)  # (B,)
    scale = leave_one_out_scale(totals, group_size, method, std_min, std_max)  # (B,)
    prefix_kl = total_coef[:, None] - coef  # (B, T) = Σ_{t'<t} c_t'
    adv = adv_total[:, None] + scale[:, None] * beta * prefix_kl  # (B, T)
    return torch.where(mask, adv, 0.0)


# ----------------------------------------------------------------------------------------------------------
# the loss


def policy_gradient_loss(
    logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: RewardRatioLevel = "token",
    max_log_ratio: float = MAX_LOG_RATIO,
) -> Tensor:
    """Per-token clipped policy-gradient loss (B, T) -> (B, T) (module docstring); 0 at padding.

    On-policy (``old_logp=None``) ρ = 1 in value and the gradient is -A ∇l.
    """
    mask = mask.bool()
    behaviour = logp.detach() if old_logp is None else old_logp
    ratio = importance_ratio(logp, behaviour, mask, ratio_level, max_log_ratio)  # (B, T)
    adv = torch.where(mask, adv, 0.0).to(ratio.dtype)  # (B, T)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return torch.where(mask, loss, 0.0)


def policy_objective(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    adv: Tensor,
    spec: ObjectiveSpec,
    *,
    old_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
    mismatch_weights: Tensor | None = None,
    next_token_kl: Tensor | None = None,
) -> ObjectiveTerms:
    r"""loss = agg(w ⊙ reward head) + β·agg'(KL head, decoupled only) - entropy_coef·agg(entropy).

    agg is ``algo.aggregation``, agg' the KL term's (``kl.aggregation``, default agg). The KL term is a
    :class:`KLTermHead`'s own (a framework preset's) at ``spec.kl_baseline``, else the head's
    :func:`klgrad.kl.kl_loss_per_sequence`.

    Args:
        logp, ref_logp, mask: (B, T); ``logp`` carries gradient.
        adv: (B, T) advantages: :func:`decoupled_advantages` or :func:`combined_advantages` to match
            ``spec.kl.form``.
        old_logp: (B, T) behaviour log-probs, None when on-policy.
        entropy: (B, T) per-token entropy carrying gradient (needed when ``spec.pg.entropy_coef > 0``).
        num_sequences, num_tokens: global normalisers for micro-batching (default: this batch's).
        mismatch_weights: (B, T) detached per-token weights w multiplying the reward head's per-token loss
            terms: the truncated importance weights of :func:`klgrad.rollout.mismatch.mismatch_weights` that
            correct for a rollout engine whose log-probs differ from the trainer's (TIS). The KL head is not
            reweighted (as in verl's TIS). None (default) = all ones: results unchanged.
        next_token_kl: (B, T) KL_t carrying gradient, for a head that reads next-token distributions
            (``analytic_kl``: :func:`klgrad.kl.analytic.analytic_kl_per_sequence`); needed by that head only.
    """
    mask = mask.bool()
    agg = dict(mode=spec.pg.aggregation, num_sequences=num_sequences, num_tokens=num_tokens)
    pg_per_token = policy_gradient_loss(
        logp,
        adv,
        mask,
        old_logp=old_logp,
        clip_eps_low=spec.pg.clip_eps_low,
        clip_eps_high=spec.pg.clip_eps_high,
        dual_clip=spec.pg.dual_clip,
        ratio_level=spec.pg.ratio_level,
        max_log_ratio=spec.max_log_ratio,
    )  # (B, T)
    if mismatch_weights is not None:
        if mismatch_weights.shape != pg_per_token.shape:
            raise ValueError(
                f"mismatch_weights must have the shape of logp {tuple(pg_per_token.shape)}, "
                f"got {tuple(mismatch_weights.shape)}"
            )
        w = torch.where(mask, mismatch_weights.detach().to(pg_per_token.dtype), 0.0)  # (B, T) padding never matters
        pg_per_token = pg_per_token * w
    pg = aggregate(pg_per_token, mask, **agg)
    kl = torch.zeros((), dtype=pg.dtype)
    kl_agg = {**agg, "mode": spec.kl_aggregation}
    if spec.kl_active and spec.term_head is not None:
        kl = aggregate_totals(spec.term_head.term(spec.kl_baseline)(logp, ref_logp, mask, old_logp), mask, **kl_agg)
    elif spec.kl_active and spec.head.style == "analytic":
        if next_token_kl is None:
            raise ValueError(f"kl.head {spec.head.name} needs next_token_kl (klgrad.logprobs.logprobs_and_next_kl)")
        kl_totals = analytic_kl_per_sequence(
            next_token_kl,
            logp,
            mask,
            old_logp=old_logp if spec.kl.is_correction else None,
            level=spec.kl.level,
            clip_eps=spec.kl.clip_eps,
            max_log_ratio=spec.max_log_ratio,
        )  # (B,)
        kl = aggregate_totals(kl_totals, mask, **kl_agg)
    elif spec.kl_active:
        kl_totals = kl_loss_per_sequence(
            spec.head,
            logp,
            ref_logp,
            mask,
            old_logp=old_logp,
            level=spec.kl.level,
            clip_eps=spec.kl.clip_eps,
            ratio_level=spec.kl.ratio_level,
            is_correction=spec.kl.is_correction,
            max_log_ratio=spec.max_log_ratio,
        )  # (B,)
        kl = aggregate_totals(kl_totals, mask, **kl_agg)
    ent = torch.zeros((), dtype=pg.dtype)
    if spec.pg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy tensor")
        ent = aggregate(entropy, mask, **agg)
    loss = pg + spec.kl.beta * kl - spec.pg.entropy_coef * ent
    return ObjectiveTerms(loss=loss, policy_loss=pg.detach(), kl_loss=kl.detach(), entropy=ent.detach())


@torch.no_grad()
def objective_diagnostics(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    adv: Tensor,
    spec: ObjectiveSpec,
    *,
    old_logp: Tensor | None = None,
) -> dict[str, float]:
    """Floats for logging (no grad): ratio stats, clip fractions, sequence-KL estimates, log-prob gaps.

    Clip fractions count response tokens whose gradient a clip removed: ``clip_frac`` (reward head) where
    A > 0 and ρ > 1+ε_high or A < 0 and ρ < 1-ε_low; ``dual_clip_frac`` where A < 0 and ρ > dual_clip;
    ``kl_clip_frac`` (decoupled KL head, off-policy, corrected, β > 0) where C > 0 and ρ < 1-ε or C < 0 and
    ρ > 1+ε. Sequence KL estimates use the per-token log-ratio summed (no cancellation), in the input's
    precision (float32 or better).
    """
    mask = mask.bool()
    n_tok = mask.sum().clamp(min=1)
    f = lambda x: x.detach().float() if x.dtype in (torch.float16, torch.bfloat16) else x.detach()  # noqa: E731
    l, r = f(logp), f(ref_logp)  # (B, T) float32 or float64, never lowered
    u = torch.where(mask, l - r, 0.0)  # (B, T) per-token log-ratio
    estimates = sequence_kl_estimates(sequence_log_ratio(l, r, mask))  # (B,) each
    out: dict[str, float] = {f"kl_{kind}": float(value.mean()) for kind, value in estimates.items()}
    out["logp_gap"] = float(u.sum() / n_tok)
    out["logp_gap_abs"] = float(u.abs().sum() / n_tok)
    if old_logp is None:
        out.update(ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0, clip_frac=0.0, dual_clip_frac=0.0, kl_clip_frac=0.0)
        return out
    o = f(old_logp)
    ratio = importance_ratio(l, o, mask, spec.pg.ratio_level, spec.max_log_ratio)  # (B, T)
    valid = ratio[mask]
    if valid.numel() == 0:  # no response token at all: nothing to measure
        valid = torch.ones(1, dtype=ratio.dtype)
    out["ratio_mean"] = float(valid.mean())
    out["ratio_max"] = float(valid.max())
    out["ratio_min"] = float(valid.min())
    a = torch.where(mask, adv.detach().to(ratio.dtype), 0.0)  # (B, T)
    clipped = ((a > 0) & (ratio > 1 + spec.pg.clip_eps_high)) | ((a < 0) & (ratio < 1 - spec.pg.clip_eps_low))
    out["clip_frac"] = float((clipped & mask).sum() / n_tok)
    dual = (a < 0) & (ratio > spec.pg.dual_clip) if spec.pg.dual_clip is not None else torch.zeros_like(mask)
    out["dual_clip_frac"] = float((dual & mask).sum() / n_tok)
    out["kl_clip_frac"] = 0.0
    head_active = spec.kl_active and spec.term_head is None  # a term head clips by its own rule
    if head_active and spec.kl.is_correction and spec.kl.clip_eps is not None:
        per_decision = spec.kl.ratio_level == "per_decision"  # then each term c_t has its own prefix ratio
        coef = level_coefficients(spec.head, l, r, mask, "token" if per_decision else spec.kl.level)  # (B, T)
        kl_ratio = importance_ratio(l, o, mask, spec.kl.ratio_level, spec.max_log_ratio)  # (B, T)
        eps = spec.kl.clip_eps
        kl_clipped = ((coef > 0) & (kl_ratio < 1 - eps)) | ((coef < 0) & (kl_ratio > 1 + eps))
        out["kl_clip_frac"] = float((kl_clipped & mask).sum() / n_tok)
    return out
