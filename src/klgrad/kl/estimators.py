"""KL value estimators k1, k2, k3 (docs/math.md, “Value estimators”): values only, no gradient semantics."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from klgrad.kl.numerics import at_least_f32, expm1_linear_tail

EstimatorKind = Literal["k1", "k2", "k3"]


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: EstimatorKind) -> Tensor:
    r"""Elementwise KL value estimators with u = logp - ref_logp and δ = π_ref/π = e^{-u}.

    k1 = u,  k2 = ½u²,  k3 = δ - 1 + u (= e^{-u} - 1 + u).

    Shapes: any, broadcastable -> broadcast shape. Values only: these carry no statement about gradients
    (that is what heads are for). Under samples from π, E[k1] = E[k3] = KL(π‖π_ref); k2 is biased;
    k3 ≥ 0 always but its variance is χ²-like. k3 uses :func:`exp_linear_tail` (exact for u ≥ -20).
    """
    u = at_least_f32(logp) - at_least_f32(ref_logp)
    if kind == "k1":
        return u
    if kind == "k2":
        return 0.5 * u * u
    if kind == "k3":
        return expm1_linear_tail(-u) + u
    raise ValueError(f"kind must be one of ('k1', 'k2', 'k3'), got {kind!r}")


ESTIMATORS: tuple[EstimatorKind, ...] = ("k1", "k2", "k3")


def sequence_log_ratio(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """U = Σ_t m_t (l_t − r_t), (B, T) -> (B,): the sequence log-ratio log π(y|x) − log π_ref(y|x).

    The per-token difference is taken first (no cancellation between two large sums), in the inputs' precision
    (float32 or better: half precision is promoted). Padding never enters: masked before the sum.
    """
    return torch.where(mask.bool(), at_least_f32(logp) - at_least_f32(ref_logp), 0.0).sum(-1)


def sequence_kl_estimates(seq_log_ratio: Tensor) -> dict[EstimatorKind, Tensor]:
    """k1, k2, k3 of sequence log-ratios U (:func:`sequence_log_ratio`) of responses sampled from π, (B,) each.

    Their means estimate KL(π‖π_ref) between the response distributions (k1, k3 unbiased; k2 biased);
    the one place klgrad turns sampled sequences into KL values (training record, evaluation, ``compare``).
    """
    return {kind: kl_estimate(seq_log_ratio, torch.zeros_like(seq_log_ratio), kind) for kind in ESTIMATORS}
