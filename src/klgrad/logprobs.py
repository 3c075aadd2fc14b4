r"""Logits -> per-token log-probabilities and entropies; the one shift convention.

Shift convention (used everywhere in klgrad): for a causal LM run on ``input_ids`` (B, L), the logits at
position i are the distribution of the token at position i + 1. So the log-prob of token
``input_ids[:, j]`` is read from ``logits[:, j - 1]``, and the response ``input_ids[:, s:]`` is scored by
``logits[:, s - 1 : L - 1]``.

Memory. With a large vocabulary the logits dominate: B = 8, T = 1024, V = 151,936 is 5 GB in float32. The
naive ``log_softmax(logits, -1).gather(...)`` materialises another (B, T, V) tensor (plus a float32 copy of
bf16 logits). Here each quantity is computed chunk by chunk over the sequence dimension, in float32, as
``gather(z) - logsumexp(z)`` with z = logits / temperature, so the extra memory is a few float32 (B, c, V)
chunks of ≤ ``CHUNK_BYTES`` each (the upcast, z - max(z) and its exponential). Backward is chunked too (a
custom autograd function recomputes the softmax per chunk from the saved logits and log-normaliser), so
with gradients the only full-size new tensor is the gradient of the logits itself, in the logits' dtype.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_BYTES = 64 * 2**20
"""Target size of one chunk's float32 (B, c, V) working tensor: 64 MiB (a few are alive at once; bench/memory.py
measured 770 MiB of workspace at 256 MiB chunks for V = 151,936, T = 1,024, B = 4, and the same speed at 64)."""


VARLEN = ("flash_attention_2", "flash_attention_3")
"""transformers attention kernels that run a packed row (position ids restarting per sequence) as variable-length
sequences, without a dense mask over the row."""


def default_chunk_size(batch: int, vocab: int) -> int:
    """Positions per chunk so that a float32 (batch, chunk, vocab) tensor stays under ``CHUNK_BYTES``.

    At least 1, so with batch × vocab × 4 bytes > 64 MiB a chunk is one position (B = 128 at V = 151,936).
    """
    return max(1, CHUNK_BYTES // (4 * max(1, batch) * max(1, vocab)))


def _chunks(length: int, chunk_size: int) -> list[slice]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [slice(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """z = logits / τ in float32 (float64 stays float64); bf16/fp16 chunks are upcast here, one at a time."""
    z = logits if logits.dtype == torch.float64 else logits.float()  # no copy for float32
    return z if temperature == 1.0 else z / temperature


def _log_normalise(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """log softmax(z) = zs - ls with m = max(z) (B, c), zs = z - m (B, c, V), ls = log Σ exp(zs) (B, c).

    The same arithmetic as ``torch.log_softmax``: subtracting logsumexp(z) = max + ls in one step would
    round at the magnitude of logsumexp(z), a few ulps worse for large logits.
    """
    m = z.amax(dim=-1)  # (B, c)
    zs = z - m[..., None]  # (B, c, V), max 0
    return zs, m, zs.exp().sum(-1).log()  # (B, c, V), (B, c), (B, c)


class _TokenLogprobs(torch.autograd.Function):
    """logp = gather(z, tok) - logsumexp(z), z = x / τ; dlogp/dx = (onehot(tok) - softmax(z)) / τ."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int) -> Tensor:
        B, T, _ = logits.shape
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        lse = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        for sl in _chunks(T, chunk_size):
            z = _scaled(logits[:, sl], temperature)  # (B, c, V)
            zs, m, ls = _log_normalise(z)  # (B, c, V), (B, c), (B, c)
            logp[:, sl] = zs.gather(-1, tokens[:, sl, None]).squeeze(-1) - ls  # (B, c)
            lse[:, sl] = m + ls  # (B, c) logsumexp(z)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, tokens, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for sl in _chunks(logits.shape[1], ctx.chunk_size):
            g = grad_logp[:, sl, None].to(lse.dtype)  # (B, c, 1)
            p = torch.exp(_scaled(logits[:, sl], tau) - lse[:, sl, None])  # (B, c, V) softmax(z)
            gz = (-g * p).scatter_add_(-1, tokens[:, sl, None], g)  # (B, c, V) g·(onehot - p)
            grad[:, sl] = gz / tau if tau != 1.0 else gz
        return grad, None, None, None


