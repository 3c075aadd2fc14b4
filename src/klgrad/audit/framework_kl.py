r"""A framework's KL term as a record: its per-token rule, where it enters (loss or reward), how the framework
reduces per-token terms (the aggregation), the versions it holds for and the source it was read from.

Notation (docs/math.md, “Notation”): l = log π (carries gradient), o = behaviour (rollout) log-prob, r = reference,
u = l − r, ρ_t = e^{l_t − o_t}; shapes (N, T) are responses × tokens with a boolean ``mask``.

Aggregation: how a framework turns per-token terms into its loss, per response y with |y| tokens.

- ``token_sum``: Σ_t (OpenRLHF's and torchtune's sums; the audit's unit).
- ``token_mean``: Σ over the batch's tokens / the batch's token count (verl ``token-mean``, TRL ``dapo``/``bnpo``).
  The count concentrates on B·E|y|, so this is ``token_sum`` at β/E|y|: the same direction, audited as
  ``token_sum`` (a finite batch's random count adds an O(1/B) ratio-estimator bias, not audited).
- ``constant``: Σ_t / L with a fixed L (Dr. GRPO's max completion length, verl ``seq-mean-token-sum-norm``):
  ``token_sum`` at β/L exactly.
- ``seq_mean``: (1/|y|) Σ_t, then a mean over responses (GRPO's original loss, TRL ``grpo``, slime's default,
  SkyRL, torchtune). This reweights each response by 1/|y| and changes what the term differentiates to: its
  targets are the length-weighted divergences of :func:`klgrad.audit.tabular.exact_objective`
  (``rkl_per_token`` = E_π[log(π/π_ref)(y)/|y|]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from klgrad.kl import masked_sum

TokenKL = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""(l, r, o, mask) -> per-token term (N, T): what the framework adds to its per-token loss, or (reward presets)
its per-token KL penalty, at β = 1. ``mask`` is only read by rules that pool over a response (GSPO's ratio)."""

FrameworkAggregation = Literal["token_sum", "token_mean", "constant", "seq_mean"]
AGGREGATIONS: dict[str, str] = {
    "token_sum": "Σ_t over the response",
    "token_mean": "batch token mean (= token sum at β/E|y|)",
    "constant": "Σ_t / L_max, Dr. GRPO (= token sum at β/L_max)",
    "seq_mean": "per-sequence token mean (1/|y|) Σ_t",
}
SUM_FAMILY: frozenset[str] = frozenset({"token_sum", "token_mean", "constant"})
"""Aggregations that are a token sum up to a constant factor absorbed by β: audited as ``token_sum``."""

Returns = Literal["sequence", "to_go", "token"]

PPO_EPS = 0.2
"""The PPO clip ε of every KL-in-reward preset's policy loss (every framework's default)."""


# ----------------------------------------------------------------------------------------------------------
# the frameworks' per-token KL values, as written in their code


def k1_value(l: Tensor, r: Tensor) -> Tensor:
    """k1 = l − r."""
    return l - r


def k2_value(l: Tensor, r: Tensor) -> Tensor:
    """k2 = ½(l − r)²."""
    return 0.5 * (l - r) ** 2


def k3_value(l: Tensor, r: Tensor) -> Tensor:
    """k3 = e^{r − l} − (r − l) − 1, unclamped."""
    return torch.exp(r - l) - (r - l) - 1


def low_var_kl(l: Tensor, r: Tensor) -> Tensor:
    """verl/slime ``low_var_kl``: x = clamp(r − l, −20, 20); k3 = e^x − x − 1, then clamped to [−10, 10]."""
    x = (r - l).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1).clamp(-10.0, 10.0)


def straight_through(value: Tensor, gradient: Tensor) -> Tensor:
    """The value of ``value`` with the gradient of ``gradient`` (verl's "+" suffix)."""
    return gradient - gradient.detach() + value.detach()


def token_ratio(l: Tensor, o: Tensor) -> Tensor:
    """ρ_t = e^{l_t − o_t}, (N, T), differentiable through l, unclipped and uncapped as the frameworks compute it
    (klgrad's own :func:`klgrad.kl.importance_ratio` caps the log-ratio in value)."""
    return torch.exp(l - o)


