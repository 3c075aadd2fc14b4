"""Reward shaping: turn per-completion scalar rewards into advantages (GRPO, RLOO, REINFORCE++, ...).

A batch holds B = num_groups * G completions; rows ``[g*G:(g+1)*G]`` were sampled for prompt g.
Every operator maps a (B,) tensor to a (B,) tensor; a preset applies operators in order (paper,
appendix A). All standard deviations are unbiased (correction=1, like ``torch.std``) and are
clipped to ``[std_min, std_max]`` when those are given. A chunk (a group, or the whole batch) whose
values are all exactly equal is degenerate: its advantages are exactly 0, never NaN or inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrad.choices import GROUP_OPS, SHAPING_METHODS, SHAPING_PRESETS, needs_groups

_NORM_OPS = frozenset({"group_norm", "batch_norm"})


@dataclass(frozen=True)
class ShapingStats:
    """Diagnostics of one ``shape_rewards`` call.

    Attributes:
        zero_std_groups: Groups whose raw rewards are all exactly equal (counted for every method).
        num_groups: B // G.
        std_clipped: Std values raised by ``std_min`` or lowered by ``std_max``, summed over the
            normalising operators of the chain (degenerate chunks are never counted).
    """

    zero_std_groups: int
    num_groups: int
    std_clipped: int


def _center(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Centre each contiguous chunk of n values: ``c = x - mean_chunk(x)``.

    Returns the centred values, shape (B // n, n), exactly 0 on constant chunks, and the (B // n,)
    mask of constant chunks (max == min).
    """
    chunks = x.reshape(-1, n)  # (C, n)
    const = chunks.amax(dim=1) == chunks.amin(dim=1)  # (C,)
    centred = chunks - chunks.mean(dim=1, keepdim=True)  # (C, n)
    return centred.masked_fill(const[:, None], 0.0), const


def _normalize(x: Tensor, n: int, std_min: float | None, std_max: float | None) -> tuple[Tensor, int]:
    """Per chunk of n values: ``a = (x - mean) / clip(std)``, ``clip(s) = max(min(s, std_max), std_min)``.

    The std is computed scale-free, ``std = m * std(c / m)`` with ``m = max|c|``, so squaring can
    neither overflow (|x| ~ 1e150) nor underflow to 0 (|x| ~ 1e-300). Returns the (B,) advantages
    and the number of clipped std values.
    """
    centred, const = _center(x, n)  # (C, n), (C,)
    scale = centred.abs().amax(dim=1, keepdim=True)  # (C, 1)
    scale = torch.where(const[:, None], torch.ones_like(scale), scale)
    unit = centred / scale  # (C, n), |unit| <= 1, max |unit| == 1 unless constant
    s = (unit.square().sum(dim=1, keepdim=True) / (n - 1)).sqrt()  # (C, 1), >= 1/sqrt(n-1) unless const
    std = scale * s  # (C, 1)
    if std_min is None and std_max is None:
        clipped = torch.zeros_like(const)  # (C,)
        std_c = std
    else:
        std_c = std.clamp(min=std_min, max=std_max)  # (C, 1)
        clipped = (std_c != std).squeeze(1) & ~const  # (C,)
    ones = torch.ones_like(s)
    unclipped_adv = unit / torch.where(const[:, None], ones, s)  # (C, n), 0 on constant chunks
    clipped_adv = centred / torch.where(clipped[:, None], std_c, ones)  # (C, n)
    adv = torch.where(clipped[:, None], clipped_adv, unclipped_adv)  # (C, n)
    return adv.reshape(-1), int(clipped.sum())


