r"""The analytic KL head ``analytic_kl``: the exact next-token KL at every sampled prefix, with its future-KL term.

At each response position t with prefix s_t, the next-token KL over the whole vocabulary at the sampling
temperature τ is

    KL_t = KL(π_τ(·|s_t) ‖ π_ref,τ(·|s_t)) = Σ_v p_v (log p_v − log q_v),  p = softmax(z/τ), q = softmax(z_ref/τ),

a differentiable function of the policy's logits z at s_t (:func:`next_token_kl`). The sequence KL is
KL(π‖π_ref) = E_π[Σ_t m_t KL_t], whose gradient is

    ∇ E[Σ_t KL_t] = E[Σ_t ∇KL_t(s_t)] + E[Σ_{t'} ∇ log π(y_t'|s_t') · Σ_{t > t'} KL_t(s_t)]   (strictly after t').

Per level (:func:`analytic_kl_per_sequence`), with Δ_t = m_t (l_t − o_t) and behaviour o (o = l̄ on-policy):
  - ``token_to_go``: loss = Σ_t m_t ρ_{1:t−1} KL_t, ρ_{1:t−1} = exp(Σ_{t'<t} Δ_t') carrying gradient. Its gradient
    is Σ_t ρ_{1:t−1} (∇KL_t + KL_t Σ_{t'<t} ∇l_t'): on-policy (ρ ≡ 1) the formula above; off-policy (samples from
    μ) each KL_t, pathwise and inside every earlier token's score term, weighted by the ratio of its own prefix,
    an unbiased estimate because KL_t depends on y_{<t} only.
  - ``sequence``: loss = ρ_{1:T} Σ_t m_t KL_t: the same expected gradient with the past terms (t ≤ t', zero mean)
    kept, and the whole response's ratio off-policy.
  - ``token``: loss = Σ_t m_t sg(ρ_{1:t−1}) KL_t: the local KL's gradient Σ_t E[∇KL_t] only (what distillation
    losses such as GKD differentiate), target ``local_rkl``, not the sequence KL's.
On-policy every level's value is Σ_t m_t KL_t, the Rao–Blackwellised sequence-KL estimate. EOS and the length cap
are the mask's: a response's last KL_t is at its EOS token or at the cap. Ratios are capped at ``max_log_ratio``
in value only (straight-through). There is no clipped form (``clip_eps`` is refused off-policy; on-policy a clip
never acts).

Precision: the head reads whole distributions, so its dtype axis is the logits' (float64 stays float64, half
precision is promoted to float32 inside :func:`next_token_kl`), not the sampled log-probs'.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.choices import LEVELS, Level
from klgrad.kl.heads import KLHead, register_kl_head
from klgrad.kl.numerics import MAX_LOG_RATIO, at_least_f32, straight_through_cap

ANALYTIC_HEADS: tuple[str, ...] = ("analytic_kl",)
"""Heads that read the next-token distributions, not only the sampled tokens' log-probs."""
CHUNK_POSITIONS = 64
"""Response positions per chunk of :func:`next_token_kl` (a few float32 (B, c, V) buffers alive at once)."""


def _kl_parts(z: Tensor, z_ref: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(p, log p − log q, KL) of one chunk: z, z_ref (..., V) -> (..., V), (..., V), (...)."""
    lp = torch.log_softmax(at_least_f32(z) / temperature, dim=-1)  # (..., V)
    lq = torch.log_softmax(at_least_f32(z_ref) / temperature, dim=-1)  # (..., V)
    p = lp.exp()  # (..., V)
    d = lp - lq  # (..., V)
    return p, d, (p * d).sum(-1)


class _NextTokenKL(torch.autograd.Function):
    """KL_t = Σ_v p_v d_v, d = log p − log q; ∂KL_t/∂z_v = p_v (d_v − KL_t) / τ. Chunked over positions, forward and
    backward (the softmax is recomputed per chunk from the saved logits)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ref_logits: Tensor, temperature: float, chunk: int) -> Tensor:
        out_dtype = at_least_f32(logits[..., :1]).dtype
        kl = torch.empty(logits.shape[:-1], dtype=out_dtype, device=logits.device)  # (B, T)
        for i in range(0, logits.shape[1], chunk):
            kl[:, i : i + chunk] = _kl_parts(logits[:, i : i + chunk], ref_logits[:, i : i + chunk], temperature)[2]
        ctx.save_for_backward(logits, ref_logits)
        ctx.temperature, ctx.chunk = temperature, chunk
        return kl

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, ref_logits = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        out = torch.empty_like(logits)  # (B, T, V)
        for i in range(0, logits.shape[1], chunk):
            p, d, kl = _kl_parts(logits[:, i : i + chunk], ref_logits[:, i : i + chunk], tau)
            g = grad[:, i : i + chunk, None].to(p.dtype)  # (B, c, 1)
            out[:, i : i + chunk] = (g * p * (d - kl[..., None]) / tau).to(out.dtype)
        return out, None, None, None