class _TokenEntropy(torch.autograd.Function):
    """H = -Σ q·log q with log q = z - logsumexp(z), z = x / τ; dH/dx = -q·(log q + H) / τ."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        B, T, _ = logits.shape
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        ent = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        lse = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        for sl in _chunks(T, chunk_size):
            z = _scaled(logits[:, sl], temperature)  # (B, c, V)
            zs, m, ls = _log_normalise(z)  # (B, c, V), (B, c), (B, c)
            logq = zs.sub_(ls[..., None])  # (B, c, V) log softmax(z), in place of zs
            lse[:, sl] = m + ls  # (B, c) logsumexp(z)
            ent[:, sl] = -logq.exp().mul_(logq).sum(-1)  # (B, c)
        ctx.save_for_backward(logits, lse, ent)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ent: Tensor) -> tuple[Tensor | None, None, None]:
        logits, lse, ent = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for sl in _chunks(logits.shape[1], ctx.chunk_size):
            logq = _scaled(logits[:, sl], tau) - lse[:, sl, None]  # (B, c, V)
            gz = -grad_ent[:, sl, None].to(lse.dtype) * logq.exp() * (logq + ent[:, sl, None])  # (B, c, V)
            grad[:, sl] = gz / tau if tau != 1.0 else gz
        return grad, None, None


class _TokenLogprobsEntropy(torch.autograd.Function):
    """Both at once, one backward: d/dx [g·logp + h·H] = (g·(onehot(tok) - q) - h·q·(log q + H)) / τ.

    One gradient buffer for the logits instead of two (and their sum): with backward at a large vocabulary
    the logits' gradient is the largest tensor there is, so this halves (or better) what the pair costs.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int) -> tuple[Tensor, Tensor]:
        B, T, _ = logits.shape
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        ent = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        lse = torch.empty(B, T, dtype=out_dtype, device=logits.device)  # (B, T)
        for sl in _chunks(T, chunk_size):
            zs, m, ls = _log_normalise(_scaled(logits[:, sl], temperature))  # (B, c, V), (B, c), (B, c)
            logq = zs.sub_(ls[..., None])  # (B, c, V) log softmax(z)
            logp[:, sl] = logq.gather(-1, tokens[:, sl, None]).squeeze(-1)
            lse[:, sl] = m + ls
            ent[:, sl] = -logq.exp().mul_(logq).sum(-1)
        ctx.save_for_backward(logits, tokens, lse, ent)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_ent: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, tokens, lse, ent = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for sl in _chunks(logits.shape[1], ctx.chunk_size):
            g = grad_logp[:, sl, None].to(lse.dtype)  # (B, c, 1)
            h = grad_ent[:, sl, None].to(lse.dtype)  # (B, c, 1)
            logq = _scaled(logits[:, sl], tau) - lse[:, sl, None]  # (B, c, V)
            q = logq.exp()
            gz = (logq.add_(ent[:, sl, None]).mul_(h) + g).mul_(q).neg_()  # -q·(g + h·(log q + H))
            gz.scatter_add_(-1, tokens[:, sl, None], g)  # + g·onehot(tok)
            grad[:, sl] = gz / tau if tau != 1.0 else gz
        return grad, None, None, None