def _validate(
    rewards: Tensor, group_size: int, method: str, std_min: float | None, std_max: float | None
) -> tuple[str, ...]:
    """Check every argument; return the operator chain of ``method``."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D of shape (B,), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards must be non-empty, got B=0")
    if rewards.is_complex():
        raise ValueError(f"rewards must be real, got dtype {rewards.dtype}")
    if rewards.is_floating_point():
        n_bad = int((~torch.isfinite(rewards)).sum())
        if n_bad:
            raise ValueError(f"rewards contains {n_bad} non-finite value(s) (NaN or inf) out of {rewards.numel()}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    B = rewards.numel()
    if B % group_size:
        raise ValueError(f"rewards length B={B} is not divisible by group_size G={group_size}")
    if method not in SHAPING_METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(SHAPING_METHODS)}")
    for name, val in (("std_min", std_min), ("std_max", std_max)):
        if val is not None and not val > 0:
            raise ValueError(f"{name} must be > 0, got {val}")
    if std_min is not None and std_max is not None and std_min > std_max:
        raise ValueError(f"std_min={std_min} must be <= std_max={std_max}")
    ops = SHAPING_PRESETS.get(method, (method,))
    if group_size == 1 and needs_groups(method):
        raise ValueError(
            f"method {method!r} needs a group statistic over >1 element, but group_size=1 makes every "
            "group-baseline advantage 0 (and the group std / leave-one-out mean undefined)"
        )
    if B == 1 and "batch_norm" in ops:
        raise ValueError(f"method {method!r} normalises by the batch std, which needs B >= 2 rewards, got B=1")
    return ops


def shape_rewards(
    rewards: Tensor,
    group_size: int,
    method: str,
    std_min: float | None = None,
    std_max: float | None = None,
    *,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, ShapingStats]:
    """Turn rewards into advantages with one operator or preset.

    Operators (mean/std over the group of G, or over the batch of B; std unbiased, then clipped):

    - ``none``: ``a = r``
    - ``group_baseline``: ``a = r - mean_group(r)``
    - ``batch_baseline``: ``a = r - mean_batch(r)``
    - ``group_norm``: ``a = (r - mean_group(r)) / clip(std_group(r))``
    - ``batch_norm``: ``a = (r - mean_batch(r)) / clip(std_batch(r))``
    - ``rloo``: ``a_i = r_i - mean_{j != i in group}(r_j) = G / (G - 1) * (r_i - mean_group(r))``

    Presets: ``reinforce`` and ``reinforce_pp`` = batch_norm, ``grpo`` = group_norm, ``dr_grpo`` =
    group_baseline, ``reinforce_pp_baseline`` = batch_norm(group_baseline(r)).

    Args:
        rewards: (B,) rewards, groups contiguous. Finite; |r| <= ~1e150 keeps float64 sums finite.
        group_size: G, completions per prompt; must divide B.
        method: One of ``SHAPING_METHODS``.
        std_min: Lower clip of every std, > 0 (ignored by methods without a normalising operator).
        std_max: Upper clip of every std, > 0 and >= ``std_min``.
        return_stats: Also return a ``ShapingStats``.

    Returns:
        (B,) advantages, detached, float64 for float64 input else float32; with ``return_stats``,
        the tuple ``(advantages, stats)``.

    Raises:
        ValueError: On a bad shape, non-finite reward, bad group size, unknown method or bad clip.
        TypeError: If ``group_size`` is not an int.
    """
    ops = _validate(rewards, group_size, method, std_min, std_max)
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    x = rewards.detach().to(dtype=dtype, copy=True)  # (B,), a fresh tensor: the input is never aliased
    B, G = x.numel(), group_size
    zero_std_groups = int(_center(x, G)[1].sum())
    std_clipped = 0
    for op in ops:
        n = G if op in GROUP_OPS else B
        if op in _NORM_OPS:
            x, c = _normalize(x, n, std_min, std_max)  # (B,)
            std_clipped += c
        elif op != "none":
            x = _center(x, n)[0].reshape(-1)  # (B,)
            if op == "rloo":
                x = x * (n / (n - 1))  # (B,)
    if not return_stats:
        return x
    return x, ShapingStats(zero_std_groups=zero_std_groups, num_groups=B // G, std_clipped=std_clipped)


# ----------------------------------------------------------------------------------------------------------
# the shaping's slope without one sample (the combined form's token_to_go prefix term)


def _masked_std(v: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """Unbiased std over the present entries of each row, (..., n) -> (...,) std and (...,) mean.

    std = m·sqrt(Σ_j p_j ((v_j - v̄)/m)² / (k - 1)) with v̄ the mean over the k present entries and m the largest
    present |v_j - v̄| (scale-free, as in shaping); exactly 0 when the present entries are all equal (max == min)
    and NaN when k < 2. Absent entries never enter: they are masked before every sum.
    """
    k = present.sum(-1)  # (...,)
    vp = torch.where(present, v, 0.0)  # (..., n)
    mean = vp.sum(-1) / k.clamp(min=1)  # (...,)
    centred = torch.where(present, v - mean[..., None], 0.0)  # (..., n)
    const = torch.where(present, v, -torch.inf).amax(-1) == torch.where(present, v, torch.inf).amin(-1)  # (...,)
    m = centred.abs().amax(-1)  # (...,)
    m = torch.where(const | (m == 0), torch.ones_like(m), m)
    s = ((centred / m[..., None]).square().sum(-1) / (k - 1).clamp(min=1)).sqrt()  # (...,)
    std = torch.where(const, torch.zeros_like(s), m * s)
    return torch.where(k >= 2, std, torch.full_like(std, torch.nan)), mean


def _loo_chain_scale(
    x: Tensor,
    present: Tensor,
    own: Tensor,
    ops: tuple[str, ...],
    group_size: int,
    std_min: float | None,
    std_max: float | None,
) -> Tensor:
    """The shaping chain on rows of (R, n) totals with sample ``own`` (R,) absent: Π 1/clip(std) per row, (R,).

    Each row is the batch (or group) with one sample left out (``present`` (R, n) False there); group statistics
    are over contiguous chunks of ``group_size`` columns. A row's factor is 1/clip(std) of the chunk holding its
    own sample, for each normalising operator; 0 when that std is undefined (fewer than 2 others) or 0 after
    clipping, so the prefix term is dropped rather than scaled by a statistic that would need the sample itself.
    """
    rows, n = x.shape
    scale = torch.ones(rows, dtype=x.dtype, device=x.device)
    for op in ops:
        chunk = group_size if op in ("group_norm", "group_baseline", "rloo") else n
        v = x.view(rows, n // chunk, chunk)  # (R, C, chunk)
        p = present.view(rows, n // chunk, chunk)
        if op in ("group_norm", "batch_norm"):
            std, mean = _masked_std(v, p)  # (R, C)
            if std_min is not None or std_max is not None:
                std = torch.where(std.isnan(), std, std.clamp(min=std_min, max=std_max))
            ok = std > 0  # False for NaN (undefined) and 0
            safe = torch.where(ok, std, torch.ones_like(std))  # (R, C)
            own_std_ok = ok.gather(1, (own // chunk)[:, None]).squeeze(1)  # (R,)
            own_inv = 1.0 / safe.gather(1, (own // chunk)[:, None]).squeeze(1)  # (R,)
            scale = torch.where(own_std_ok & torch.isfinite(own_inv), scale * own_inv, torch.zeros_like(scale))
            x = ((v - mean[..., None]) / safe[..., None]).reshape(rows, n)
        elif op in ("group_baseline", "rloo", "batch_baseline"):
            k = p.sum(-1).clamp(min=1)  # (R, C)
            mean = torch.where(p, v, 0.0).sum(-1) / k  # (R, C)
            x = (v - mean[..., None]).reshape(rows, n)
    return scale


def leave_one_out_scale(
    totals: Tensor, group_size: int, method: str, std_min: float | None, std_max: float | None
) -> Tensor:
    """Multiplier s_{-i} of the token_to_go prefix term, computed without sample i, (B,) -> (B,).

    s_{-i} = Π over the normalising operators of 1/clip(std), each std taken on the batch with sample i left out
    (group_norm: the other G - 1 totals of its group; batch_norm: the other B - 1 values, after the chain's
    earlier operators recomputed without i). Baselines contribute 1. s_{-i} is 0 where that std is undefined
    (G = 2 for group_norm) or 0 after clipping (the others all equal and no std_min): there the sample's
    advantages are the sequence-level ones. Being a function of the other samples only, s_{-i} is independent
    of y_i, so E[s_{-i} β Σ_{t'<t} c_t' ∇log π(y_t|y_<t)] = E[s_{-i}] E[β Σ_{t'<t} c_t' E[∇log π(y_t|y_<t) | y_<t]] = 0.
    """
    ops = SHAPING_PRESETS.get(method, (method,))
    x = totals.detach().to(torch.float64)  # (B,)
    B, G = x.numel(), group_size
    if not {"group_norm", "batch_norm"}.intersection(ops):
        return torch.ones_like(totals)
    if all(op in ("group_norm", "group_baseline", "rloo") for op in ops):  # group-local: (groups·G, G) rows
        rows = x.view(-1, 1, G).expand(-1, G, G).reshape(-1, G)  # (B, G): row i holds i's group
        own = torch.arange(G, device=x.device).repeat(B // G)  # (B,) i's column in its row
        present = torch.arange(G, device=x.device)[None, :] != own[:, None]  # (B, G)
        scale = _loo_chain_scale(rows, present, own, ops, G, std_min, std_max)
    else:  # batch statistics: (B, B) rows, in blocks to bound memory
        block = max(1, 2**20 // B)
        parts = []
        for lo in range(0, B, block):
            own = torch.arange(lo, min(lo + block, B), device=x.device)  # (R,)
            present = torch.arange(B, device=x.device)[None, :] != own[:, None]  # (R, B)
            parts.append(_loo_chain_scale(x[None, :].expand(len(own), B), present, own, ops, G, std_min, std_max))
        scale = torch.cat(parts)
    scale = scale.to(totals.dtype)  # a float64 scale can overflow the totals' float32
    return torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