def next_token_kl(logits: Tensor, ref_logits: Tensor, temperature: float = 1.0, chunk: int = CHUNK_POSITIONS) -> Tensor:
    r"""KL_t = KL(softmax(z_t/τ) ‖ softmax(z_ref,t/τ)), (B, T, V), (B, T, V) -> (B, T), differentiable in ``logits``.

    ``ref_logits`` is detached. Computed chunk by chunk over T in float32 or wider; gradient
    ∂KL_t/∂z_t = p (log p − log q − KL_t) / τ in closed form.
    """
    if logits.shape != ref_logits.shape or logits.dim() != 3:
        raise ValueError(
            f"logits and ref_logits must both be (B, T, V), got {tuple(logits.shape)}, {tuple(ref_logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _NextTokenKL.apply(logits, ref_logits.detach(), float(temperature), int(chunk))


def prefix_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, *, inclusive: bool) -> Tensor:
    r"""log ρ_{1:t} = Σ_{t'≤t} m_t' (l_t' − o_t') (``inclusive``) or log ρ_{1:t−1} = Σ_{t'<t} (not), (B, T) -> (B, T).

    Gradient flows through ``logp`` of every token counted; ``old_logp`` is detached."""
    mask = mask.bool()
    delta = torch.where(mask, at_least_f32(logp) - at_least_f32(old_logp.detach()), 0.0)  # (B, T)
    cum = delta.cumsum(-1)  # (B, T)
    return cum if inclusive else cum - delta


def analytic_kl_per_sequence(
    next_kl: Tensor,
    logp: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    level: Level = "token_to_go",
    clip_eps: float | None = None,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> Tensor:
    r"""Per-sequence loss of the analytic KL head, (B, T) KL_t, (B, T) l, (B, T) mask -> (B,) (module docstring).

    token_to_go: Σ_t m_t ρ_{1:t−1} KL_t; sequence: ρ_{1:T} Σ_t m_t KL_t; token: Σ_t m_t sg(ρ_{1:t−1}) KL_t; ρ ≡ 1 in
    value on-policy (``old_logp`` None), its gradient the score terms. ``next_kl`` carries the pathwise gradient.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if clip_eps is not None and old_logp is not None:  # on-policy a clip never acts (ρ ≡ 1), so it is not asked for
        raise ValueError("analytic_kl has no clipped form off-policy: set kl.clip_eps to null (importance sampling)")
    for name, t in (("logp", logp), ("mask", mask), ("old_logp", old_logp)):
        if t is not None and t.shape != next_kl.shape:
            raise ValueError(f"{name} must have the shape of next_kl {tuple(next_kl.shape)}, got {tuple(t.shape)}")
    mask = mask.bool()
    kl = torch.where(mask, at_least_f32(next_kl), 0.0)  # (B, T)
    behaviour = logp.detach() if old_logp is None else old_logp
    if level == "sequence":
        log_rho = prefix_log_ratio(logp, behaviour, mask, inclusive=True)[:, -1]  # (B,) log ρ_{1:T}
        return torch.exp(straight_through_cap(log_rho, max_log_ratio)) * kl.sum(-1)  # (B,)
    log_rho = prefix_log_ratio(logp, behaviour, mask, inclusive=False)  # (B, T) log ρ_{1:t−1}
    rho = torch.exp(straight_through_cap(log_rho, max_log_ratio))  # (B, T)
    if level == "token":
        rho = rho.detach()
    return torch.where(mask, rho * kl, 0.0).sum(-1)  # (B,)


def _needs_distributions(logp: Tensor, ref_logp: Tensor) -> Tensor:
    raise ValueError(
        "analytic_kl reads the next-token distributions: it has no per-token coefficient c(l̄, r); use "
        "klgrad.kl.analytic.analytic_kl_per_sequence with next_token_kl (kl.form decoupled)"
    )


ANALYTIC_KL = register_kl_head(
    KLHead(
        name="analytic_kl",
        style="analytic",
        coefficient_fn=_needs_distributions,
        targets={"sequence": "rkl", "token_to_go": "rkl", "token": "local_rkl"},
        penalty_formula="Σ_t ρ_{1:t−1} KL(π(·|s_t) ‖ π_ref(·|s_t))",
        coefficient_formula="Σ_{t>t'} KL_t (score) + ∇KL_t (pathwise)",
        verdict="exact reverse-KL gradient from whole next-token distributions (token level: local KL)",
        doc=__doc__ or "",
    )
)
"""The analytic KL head's record, registered by name (not in :data:`~klgrad.kl.KL_HEADS`, whose heads are
elementwise in the sampled log-probs)."""
