r"""Importance weights for a rollout engine whose log-probs differ from the trainer's, and how far they differ.

Any sampler that does not compute in the trainer's arithmetic (vLLM, with its kernels and bf16/fp8 arithmetic;
klgrad's own with ``rollout.sampler_dtype: bfloat16``) gives log-probs ``s`` that differ from the trainer's ``l̄``
for the same tokens and weights, so even one update per batch is slightly off-policy.
``rollout.mismatch_correction`` reweights the reward head's policy-gradient terms by :func:`mismatch_weights`
(truncated IS, "TIS", as in verl and OpenRLHF; or masked IS, verl's rollout rejection), and
:func:`mismatch_stats` measures the gap every step.
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
    r"""Importance weights correcting a rollout engine's log-probs, (N, T) -> (N, T), detached.

    With the trainer's log-probs l̄ (``trainer_logp``) and the sampler's s (``sampler_logp``) of the sampled
    tokens, mask m, d_t = l̄_t - s_t (token) or d_t = Σ_t' m_t' (l̄_t' - s_t') (sequence, the same for every
    token of a response) and C = ``cap``:

      - ``token`` / ``sequence`` (truncated IS):  w_t = min(exp(d_t), C);
      - ``token_mask`` / ``sequence_mask`` (masked IS, verl's rollout rejection):
        w_t = exp(d_t) · 1[-log C ≤ d_t ≤ log C]: the ratio where it lies in [1/C, C], 0 outside (the token, or
        the whole response, drops out of the reward head's loss; C > 1).

    Masked positions get w = 0 (they carry no loss). The weights are computed from min(d, log C), so they
    are finite and in [0, C] for every finite input (no overflow for |d| of any size) and carry no gradient.
    ``trainer_logp == sampler_logp`` gives w = 1 on every response token (identity). The masked variants keep
    klgrad's loss normalisers (verl's rejection also drops rejected tokens from its denominators).

    Why: samples drawn from the sampler's π_s but trained as if from π_trainer bias the policy gradient;
    E_{π_s}[w ∇ log π] with w = π_trainer/π_s removes the bias, and the cap bounds its variance (a small bias
    where w would exceed it). Token level is what verl's and OpenRLHF's TIS do; sequence level is the unbiased
    ratio of whole responses (up to the cap), with higher variance.

    Args:
        trainer_logp: (N, T) the trainer's log-probs of the sampled tokens (before any update: "old").
        sampler_logp: (N, T) the rollout engine's log-probs of the same tokens (``Rollout.logp``).
        mask: (N, T) bool or 0/1, True = response token. Masked entries never matter, even NaN.
        level: ``token``, ``sequence``, ``token_mask`` or ``sequence_mask``.
        cap: truncation C > 0 (finite); > 1 for the masked levels.

    Returns:
        (N, T) float32 (float64 if an input is float64) weights, detached.
    """
    if level not in MISMATCH_LEVELS:
        raise ValueError(f"level must be one of {MISMATCH_LEVELS}, got {level!r}")
    if not (isinstance(cap, int | float) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    if level.endswith("_mask") and cap <= 1:
        raise ValueError(f"cap must be > 1 for level {level!r} (it keeps ratios in [1/cap, cap]), got {cap!r}")
    if trainer_logp.shape != sampler_logp.shape or trainer_logp.shape != mask.shape or trainer_logp.dim() != 2:
        raise ValueError(
            "trainer_logp, sampler_logp and mask must share one (N, T) shape, got "
            f"{tuple(trainer_logp.shape)}, {tuple(sampler_logp.shape)}, {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(trainer_logp.dtype, sampler_logp.dtype), torch.float32)
    with torch.no_grad():
        mask = mask.bool()
        d = torch.where(mask, trainer_logp.detach().to(dtype) - sampler_logp.detach().to(dtype), 0.0)  # (N, T)
        if level.startswith("sequence"):
            d = d.sum(-1, keepdim=True).expand_as(d)  # (N, T) Σ_t m_t (l̄_t - s_t) on every token
        log_cap = math.log(cap)
        w = torch.exp(d.clamp(max=log_cap))  # (N, T) = min(e^d, cap), never overflows
        if level.endswith("_mask"):
            w = torch.where((d >= -log_cap) & (d <= log_cap), w, 0.0)  # (N, T) ratio outside [1/C, C]: out
        return torch.where(mask, w, 0.0)


def mismatch_stats(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, float]:
    r"""How far the sampler's log-probs s are from the trainer's l̄ on the sampled tokens (mask m, N responses):

      - ``logp_diff_abs``: Σ_{n,t} m |l̄ - s| / Σ m, the mean per-token |Δ log-prob|;
      - ``logp_diff_max``: max over response tokens of |l̄ - s|;
      - ``kl_k1``: (1/N) Σ_n Σ_t m (s - l̄), the sampled sequence KL(π_sampler ‖ π_trainer) (k1: unbiased, as the
        responses are the sampler's draws; may be < 0 on a batch);
      - ``kl_k3``: (1/N) Σ_n Σ_t m (r - 1 - log r) with r = exp(l̄ - s), the per-token k3 summed over a response
        (≥ 0 term by term; an estimate of the per-position KL(π_sampler ‖ π_trainer) summed along the response).

    All 0 when the two agree. Computed in float64 from detached inputs; masked entries never matter."""
    with torch.no_grad():
        m = mask.bool()
        d = torch.where(m, trainer_logp.detach().double() - sampler_logp.detach().double(), 0.0)  # (N, T) l̄ - s
        n_tok, n_seq = max(int(m.sum()), 1), max(d.shape[0], 1)
        k3 = torch.where(m, torch.expm1(d) - d, 0.0)  # (N, T) r - 1 - log r
        return {
            "logp_diff_abs": float(d.abs().sum() / n_tok),
            "logp_diff_max": float(d.abs().max()) if d.numel() else 0.0,
            "kl_k1": float(-d.sum() / n_seq),
            "kl_k3": float(k3.sum() / n_seq),
        }


def position_kl(sampler_logits: Tensor, trainer_logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    r"""(N,) Σ_t m_t KL(p_s,t ‖ p_θ,t): the exact per-position KL between the sampler's and the trainer's
    next-token distributions p = softmax(z / τ), summed along each sampled response.

    KL(p_s ‖ p_θ) = Σ_v p_s(v) (log p_s(v) − log p_θ(v)) over the whole vocabulary at each response position;
    summed along responses drawn from the sampler, its mean over responses is an unbiased estimate of the sequence
    KL(π_sampler ‖ π_trainer) with less variance than k1 (the expectation over the next token taken exactly).

    Args:
        sampler_logits, trainer_logits: (N, T, V) logits predicting response token t (any float dtype).
        mask: (N, T) response tokens. Computed in float64.
    """
    if sampler_logits.shape != trainer_logits.shape or sampler_logits.shape[:2] != mask.shape:
        raise ValueError(
            f"logits (N, T, V) and mask (N, T) must agree, got {tuple(sampler_logits.shape)}, "
            f"{tuple(trainer_logits.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        ls = torch.log_softmax(sampler_logits.double() / temperature, -1)  # (N, T, V)
        lt = torch.log_softmax(trainer_logits.double() / temperature, -1)  # (N, T, V)
        kl = (ls.exp() * (ls - lt)).sum(-1)  # (N, T)
        return torch.where(mask.bool(), kl, 0.0).sum(-1)  # (N,)
