"""Tolerances derived from the arithmetic they bound, for tests that compare floating-point results.

Two computations of the same quantity that differ only in the order of their roundings (another CPU, another
kernel set: ``ATEN_CPU_CAPABILITY=avx2`` / ``default``, another thread count, a fused or chunked path) differ
by at most the sum of their distances from the exact value. Each function below bounds that distance for one
kind of arithmetic, with the model of the error written in its docstring; a test uses the one that describes
what it compares and says so in a comment. None of them is fitted to a run.

Notation: u = eps/2 is the unit roundoff of the dtype (float32: 2^-24 ≈ 5.96e-8; float64: 2^-53 ≈ 1.11e-16).

- **Worst case** (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1, §4.2): a sum or dot
  product of n terms computed in any order has |ŝ − s| ≤ γ_n · Σ|x_i|, γ_n = n·u / (1 − n·u).
- **Probabilistic** (Higham & Mary, *A New Approach to Probabilistic Rounding Error Analysis*, SIAM J. Sci.
  Comput. 41(5), 2019, Thm 2.4): with rounding errors modelled as independent and mean-zero, the same error is
  at most λ·√n·u·Σ|x_i| with probability ≥ 1 − 2·exp(−λ²(1 − u)²/2). λ = 6 gives a failure probability below
  3e-8 per compared element: over the ~10^5 elements of this suite, below 1e-2 in all.
"""

from __future__ import annotations

import math

import torch

