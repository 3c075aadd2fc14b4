r"""Truncated importance weights for a rollout engine whose log-probs differ from the trainer's.

Any sampler other than klgrad's own (vLLM, with its kernels and bf16/fp8 arithmetic) gives log-probs ``s``
that differ from the trainer's ``l̄`` for the same tokens and weights, so even one update per batch is
slightly off-policy. ``rollout.mismatch_correction`` reweights the reward head's policy-gradient terms by
:func:`mismatch_weights` (truncated IS, "TIS", as in verl and OpenRLHF).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klgrad.choices import MISMATCH_LEVELS, MismatchLevel


def mismatch_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    level: MismatchLevel = "token",
    cap: float = 2.0,
) -> Tensor:
    r"""Truncated importance weights correcting a rollout engine's log-probs, (N, T) -> (N, T), detached.

    With the trainer's log-probs l̄ (``trainer_logp``) and the sampler's s (``sampler_logp``) of the sampled
    tokens, and mask m:

      - ``token``:    w_t = min(exp(l̄_t - s_t), cap)                      on every response token;
      - ``sequence``: w_t = min(exp(Σ_t' m_t' (l̄_t' - s_t')), cap)        the same for every token of a response.

    Masked positions get w = 0 (they carry no loss). The weights are computed as exp(min(d, log cap)), so they
    are finite and in [0, cap] for every finite input (no overflow for |d| of any size) and carry no gradient.
    ``trainer_logp == sampler_logp`` gives w = 1 on every response token (identity).

    Why: samples drawn from the sampler's π_s but trained as if from π_trainer bias the policy gradient;
    E_{π_s}[w ∇ log π] with w = π_trainer/π_s removes the bias, and the cap bounds its variance (a small bias
    where w would exceed it). Token level is what verl's and OpenRLHF's TIS do; sequence level is the unbiased
    ratio of whole responses (up to the cap), with higher variance.

    Args:
        trainer_logp: (N, T) the trainer's log-probs of the sampled tokens (before any update: "old").
        sampler_logp: (N, T) the rollout engine's log-probs of the same tokens (``Rollout.logp``).
        mask: (N, T) bool or 0/1, True = response token. Masked entries never matter, even NaN.
        level: ``token`` or ``sequence``.
        cap: truncation C > 0 (finite).

    Returns:
        (N, T) float32 (float64 if an input is float64) weights, detached.
    """
    if level not in MISMATCH_LEVELS:
        raise ValueError(f"level must be one of {MISMATCH_LEVELS}, got {level!r}")
    if not (isinstance(cap, int | float) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    if trainer_logp.shape != sampler_logp.shape or trainer_logp.shape != mask.shape or trainer_logp.dim() != 2:
        raise ValueError(
            "trainer_logp, sampler_logp and mask must share one (N, T) shape, got "
            f"{tuple(trainer_logp.shape)}, {tuple(sampler_logp.shape)}, {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(trainer_logp.dtype, sampler_logp.dtype), torch.float32)
    with torch.no_grad():
        mask = mask.bool()
        d = torch.where(mask, trainer_logp.detach().to(dtype) - sampler_logp.detach().to(dtype), 0.0)  # (N, T)
        if level == "sequence":
            d = d.sum(-1, keepdim=True).expand_as(d)  # (N, T) Σ_t m_t (l̄_t - s_t) on every token
        w = torch.exp(d.clamp(max=math.log(cap)))  # (N, T) = min(e^d, cap), never overflows
        return torch.where(mask, w, 0.0)