def sequence_mean_ratio(l: Tensor, o: Tensor, mask: Tensor) -> Tensor:
    """GSPO's ratio e^{(1/|y|) Σ_t m_t (l_t − o_t)} broadcast to every token, (N, T), as TRL multiplies k3 by it:
    differentiable through the mean, so each token's term reaches every token of its response (klgrad's
    :func:`klgrad.kl.gspo_ratio` is the GSPO-token form, gradient s·∇l_t per token, and capped)."""
    length = mask.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
    mean = (torch.where(mask, l - o, 0.0).sum(-1, keepdim=True) / length).expand_as(l)  # (N, T)
    return torch.exp(mean)


# ----------------------------------------------------------------------------------------------------------
# the record


@dataclass(frozen=True)
class FrameworkKL:
    """One framework's KL term as its code computes it, for the versions it holds for.

    ``style="loss"``: ``token_kl`` is added to the per-token loss. ``style="reward"``: ``token_kl`` computed
    from the behaviour log-probs (no gradient) is a per-token penalty in the reward; ``returns`` turns it into
    each token's advantage and the PPO-clipped policy loss (ε = :data:`PPO_EPS`) applies it.
    """

    id: str
    """Stable key ``framework/name`` (what ``--framework`` selects by its first part and tests refer to)."""
    variant: str
    """Display label: the setting a user writes."""
    style: Literal["loss", "reward"]
    token_kl: TokenKL
    versions: str
    """PEP 440 specifier of the releases this rule holds for (``>=0.14,<1.10``), or, for code without releases,
    ``main@YYYY-MM-DD`` (its main branch on that date) or the report it is from; those hold for any version."""
    source: str
    """``owner/repo@commit (date) path``: what was read, and the lines that decide the rule."""
    aggregation: FrameworkAggregation
    """The framework's default reduction of this term (:data:`AGGREGATIONS`)."""
    default: str | None = None
    """Versions (specifier) in which this is what the framework does when its KL is switched on with default
    flags; None when it takes a non-default flag."""
    returns: Returns = "sequence"
    """Reward presets: ``sequence`` (the response's summed KL on every token: an outcome advantage), ``to_go``
    (Σ_{t'≥t} λ^{t'−t}: GAE with a zero critic, REINFORCE++ returns) or ``token`` (each token its own penalty,
    no return)."""
    lam: float = 1.0
    """The discount λ·γ of ``to_go`` returns."""
    ratio: Literal["token", "sequence"] = "token"
    """Reward presets: the policy loss's importance ratio, per token e^{l_t − o_t} or per response
    e^{Σ_t (l_t − o_t)} (RLOO: one clipped term per response, its advantage the summed KL)."""
    clip: float | None = PPO_EPS
    """Reward presets: the PPO clip ε of the policy loss, or None for a plain importance-weighted loss."""
    batch_baseline: bool = False
    """Reward presets: subtract the batch mean of the per-token penalty (its expectation over the sampled
    tokens, the large-batch limit) before it enters the advantage."""
    reference_is_behaviour: bool = False
    """The reference is the behaviour policy π_old (RPG's ``use_iterative_ref_model``, prime-rl's inference
    policy): audited off-policy only, on the problem with π_ref := π_old (on-policy π_old = π and the term is 0)."""
    std_normalised: str = ""
    """Reward presets: where the summed KL, inside the reward, is divided by a standard deviation of that reward
    (GRPO's group std, a batch std), as text; empty when it is not. Recorded, not audited: the rows have no task
    reward, group or batch (docs/frameworks.md, “Not modelled”)."""
    coef_default: tuple[str, float] | None = None
    """(config field, default) of the KL weight this term is multiplied by, where it was read; a default of 0
    means switching the term on alone adds nothing. None: not recorded. The audit itself is at β = 1."""
    note: str = ""
    """What a user should know beyond the formula (shown in docs/frameworks.md)."""

    @property
    def framework(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def regimes(self) -> tuple[str, ...]:
        return ("off_policy",) if self.reference_is_behaviour else ("on_policy", "off_policy")

    def penalty(self, behaviour: Tensor, ref_lp: Tensor, mask: Tensor) -> Tensor:
        """Reward presets: the per-token KL penalty from the behaviour log-probs, (N, T), detached, 0 at padding."""
        return torch.where(mask, self.token_kl(behaviour, ref_lp, behaviour, mask), 0.0).detach()

    def penalty_mean(self, behaviour: Tensor, ref_lp: Tensor, mask: Tensor, weights: Tensor) -> Tensor:
        """The batch baseline b = Σ_i w_i Σ_t m_it k_it / Σ_i w_i |y_i|, a scalar: the penalty's mean over the
        sampled tokens, responses weighted by ``weights`` (N,) (the audit: each enumerated response's probability
        e^{Σ behaviour}, the exact expectation; training: ones, the batch's token mean as the framework takes it)."""
        penalty = self.penalty(behaviour, ref_lp, mask)  # (N, T)
        tokens = (weights[:, None] * mask).sum()
        return (weights[:, None] * penalty).sum() / tokens

    def loss(
        self, ref_lp: Tensor, mask: Tensor, aggregation: str, baseline: Tensor | None = None
    ) -> Callable[[Tensor, Tensor], Tensor]:
        """``per_sequence(logp (N, T), behaviour_logp (N, T)) -> (N,)`` for
        :func:`klgrad.audit.tabular.expected_gradient`, the per-token terms reduced by ``aggregation``
        (``token_sum`` for the sum family, ``seq_mean``). ``baseline``: the batch baseline b of a
        ``batch_baseline`` preset (:meth:`penalty_mean`); None: the penalty's exact mean over the sampled tokens
        (every response is enumerated, with probability e^{Σ behaviour}). The trainer
        (:mod:`klgrad.audit.framework_head`) passes its batch's token mean."""
        if aggregation not in ("token_sum", "seq_mean"):
            raise ValueError("aggregation must be token_sum or seq_mean (the sum family is audited as token_sum)")

        def reduce(per_token: Tensor) -> Tensor:
            total = masked_sum(per_token, mask)  # (N,)
            return total / mask.sum(-1).to(total.dtype) if aggregation == "seq_mean" else total

        def per_sequence(logp: Tensor, behaviour: Tensor) -> Tensor:
            if self.style == "loss":
                return reduce(self.token_kl(logp, ref_lp, behaviour, mask))
            penalty = self.penalty(behaviour, ref_lp, mask)  # (N, T)
            if self.batch_baseline:
                q = behaviour.sum(-1).exp()  # (N,) probability of each enumerated response
                b = self.penalty_mean(behaviour, ref_lp, mask, q) if baseline is None else baseline
                penalty = torch.where(mask, penalty - b, 0.0)
            if self.returns == "sequence":
                ret = penalty.sum(-1, keepdim=True).expand_as(penalty)
            elif self.returns == "to_go":
                ret = discounted_to_go(penalty, self.lam)
            else:
                ret = penalty
            if self.ratio == "sequence":  # one term per response: ret is the same on every token
                ratio = torch.exp(masked_sum(logp - behaviour, mask))  # (N,)
                ret = ret[:, 0]
            else:
                ratio = torch.exp(logp - behaviour)  # (N, T) per-token PPO ratio
            term = (
                ret * ratio
                if self.clip is None
                else torch.maximum(ret * ratio, ret * ratio.clamp(1 - self.clip, 1 + self.clip))
            )  # advantage A = −ret
            if self.ratio == "sequence":
                return term / mask.sum(-1).to(term.dtype) if aggregation == "seq_mean" else term
            return reduce(term)

        return per_sequence


def discounted_to_go(x: Tensor, lam: float) -> Tensor:
    """Σ_{t'≥t} λ^{t'−t} x_{t'} along the last dim, (N, T) -> (N, T)."""
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[..., t] + lam * running
        out[..., t] = running
    return out