LAMBDA = 6.0
"""Confidence multiplier of the probabilistic bound (failure probability ≤ 2·exp(−18) ≈ 3e-8 per element)."""


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps / 2 of ``dtype``: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """γ_n = n·u / (1 − n·u): worst-case relative error of n successive roundings (Higham, Lemma 3.1)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"n = {n} roundings exceed what {dtype} can bound (n·u ≥ 1)")
    return nu / (1 - nu)


def sum_tol(n: int, abs_sum: float, dtype: torch.dtype = torch.float32) -> float:
    """Worst-case error of a sum (or dot product) of ``n`` terms whose absolute values add up to ``abs_sum``,
    computed in any order: γ_n·Σ|x_i|. Two such computations differ by at most twice that."""
    return gamma(n, dtype) * abs_sum


def sum_tol_probabilistic(n: int, abs_sum: float, dtype: torch.dtype = torch.float32) -> float:
    """Probabilistic error of the same sum: λ·√n·u·Σ|x_i| (Higham & Mary 2019), λ = :data:`LAMBDA`."""
    return LAMBDA * math.sqrt(n) * unit_roundoff(dtype) * abs_sum


def log_softmax_tol(vocab: int, logit_range: float, dtype: torch.dtype = torch.float32) -> float:
    """Worst-case error of log p_k = z_k − m − log Σ_j exp(z_j − m) (m = max z) and of the entropy
    H = −Σ_j p_j (z_j − lse), computed in ``dtype`` in any order.

    Each exp(z_j − m) is within ~2u relative of its value (one subtraction, one exp); their sum adds γ_V; the
    log turns the relative error of the sum into an absolute one (≤ γ_{V+2}), and the final subtraction rounds
    a number of size ≤ ``logit_range`` + log V. The entropy sums V products p_j·(z_j − lse) with
    Σ_j p_j|z_j − lse| ≤ ``logit_range`` + log V, each off by a few u relative plus p_j times the error of lse,
    so its error is within γ_{V+4}·(range + log V) + (error of lse). Both are bounded by
    2·γ_{V+4}·(``logit_range`` + log V + 1).
    """
    return 2 * gamma(vocab + 4, dtype) * (logit_range + math.log(vocab) + 1)


def network_tol(depth: int, width: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """Distance between two evaluations of the same network in ``dtype`` that differ only in the order of
    their roundings (fused vs separate matmuls, chunked vs whole, another kernel set).

    Error model: each of the ``depth`` chained reductions (matmuls of inner dimension ≤ ``width``, attention
    over ≤ ``width`` keys, normalisations over ≤ ``width`` features) adds a relative error of at most
    λ·√width·u (probabilistic bound), and the normalisations between blocks keep the errors of the blocks
    additive rather than compounding. The output, of magnitude ``scale`` (e.g. max |logit|), is then within
    depth·λ·√width·u·scale of the exact value; two evaluations differ by twice that.
    """
    return 2 * depth * sum_tol_probabilistic(width, scale, dtype)


def llama_depth(num_layers: int) -> int:
    """Chained reductions of a Llama-style decoder: per layer RMSNorm, q/k/v, scores, softmax·V, o_proj,
    RMSNorm, gate/up, down (8), plus the final norm and the LM head (2)."""
    return 8 * num_layers + 2


def stored_network_tol(
    points: int, width: int, scale: float, storage: torch.dtype, accumulate: torch.dtype = torch.float32
) -> float:
    """Distance between two evaluations of the same network that keep activations in ``storage`` (bfloat16) and
    accumulate every reduction in ``accumulate`` (float32), as CUDA's bf16 matmuls (fp32 accumulators) and the
    float32 RMSNorm / softmax of transformers and klgrad do.

    Error model: at each of ``points`` rounding points (each stored result: every reduction and every elementwise
    op whose output is rounded to ``storage``) an evaluation gets a relative error of at most u_storage (the one
    rounding of the stored value) plus, for a reduction over ≤ ``width`` terms, the accumulator's
    λ·√width·u_accumulate (:func:`sum_tol_probabilistic`); as in :func:`network_tol`, the normalisations keep the
    errors of the points additive relative to the output's magnitude ``scale``. Two evaluations differ by at most
    twice the sum. Counting every stored rounding at full size makes this loose (for bfloat16, u = 2^-8, tens of
    points give a few tenths of ``scale``): it catches a broken computation, not a small drift.
    """
    per_point = unit_roundoff(storage) + LAMBDA * math.sqrt(width) * unit_roundoff(accumulate)
    return 2 * points * per_point * scale


def llama_rounding_points(num_layers: int) -> int:
    """Stored roundings of a Llama-style decoder in a low-precision dtype (:func:`stored_network_tol`): per layer
    RMSNorm (cast, ×weight: 2), q/k/v (with its bias: 2), RoPE (two products and a sum: 3), scores (product,
    ×scaling, +mask: 3), softmax (1), ·V (1), o_proj (1), residual (1), RMSNorm (2), gate/up (1), silu (1),
    product (1), down (1), residual (1): 21; plus the final norm (2) and the LM head (1)."""
    return 21 * num_layers + 3


def model_tol_stored(config, scale: float, storage: torch.dtype) -> float:
    """:func:`stored_network_tol` of a Llama-style ``transformers`` config (points from its layer count, width the
    largest of hidden and intermediate sizes), at output magnitude ``scale``."""
    width = max(config.hidden_size, config.intermediate_size)
    return stored_network_tol(llama_rounding_points(config.num_hidden_layers), width, scale, storage)


def adamw_step_bound(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Upper bound on how far ``steps`` AdamW updates at learning rate ≤ ``lr`` move one weight (ignoring weight
    decay, which only shrinks it), whatever the gradients.

    Bias-corrected Adam moves a weight by lr·|m̂_t|/(√v̂_t + ε) with m̂_t = (1−β1)Σ_k β1^(t−k) g_k / (1 − β1^t),
    v̂_t = (1−β2)Σ_k β2^(t−k) g_k² / (1 − β2^t). By Cauchy–Schwarz |m̂_t|/√v̂_t ≤ κ_t with
    κ_t = (1−β1)/(1−β1^t) · √(Σ_{j<t} (β1²/β2)^j) · √((1−β2^t)/(1−β2)); κ_1 = 1, κ_3 ≈ 1.004 for the defaults.

    Why a test needs it: near ε a gradient of size 1e-9 from rounding alone (a weight whose exact gradient is 0)
    gives a step of ~0.1·lr, so two runs whose gradients agree to float32 rounding can differ by up to this
    bound in such weights; weights compared after optimizer steps are compared against it, and what the claim
    is about (samples, losses and gradients of one step) is compared tightly.
    """
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        kappa = (1 - b1) / (1 - b1**t) * math.sqrt(sum((b1 * b1 / b2) ** j for j in range(t)))
        kappa *= math.sqrt((1 - b2**t) / (1 - b2))
        total += lr * kappa
    return total


def model_tol(config, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """:func:`network_tol` of a Llama-style ``transformers`` config: depth from its layer count, width the
    largest of hidden and intermediate sizes; ``scale`` the magnitude of the compared output (e.g. max |logit|)."""
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    width = max(config.hidden_size, inner)  # GPT-2's MLP is n_inner (default 4·hidden) wide
    return network_tol(llama_depth(config.num_hidden_layers), width, scale, dtype)


def max_abs_logit(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """max |logit| of ``model`` on a batch: the magnitude a logit or log-prob tolerance scales with.

    A log-prob z_k − lse(z) moves by at most 2·max_j |Δz_j| when the logits move by Δz, so a log-prob comparison
    uses twice the logits' tolerance.
    """
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=pos).logits
    return float(logits.abs().max())


def logprob_tol(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0) -> float:
    """Distance between two float32 evaluations of ``model``'s token log-probs at ``temperature`` on this batch:
    twice the logits' :func:`model_tol` at the batch's largest |logit| / temperature (log-softmax is 2-Lipschitz
    in the max norm). An entropy moves by at most this times the logit range, 2·max|z|/temperature."""
    return 2 * model_tol(model.config, max_abs_logit(model, input_ids, attention_mask) / temperature)