class _HeadLogprobsEntropy(torch.autograd.Function):
    r"""The LM head and the log-softmax in one chunked pass: x = h·Wᵀ + b, z = x / τ, q = softmax(z);
    logp = z[tok] − logsumexp(z), H = logsumexp(z) − Σ_v q_v·(z_v − max z) ... see :func:`head_logprobs`.

    Forward writes each chunk's logits into one (R, V) buffer (kept for backward: the only positions × vocabulary
    tensor); backward makes each chunk's g_x = (g·(onehot − q) − e·q·(log q + H)) / τ from it (chunk-sized
    temporaries) and multiplies it out at once: ∂h = g_x·W, ∂W += g_xᵀ·h, ∂b += Σ g_x. No second (R, V) buffer
    is made, and the saved logits are left intact (a retained graph can run backward again).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, chunk_size: int):
        n = hidden.shape[0]
        logits = torch.empty(n, weight.shape[0], dtype=weight.dtype, device=hidden.device)  # (R, V)
        out_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        logp = torch.empty(n, dtype=out_dtype, device=hidden.device)  # (R,)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)  # (R,), (R,)
        for sl in _chunks(n, chunk_size):
            x = torch.matmul(hidden[sl], weight.t(), out=logits[sl])  # (c, V)
            if bias is not None:
                x.add_(bias)
            logp[sl], ent[sl], lse[sl] = _head_stats(x, tokens[sl], temperature)
        ctx.save_for_backward(hidden, weight, tokens, logits, lse, ent)
        ctx.has_bias, ctx.temperature, ctx.chunk_size = bias is not None, temperature, chunk_size
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, tokens, logits, lse, ent = ctx.saved_tensors
        tau = ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None  # (R, D)
        grad_w = grad_b = None  # (V, D), (V,): the first chunk's product, then accumulated (no zero fill)
        for sl in _chunks(hidden.shape[0], ctx.chunk_size):
            g = grad_logp[sl, None].to(lse.dtype)  # (c, 1)
            e = grad_ent[sl, None].to(lse.dtype)  # (c, 1)
            logq = _scaled(logits[sl], tau) - lse[sl, None]  # (c, V): a chunk, the stored logits stay intact
            q = logq.exp()
            gx = logq.add_(ent[sl, None]).mul_(e).add_(g).mul_(q).neg_()  # -q·(g + e·(log q + H))
            gx.scatter_add_(-1, tokens[sl, None], g)  # + g·onehot(tok)
            if tau != 1.0:
                gx.div_(tau)
            gx = gx.to(weight.dtype)  # (c, V)
            if need_h:
                torch.matmul(gx, weight, out=grad_h[sl])  # (c, D)
            if need_w:
                grad_w = gx.t() @ hidden[sl] if grad_w is None else grad_w.addmm_(gx.t(), hidden[sl])  # (V, D)
            if need_b:
                grad_b = gx.sum(0) if grad_b is None else grad_b.add_(gx.sum(0))  # (V,)
        return grad_h, grad_w, grad_b, None, None, None


def _head_stats(x: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """logp (c,), entropy (c,) and logsumexp (c,) of softmax(x / τ) from one chunk of logits x (c, V).

    With zs = z − max z, s = Σ exp(zs): logp = zs[tok] − log s and H = log s − Σ exp(zs)·zs / s, a sum of two
    non-negative terms (zs ≤ 0), so no cancellation; the passes over V are max, subtract, exp, sum and one dot.
    """
    z = _scaled(x, temperature)  # (c, V) float32
    m = z.amax(dim=-1)  # (c,)
    zs = z - m[:, None]  # (c, V) ≤ 0
    ez = zs.exp()  # (c, V)
    s = ez.sum(-1)  # (c,)
    ls = s.log()
    ent = ls - torch.linalg.vecdot(ez, zs) / s  # (c,)
    return zs.gather(-1, tokens[:, None]).squeeze(-1) - ls, ent, m + ls


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Token log-probs and entropies from final hidden states through the LM head, (R, D), (V, D) -> (R,), (R,).

    logits = hidden·Wᵀ + b, z = logits / τ: logp_r = log softmax(z_r)[tokens_r], H_r = −Σ_v q_v log q_v. The
    head's product and the log-softmax run chunk by chunk over the R positions in one pass (float32 softmax
    arithmetic); with gradients the chunk's logits are kept in one (R, V) buffer from which backward makes
    their gradient and multiplies it out chunk by chunk (∂hidden = g_x·W, ∂W = g_xᵀ·hidden), so a step holds one
    positions × vocabulary tensor instead of the logits and their gradient. Without gradients nothing is kept.
    Equal to ``token_logprobs_and_entropy(F.linear(hidden, W, b)[None], tokens[None], τ)`` up to rounding.
    """
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (R, D) and tokens (R,), got {tuple(hidden.shape)}, {tuple(tokens.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_size or default_chunk_size(1, weight.shape[0])
    tokens = tokens.long()
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if needs_grad:
        return _HeadLogprobsEntropy.apply(hidden, weight, bias, tokens, float(temperature), chunk)
    out_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    logp = torch.empty(hidden.shape[0], dtype=out_dtype, device=hidden.device)  # (R,)
    ent = torch.empty_like(logp)
    with torch.no_grad():
        for sl in _chunks(hidden.shape[0], chunk):
            logp[sl], ent[sl], _ = _head_stats(F.linear(hidden[sl], weight, bias), tokens[sl], float(temperature))
    return logp, ent


def _check_logits(logits: Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    r"""Log-probability of each token: log softmax(logits / τ)[tokens], shapes (B, T, V), (B, T) -> (B, T).

    Computed as ``gather(z, tokens) - logsumexp(z)`` with z = logits / τ, chunk by chunk over T in float32
    (bf16/fp16 logits are upcast one chunk at a time; float64 stays float64). Equal to the naive
    ``torch.log_softmax(logits / τ, -1).gather(-1, tokens[..., None])[..., 0]`` up to rounding.

    Gradient: ∂logp_t/∂logits_{t,v} = (1[v = tokens_t] - softmax(z_t)_v) / τ, also computed per chunk.
    ``chunk_size``: positions per chunk; default :func:`default_chunk_size` (≤ 64 MiB per chunk).
    The result is float32 (float64 for float64 logits); no gradient flows to ``tokens``.
    """
    _check_logits(logits, temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != logits (B, T) {tuple(logits.shape[:2])}")
    chunk = chunk_size or default_chunk_size(logits.shape[0], logits.shape[2])
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature), chunk)


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    r"""Entropy of softmax(logits / τ) at each position, (B, T, V) -> (B, T), in nats.

    H = logsumexp(z) - Σ_v q_v z_v with z = logits / τ, q = softmax(z); evaluated as -Σ_v q_v log q_v with
    log q = z - logsumexp(z) (every term ≥ 0, so no cancellation between two large numbers), chunked over T
    in float32 like :func:`token_logprobs`. Gradient: ∂H/∂logits_v = -q_v (log q_v + H) / τ.
    """
    _check_logits(logits, temperature)
    chunk = chunk_size or default_chunk_size(logits.shape[0], logits.shape[2])
    return _TokenEntropy.apply(logits, float(temperature), chunk)


def token_logprobs_and_entropy(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Tensor, Tensor]:
    r""":func:`token_logprobs` and :func:`token_entropy` in one pass, (B, T, V), (B, T) -> (B, T), (B, T).

    Same values; gradients from both outputs are combined per chunk into a single logits gradient
    ∂/∂x [g·logp + h·H] = (g·(onehot(tok) - q) - h·q·(log q + H)) / τ, so with backward the extra memory is
    one logits-sized gradient plus a few chunks, not two gradients and their sum.
    """
    _check_logits(logits, temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != logits (B, T) {tuple(logits.shape[:2])}")
    chunk = chunk_size or default_chunk_size(logits.shape[0], logits.shape[2])
    return _TokenLogprobsEntropy.apply(logits, tokens.long(), float(temperature), chunk)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only: cumsum(mask) - 1, clamped at 0, (B, L) -> (B, L).

    With left padding ``[pad, pad, a, b]`` this gives ``[0, 0, 0, 1]``, so a row's real tokens get the same
    positions as when the row is run alone; padded positions get 0 (their outputs are never used).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    micro_batch_size: int | None = None,
    fast_forward: bool = True,
    packing: bool = True,
) -> tuple[Tensor, Tensor | None]:
    r"""Log-probs (and optionally entropies) of the response tokens under a HF causal LM.

    One forward pass over prompt + response: ``input_ids`` (B, L) holds left-padded prompts in
    ``[:, :response_start]`` and responses in ``[:, response_start:]`` (right padding after EOS is fine; mask
    it downstream). By the shift convention the log-prob of ``input_ids[:, j]`` is read from the logits at
    position j - 1:

        logp[b, t] = log softmax(logits[b, response_start - 1 + t] / τ)[input_ids[b, response_start + t]]

    for t in 0..T_resp-1, T_resp = L - response_start. ``position_ids`` = cumsum(attention_mask) - 1
    (clamped at 0), so left padding does not shift positions: a padded row scores what the same row scores
    alone (up to float rounding; tested at 1e-5). Only the logits of positions ≥ response_start - 1 are
    computed when the model's ``forward`` takes ``logits_to_keep`` (current HF causal LMs do).

    Fast forward (``model.fast_forward``). With ``fast_forward`` (default) and a Llama-family model
    (:func:`klgrad.models.fast_forward.unsupported_reason` is None), rows whose prompt part is identical
    (GRPO's G samples of one prompt) share one pass over the prompt: the distinct prompts run once and the
    response positions attend to their prompt's keys and values
    (:meth:`~klgrad.models.fast_forward.FastForward.shared_prefix_logits`). Same log-probs and gradients (tested
    against this function with ``fast_forward=False`` at 1e-5), fewer positions: P·L + N·(T - 1) instead
    of N·(L + T - 1). Used when every response mask is a run of real tokens followed by padding; otherwise,
    for other models, or with ``fast_forward=False``, one transformers forward over every row.

    Packing (``train.packing``, default). Only real positions are computed: each response from its first token
    through its EOS (or the length cap), nothing after. For Llama-family models with ``fast_forward`` the
    distinct prompts run once and the response positions run packed
    (:meth:`~klgrad.models.fast_forward.FastForward.packed_hidden`), with the LM head and log-softmax fused
    (:func:`head_logprobs`); for other models running flash-attention-2 (varlen kernels, GPU), each row's real
    tokens are concatenated into one row with position ids restarting per row (transformers' packed-sequence
    path, :func:`_packed_transformers_logprobs`). Elsewhere (another attention kernel would compute a dense mask
    over the packed row, every masked pair) the padded forward runs. With ``packing`` padding reads 0.

    Gradients flow when called with grad enabled (policy); call under ``torch.no_grad()`` for a reference
    model. ``micro_batch_size`` splits the rows into forward passes of that many rows (results identical);
    under no_grad that bounds activation memory; with grad every micro-batch's graph is kept until backward.

    Returns:
        ``(logp, entropy)``: (B, T_resp) float32 each; ``entropy`` is None unless ``with_entropy``.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (B, L), got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    B, L = input_ids.shape
    if not 1 <= response_start < L:
        raise ValueError(f"response_start must be in [1, L - 1] = [1, {L - 1}], got {response_start}")
    mb = micro_batch_size or B
    if mb < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if mb < B:
        parts = [
            sequence_logprobs(
                model,
                input_ids[i : i + mb],
                attention_mask[i : i + mb],
                response_start,
                temperature,
                with_entropy=with_entropy,
                fast_forward=fast_forward,
                packing=packing,
            )
            for i in range(0, B, mb)
        ]
        logp = torch.cat([p[0] for p in parts])  # (B, T_resp)
        entropy = torch.cat([p[1] for p in parts]) if with_entropy else None  # (B, T_resp)
        return logp, entropy

    resp_mask = attention_mask[:, response_start:].bool()  # (B, T_resp)
    if packing and _right_padded(resp_mask):
        packed = None
        if fast_forward:
            packed = _packed_fast_logprobs(model, input_ids, attention_mask, response_start, temperature)
        if packed is None and getattr(getattr(model, "config", None), "_attn_implementation", None) in VARLEN:
            packed = _packed_transformers_logprobs(model, input_ids, attention_mask, response_start, temperature)
        if packed is not None:
            return packed[0], (packed[1] if with_entropy else None)
    logp, entropy = _padded_logprobs(
        model, input_ids, attention_mask, response_start, temperature, with_entropy, fast_forward
    )
    if packing:  # the same result as the packed paths: padding reads 0
        logp = logp.masked_fill(~resp_mask, 0.0)
        entropy = None if entropy is None else entropy.masked_fill(~resp_mask, 0.0)
    return logp, entropy


def _padded_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    temperature: float,
    with_entropy: bool,
    fast_forward: bool,
) -> tuple[Tensor, Tensor | None]:
    """(logp, entropy or None) (B, T_resp) from a forward over every position, padding included: each group's
    prompt once (:func:`_shared_prompt_logits`) when ``fast_forward`` applies, else one transformers forward."""
    logits = response_logits(model, input_ids, attention_mask, response_start, fast_forward)  # (B, T_resp, V)
    return _logprobs_entropy(logits, input_ids[:, response_start:], temperature, with_entropy)


def response_logits(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_start: int, fast_forward: bool = True
) -> Tensor:
    """(B, T_resp, V) logits that score the response tokens (position j - 1 predicts token j), padding included."""
    n_resp = input_ids.shape[1] - response_start
    logits = _shared_prompt_logits(model, input_ids, attention_mask, response_start) if fast_forward else None
    if logits is not None:
        return logits
    kwargs = {}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = n_resp + 1  # positions response_start - 1 .. L - 1
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
    return out.logits[:, -(n_resp + 1) : -1]  # (B, T_resp, V): position j - 1 predicts token j


def logprobs_and_next_kl(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    *,
    ref: torch.nn.Module,
    temperature: float = 1.0,
    fast_forward: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""(logp, entropy, KL_t), (B, T_resp) each, for the analytic KL head: the policy's response log-probs and
    entropies and KL_t = KL(π_τ(·|s_t) ‖ π_ref,τ(·|s_t)) (:func:`klgrad.kl.analytic.next_token_kl`), differentiable
    in the policy, from one policy forward and one no-grad reference forward. Padding reads 0. The (B, T_resp, V)
    logits of both models are held for the micro-batch (the padded path's memory, plus the reference's)."""
    from klgrad.kl.analytic import next_token_kl

    logits = response_logits(model, input_ids, attention_mask, response_start, fast_forward)  # (B, T, V)
    with torch.no_grad():
        ref_logits = response_logits(ref, input_ids, attention_mask, response_start, fast_forward)  # (B, T, V)
    logp, entropy = token_logprobs_and_entropy(logits, input_ids[:, response_start:], temperature)  # (B, T) each
    kl = next_token_kl(logits, ref_logits, temperature)  # (B, T)
    pad = ~attention_mask[:, response_start:].bool()  # (B, T)
    return logp.masked_fill(pad, 0.0), entropy.masked_fill(pad, 0.0), kl.masked_fill(pad, 0.0)


def _logprobs_entropy(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """(logp, entropy or None), (B, T_resp) each, from response logits (B, T_resp, V)."""
    if with_entropy:
        return token_logprobs_and_entropy(logits, targets, temperature)
    return token_logprobs(logits, targets, temperature), None


def _shared_prompt_logits(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_start: int
) -> Tensor | None:
    """(B, T_resp, V) response logits computing each distinct prompt once, or None when that path does not
    apply (model not supported, no repeated prompt, or a response mask with a hole)."""
    from klgrad.models.fast_forward import FastForward, unsupported_reason

    if unsupported_reason(model) is not None:
        return None
    if not _right_padded(attention_mask[:, response_start:]):
        return None  # a real token after padding: not the right-padded layout the shared path assumes
    prompt_ids, prompt_mask, owner = _distinct_prompts(input_ids, attention_mask, response_start)
    if prompt_ids.shape[0] == input_ids.shape[0]:
        return None  # nothing shared
    return FastForward(model).shared_prefix_logits(prompt_ids, prompt_mask, owner, input_ids[:, response_start:])


def _distinct_prompts(input_ids: Tensor, attention_mask: Tensor, response_start: int) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct left-padded prompts (U, L) and their masks (U, L) bool, and each row's prompt ``owner`` (B,)."""
    prompts = torch.cat([input_ids[:, :response_start], attention_mask[:, :response_start].long()], dim=1)
    distinct, owner = torch.unique(prompts, dim=0, return_inverse=True)  # (U, 2·L), (B,)
    return distinct[:, :response_start], distinct[:, response_start:].bool(), owner


def _right_padded(resp_mask: Tensor) -> bool:
    """Every response mask (N, T) is a run of real tokens followed by padding (no real token after a pad)."""
    m = resp_mask.bool()
    return not bool((m[:, 1:] & ~m[:, :-1]).any())


def _unpack(values: Tensor, resp_mask: Tensor) -> Tensor:
    """Packed values (R,) of the real response tokens (row-major) into (N, T), 0 at padding; differentiable."""
    return torch.zeros(resp_mask.shape, dtype=values.dtype, device=values.device).masked_scatter(resp_mask, values)


def _packed_fast_logprobs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_start: int, temperature: float
) -> tuple[Tensor, Tensor] | None:
    """(logp, entropy) (N, T) each through :meth:`FastForward.packed_hidden` and :func:`head_logprobs`, or None
    when the model is not one FastForward supports."""
    from klgrad.models.fast_forward import FastForward, unsupported_reason

    if unsupported_reason(model) is not None:
        return None
    resp_mask = attention_mask[:, response_start:].bool()  # (N, T)
    responses = input_ids[:, response_start:]  # (N, T)
    prompt_ids, prompt_mask, owner = _distinct_prompts(input_ids, attention_mask, response_start)
    hidden = FastForward(model).packed_hidden(prompt_ids, prompt_mask, owner, responses, resp_mask.sum(-1))  # (R, D)
    head = model.lm_head
    logp, ent = head_logprobs(hidden, head.weight, head.bias, responses[resp_mask], temperature)  # (R,), (R,)
    return _unpack(logp, resp_mask), _unpack(ent, resp_mask)


def _packed_transformers_logprobs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_start: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """(logp, entropy) (N, T) each from one transformers forward over a single packed row.

    Row n's real tokens (its prompt's, then its response's through EOS) are concatenated into one (1, S) row,
    S = Σ_n real tokens, with position ids 0, 1, ... restarting at each row: transformers reads the restarts as
    sequence boundaries (flash-attention's cumulative lengths; other kernels get a block-diagonal causal mask).
    ``logits_to_keep`` takes the positions that predict a response token, so only those logits are made.
    """
    real = attention_mask.bool()  # (N, L)
    resp_mask = real[:, response_start:]  # (N, T)
    lengths = real.sum(-1)  # (N,)
    positions = (real.long().cumsum(-1) - 1)[real]  # (S,) restarting at 0 in each row
    starts = torch.cumsum(lengths, 0) - lengths  # (N,) offset of each row in the packed row
    prompt_len = real[:, :response_start].sum(-1)  # (N,)
    t = torch.arange(resp_mask.shape[1], device=input_ids.device)[None].expand_as(resp_mask)  # (N, T)
    predictors = (starts[:, None] + prompt_len[:, None] + t - 1)[resp_mask]  # (R,) position before each token
    out = model(
        input_ids=input_ids[real][None],
        position_ids=positions[None],
        use_cache=False,
        logits_to_keep=predictors,
    )
    logp, ent = token_logprobs_and_entropy(out.logits, input_ids[:, response_start:][resp_mask][None], temperature)
    return _unpack(logp[0], resp_mask), _unpack(ent[0], resp_mask)
