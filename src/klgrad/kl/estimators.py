"""KL value estimators k1, k2, k3 (docs/math.md, “Value estimators”): values only, no gradient semantics."""

from __future__ import annotations

from typing import Literal

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
