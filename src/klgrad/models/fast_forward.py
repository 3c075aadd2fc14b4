r"""A lean functional forward of Llama-family causal LMs for sampling: static KV cache, no per-step framework.

Why. Decoding a small batch is bound by per-step overhead, not arithmetic: a transformers forward per token
builds masks, position embeddings and cache objects through many Python layers. For the embedded 4-layer model at
batch 256 on 2 CPU cores, transformers' ``generate`` took about 9 ms per decode step where the arithmetic needs
about 2.2 ms (docs/performance.md, “Rollout: klgrad's sampler vs transformers `generate`”, measured 2026-11-21).
This module runs the same arithmetic on the model's own parameters (read when the decoder is made, once per
rollout, so every rollout sees the latest optimizer step), with a cache preallocated once per rollout, q/k/v and
gate/up each fused into one matmul, and rows whose response has ended dropped from the computation.

What it computes, per layer ℓ (pre-norm decoder, Llama / Qwen2 / Mistral convention):

    h  = x + W_o · Attn(RoPE(W_q·n₁(x)), RoPE(W_k·n₁(x)), W_v·n₁(x))
    x' = h + W_down · (silu(W_gate·n₂(h)) ⊙ W_up·n₂(h))

with n(x) = w ⊙ x / sqrt(mean(x²) + ε) (RMSNorm, in float32), RoPE
q ↦ q·cos(pθ) + rotate_half(q)·sin(pθ) at the token's position p (θ = the model's ``inv_freq``, cos/sin
times its ``attention_scaling``), grouped-query attention softmax(q·Kᵀ·d^-½ + mask) V with the softmax in
float32, and logits = W_lm · n_final(x). Biases (Qwen2's q/k/v) are used when present. This is exactly what
``transformers``' eager Llama/Qwen2 code computes; tests compare the log-probs with a teacher-forced
transformers forward.

Shapes: P prompts of padded length L, N = P·G sampled rows, H query heads, K key/value heads, d head size,
S = L + max_new_tokens cache slots.

Supported: ``model_type`` llama, qwen2 or mistral, SiLU MLP, a RoPE whose frequencies do not change with
length (not ``dynamic``/``longrope``), no sliding window, no q/k norms; plain LoRA adapters (peft) on any of the
projections, each adding s·(x·Aᵀ)·Bᵀ (see :class:`FastForward`). :func:`unsupported_reason` says why
a model is not; the sampler then uses the transformers forward instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from klgrad.models.lora import LowRank, lora_parts, lora_unsupported_reason

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when :class:`FastForward` reproduces ``model``'s forward, else a short reason."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} not in {SUPPORTED_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a <Model>ForCausalLM with .model.layers and .lm_head"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return "RoPE frequencies that change with length"
    window = getattr(cfg, "sliding_window", None)
    if window and (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        return "sliding-window attention"
    attn = inner.layers[0].self_attn
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return "q/k norms"
    for layer in inner.layers:
        for proj in (*_attention_projections(layer), *_mlp_projections(layer)):
            reason = lora_unsupported_reason(proj)
            if reason is not None:
                return reason
    return None


def _attention_projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    attn = layer.self_attn
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj


def _mlp_projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj


def _rms(x: Tensor, norm: torch.nn.Module) -> Tensor:
    """w ⊙ x / sqrt(mean(x²) + ε), computed in float32, returned in x's dtype (transformers' RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _merged(weight: Tensor, adapters: list[LowRank]) -> Tensor:
    """W + Σ s·B·A (O, D): the weight with its adapters folded in (``weight`` itself when it has none)."""
    for adapter in adapters:
        weight = weight + adapter.delta_weight(weight.dtype)
    return weight


class _Projection:
    r"""y = x·Wᵀ + b for one linear projection or several that read the same input (fused along outputs), with
    the LoRA adapters of their parts (:mod:`klgrad.models.lora`).

    ``merge=True`` folds each adapter into its weight once, W + s·B·A (the projections used while the weights do
    not change: a rollout, a no-grad log-prob pass), so each call is one plain matmul; ``merge=False`` keeps the
    low-rank term, x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ per part, differentiable w.r.t. A and B without a (O, D) weight or its
    gradient per projection (the training forward). Without adapters both are the plain (fused) matmul.
    """

    def __init__(self, linears: tuple[torch.nn.Module, ...], merge: bool) -> None:
        parts = [lora_parts(lin) for lin in linears]  # (W, b, adapters) of each
        weights = [_merged(w, low) if merge else w for w, _, low in parts]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)  # (O, D)
        self.bias = None
        if any(b is not None for _, b, _ in parts):
            self.bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b, _ in parts])  # (O,)
        self.low_rank = [] if merge else [(w.shape[0], low) for w, _, low in parts]
        if all(not low for _, low in self.low_rank):
            self.low_rank = []

    def __call__(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., O)
        if not self.low_rank:
            return y
        deltas = [sum(lr.apply(x) for lr in low) if low else None for _, low in self.low_rank]  # (..., O_i)
        dtype = next(d.dtype for d in deltas if d is not None)  # the adapters' (float32 under peft's casting)
        deltas = [
            d if d is not None else y.new_zeros(*y.shape[:-1], rows, dtype=dtype)
            for d, (rows, _) in zip(deltas, self.low_rank, strict=True)
        ]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)  # (..., O)
        return (y + delta).to(y.dtype)  # added in the wider dtype, as peft's forward does


def _rows(select: Tensor, x: Tensor) -> Tensor:
    """x[owner] as a matmul: select (N, U) one-hot, x (U, ...) -> (N, ...)."""
    return (select @ x.reshape(x.shape[0], -1)).view(select.shape[0], *x.shape[1:])


def _blocks(x: Tensor, flat: Tensor, n: int, m: int) -> Tensor:
    """Packed rows x (R', ...) into zero-padded blocks (n, m, ...) at slots ``flat`` (R',) of the n·m."""
    out = x.new_zeros(n * m, *x.shape[1:]).index_copy(0, flat, x)  # (n·m, ...)
    return out.view(n, m, *x.shape[1:])


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastForward:
    """Prefill and one-token decode steps of a supported HF causal LM, with a static KV cache.

    Use: ``dec = FastForward(model)``; ``logits = dec.prefill(ids, mask, group_size, max_new_tokens)`` gives
    (N, V) next-token logits for N = P·group_size rows (each prompt's cache copied to its G rows); then
    ``logits = dec.step(tokens)`` appends one token per row and gives the next (N, V) logits.
    No gradients (call under ``torch.no_grad()``); :meth:`shared_prefix_logits` is differentiable.

    LoRA (:mod:`klgrad.models.lora`). Each projection's weights are read when the decoder is made, through
    :func:`~klgrad.models.lora.lora_parts`: a peft LoRA layer contributes its frozen base weight W and, when its
    adapter is enabled, A and B with scale s = α/r. ``merge_adapters`` (default: True when the decoder is made
    with gradients disabled, as every sampler and every no-grad log-prob pass does) folds them into
    W + s·B·A once, so decoding runs the plain matmuls at the base model's per-step cost; otherwise (the training
    forward) the low-rank term s·(x·Aᵀ)·Bᵀ is added to x·Wᵀ as peft's own forward does: gradients reach A and B,
    and no (O, D) effective weight or its gradient is made per projection. A reference made by
    :func:`~klgrad.models.lora.base_view` has no adapters: the base weights only.
    """

    def __init__(self, model: torch.nn.Module, *, merge_adapters: bool | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastForward does not support this model: {reason}")
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers[: cfg.num_hidden_layers])
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = self.layers[0].self_attn.scaling
        rotary = self.inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # (d/2,)
        self.rope_scale = float(rotary.attention_scaling)
        # one matmul for q, k, v and one for gate, up: concatenated once per rollout (the weights of this
        # moment; a later optimizer step needs a new FastForward, which the sampler makes per call)
        merge = not torch.is_grad_enabled() if merge_adapters is None else merge_adapters
        self.qkv = [
            _Projection((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), merge)
            for layer in self.layers
        ]
        self.o = [_Projection((layer.self_attn.o_proj,), merge) for layer in self.layers]
        self.gate_up = [_Projection((layer.mlp.gate_proj, layer.mlp.up_proj), merge) for layer in self.layers]
        self.down = [_Projection((layer.mlp.down_proj,), merge) for layer in self.layers]

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (..., d) at integer positions (...,)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (..., d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., d)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def _qkv(self, i: int, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h (..., D) -> q (..., H, d), k (..., K, d), v (..., K, d), q and k rotated."""
        lead = h.shape[:-1]
        qkv = self.qkv[i](h).view(*lead, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = qkv[..., : self.n_heads + self.n_kv, :], qkv[..., self.n_heads + self.n_kv :, :]
        cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
        qk = qk * cos + _rotate_half(qk) * sin  # RoPE on q and k at once
        return qk[..., : self.n_heads, :], qk[..., self.n_heads :, :], v

    def _mlp(self, i: int, h: Tensor) -> Tensor:
        gate, up = self.gate_up[i](h).chunk(2, dim=-1)
        return self.down[i](F.silu(gate) * up)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """q (B, Q, H, d), k/v (B, K, S, d), bias (B, 1, Q, S) additive mask -> (B, Q, H·d)."""
        b, nq = q.shape[0], q.shape[1]
        g = self.n_heads // self.n_kv
        qh = q.view(b, nq, self.n_kv, g, self.head_dim).permute(0, 2, 3, 1, 4)  # (B, K, g, Q, d)
        qh = qh.reshape(b, self.n_kv, g * nq, self.head_dim)  # (B, K, g·Q, d)
        scores = torch.matmul(qh, k.transpose(-1, -2)) * self.scale  # (B, K, g·Q, S)
        scores = scores.view(b, self.n_kv, g, nq, -1) + bias[:, :, None]  # (B, K, g, Q, S)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.view(b, self.n_kv, g * nq, -1), v)  # (B, K, g·Q, d)
        out = out.view(b, self.n_kv, g, nq, self.head_dim).permute(0, 3, 1, 2, 4)  # (B, Q, K, g, d)
        return out.reshape(b, nq, self.n_heads * self.head_dim)

    def _logits(self, x: Tensor) -> Tensor:
        return F.linear(_rms(x, self.inner.norm), self.model.lm_head.weight, self.model.lm_head.bias)

    def _causal_bias(self, mask: Tensor) -> Tensor:
        """(B, 1, L, L) additive mask over left-padded rows ``mask`` (B, L): key j visible from query i when
        j ≤ i and j is a real token; a padded query sees itself only (finite, and never read)."""
        length = mask.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()  # (L, L)
        allowed = (causal & mask[:, None, :]) | torch.eye(length, dtype=torch.bool, device=mask.device)
        dtype = self.inner.embed_tokens.weight.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, float("-inf"))[:, None]

    def shared_prefix_logits(self, prompt_ids: Tensor, prompt_mask: Tensor, owner: Tensor, responses: Tensor) -> Tensor:
        r"""Teacher-forced logits of N responses whose prompts are U ≤ N distinct rows, each prompt run once.

        ``prompt_ids``/``prompt_mask`` (U, L) left-padded distinct prompts, ``owner`` (N,) the prompt of each
        response, ``responses`` (N, T). Returns (N, T, V): entry [n, t] is the distribution of
        ``responses[n, t]``, i.e. the logits at the position before it (the last prompt position for t = 0).

        The prompt positions go through the layers once per distinct prompt; the N·(T - 1) response positions
        attend to their prompt's keys/values (indexed by ``owner``, so in backward the G rows' gradients
        add up on the shared prompt) and causally to their own. With GRPO's P prompts × G samples the model
        runs P·L + N·(T - 1) positions instead of N·(L + T - 1). Differentiable (autograd reaches the model's
        parameters); the response rows are assumed right-padded after their end (causal attention makes
        what follows the last real token irrelevant to the positions before it).
        """
        mask = prompt_mask.bool()  # (U, L)
        length = mask.shape[1]
        n, t_len = responses.shape
        dtype = self.inner.embed_tokens.weight.dtype
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (U, L)
        cos_p, sin_p = self._rope(positions, dtype)  # (U, L, d)
        bias_p = self._causal_bias(mask)  # (U, 1, L, L)
        x_p = F.embedding(prompt_ids, self.inner.embed_tokens.weight)  # (U, L, D)
        # row n reads its prompt's tensors through a one-hot (N, U) matmul: forward and backward (the sum
        # of the G rows' gradients onto their prompt) are plain GEMMs; indexing's backward (an accumulating
        # index_put) cost 10% of the update step on CPU
        select = F.one_hot(owner, prompt_ids.shape[0]).to(dtype)  # (N, U)
        m = t_len - 1  # response positions that predict a next response token
        if m > 0:
            steps = torch.arange(m, device=responses.device)
            pos_s = positions[owner, -1:] + 1 + steps  # (N, m)
            cos_s, sin_s = self._rope(pos_s, dtype)  # (N, m, d)
            own = torch.ones(m, m, dtype=torch.bool, device=responses.device).tril()  # (m, m) causal
            seen = torch.cat([mask[owner][:, None, :].expand(n, m, length), own.expand(n, m, m)], dim=-1)
            bias_s = torch.zeros(seen.shape, dtype=dtype, device=responses.device)
            bias_s = bias_s.masked_fill(~seen, float("-inf"))[:, None]  # (N, 1, m, L + m)
            x_s = F.embedding(responses[:, :m], self.inner.embed_tokens.weight)  # (N, m, D)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, _rms(x_p, layer.input_layernorm), cos_p, sin_p)  # (U, L, ·, d)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (U, K, L, d) this layer's prompt keys/values
            x_p = x_p + self.o[i](self._attend(q, k, v, bias_p))
            x_p = x_p + self._mlp(i, _rms(x_p, layer.post_attention_layernorm))
            if m > 0:
                qs, ks, vs = self._qkv(i, _rms(x_s, layer.input_layernorm), cos_s, sin_s)  # (N, m, ·, d)
                k_all = torch.cat([_rows(select, k), ks.transpose(1, 2)], dim=2)  # (N, K, L + m, d)
                v_all = torch.cat([_rows(select, v), vs.transpose(1, 2)], dim=2)
                x_s = x_s + self.o[i](self._attend(qs, k_all, v_all, bias_s))
                x_s = x_s + self._mlp(i, _rms(x_s, layer.post_attention_layernorm))
        first = _rows(select, self._logits(x_p[:, -1]))[:, None]  # (N, 1, V)
        return torch.cat([first, self._logits(x_s)], dim=1) if m > 0 else first  # (N, T, V)

    def packed_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, owner: Tensor, responses: Tensor, lengths: Tensor
    ) -> Tensor:
        r"""Final-norm hidden states of the positions that predict the N responses' real tokens, packed: (R, D).

        Like :meth:`shared_prefix_logits` (``prompt_ids``/``prompt_mask`` (U, L) the distinct left-padded prompts,
        run once each; ``owner`` (N,) the prompt of each response; ``responses`` (N, T)), but only real positions
        are computed: response n has ``lengths[n]`` real tokens (then padding), so the layers run the U·L prompt
        positions and R' = Σ_n (lengths[n] − 1) response positions, nothing after an EOS. Row r of the result,
        in the order of ``responses[n, t]`` for t < lengths[n] (row-major, i.e. ``response_mask`` flattened), is
        the hidden state whose LM head gives the distribution of that token: the prompt's last position for
        t = 0, response position t − 1 otherwise. Apply the head with :func:`klgrad.logprobs.head_logprobs`.

        The per-position work (every projection, MLP, norm and the LM head) runs on the packed (R', D) rows.
        Attention, per layer, scatters the packed queries, keys and values into one (N, m) block per response
        (m = max length − 1) and attends to its prompt's keys (shared through ``owner``) and causally to its
        own: the padded slots of those blocks are the only work on padding, N·m·(L + m) score entries against
        Σ_n (lengths[n] − 1)·(L + ...) useful ones; attention is ~1-2% of a step's FLOPs at these lengths.
        Differentiable; the gathers and scatters are index copies with unique indices.
        """
        mask = prompt_mask.bool()  # (U, L)
        length = mask.shape[1]
        n = responses.shape[0]
        device = responses.device
        dtype = self.inner.embed_tokens.weight.dtype
        lengths = lengths.long()
        m = max(int(lengths.max()) - 1, 0) if n else 0  # response positions per block
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (U, L)
        cos_p, sin_p = self._rope(positions, dtype)  # (U, L, d)
        bias_p = self._causal_bias(mask)  # (U, 1, L, L)
        x_p = F.embedding(prompt_ids, self.inner.embed_tokens.weight)  # (U, L, D)
        select = F.one_hot(owner, prompt_ids.shape[0]).to(dtype)  # (N, U) as in shared_prefix_logits
        slot = torch.arange(m, device=device)  # (m,)
        inputs = slot[None] < (lengths[:, None] - 1)  # (N, m) response tokens that predict a next real token
        row, t = inputs.nonzero(as_tuple=True)  # (R',), (R',) packed order: row-major
        flat = row * m + t  # (R',) slot of each packed position in the (N·m) blocks
        if m > 0:
            cos_s, sin_s = self._rope(positions[owner[row], -1] + 1 + t, dtype)  # (R', d)
            own = torch.ones(m, m, dtype=torch.bool, device=device).tril()  # (m, m) causal
            seen = torch.cat([mask[owner][:, None, :].expand(n, m, length), own.expand(n, m, m)], dim=-1)
            bias_s = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))[:, None]
            x_s = F.embedding(responses[row, t], self.inner.embed_tokens.weight)  # (R', D)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, _rms(x_p, layer.input_layernorm), cos_p, sin_p)  # (U, L, ·, d)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (U, K, L, d)
            x_p = x_p + self.o[i](self._attend(q, k, v, bias_p))
            x_p = x_p + self._mlp(i, _rms(x_p, layer.post_attention_layernorm))
            if m > 0:
                qs, ks, vs = self._qkv(i, _rms(x_s, layer.input_layernorm), cos_s, sin_s)  # (R', ·, d)
                qb, kb, vb = (_blocks(z, flat, n, m) for z in (qs, ks, vs))  # (N, m, ·, d)
                k_all = torch.cat([_rows(select, k), kb.transpose(1, 2)], dim=2)  # (N, K, L + m, d)
                v_all = torch.cat([_rows(select, v), vb.transpose(1, 2)], dim=2)
                out = self._attend(qb, k_all, v_all, bias_s)  # (N, m, H·d)
                x_s = x_s + self.o[i](out.reshape(n * m, -1).index_select(0, flat))  # (R', D)
                x_s = x_s + self._mlp(i, _rms(x_s, layer.post_attention_layernorm))
        first = _rows(select, _rms(x_p[:, -1], self.inner.norm))  # (N, D) predicts each response's token 0
        if m == 0:
            return first[lengths > 0]
        hidden = torch.cat([first, _rms(x_s, self.inner.norm)])  # (N + R', D)
        # packed order of the real tokens (n, t): t = 0 reads first[n], t ≥ 1 the packed input (n, t − 1)
        real = torch.arange(m + 1, device=device)[None] < lengths[:, None]  # (N, m + 1)
        source = torch.full(real.shape, -1, dtype=torch.long, device=device)  # (N, m + 1)
        source[:, 0] = torch.arange(n, device=device)
        source[row, t + 1] = n + torch.arange(row.numel(), device=device)
        return hidden.index_select(0, source[real])  # (R, D)

    @torch.no_grad()
    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, max_new_tokens: int) -> Tensor:
        """Run the P left-padded prompts once, fill every row's cache; returns (P·G, V) next-token logits."""
        mask = prompt_mask.bool()  # (P, L)
        p, length = mask.shape
        g = group_size
        n, slots = p * g, length + max_new_tokens
        dtype = self.inner.embed_tokens.weight.dtype
        device = prompt_ids.device
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (P, L) left padding does not shift positions
        cos, sin = self._rope(positions, dtype)  # (P, L, d)
        bias = self._causal_bias(mask)  # (P, 1, L, L)
        self.k_cache = torch.zeros(len(self.layers), n, self.n_kv, slots, self.head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        x = F.embedding(prompt_ids, self.inner.embed_tokens.weight)  # (P, L, D)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, _rms(x, layer.input_layernorm), cos, sin)  # (P, L, ·, d)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (P, K, L, d)
            self.k_cache[i, :, :, :length] = k.repeat_interleave(g, dim=0)
            self.v_cache[i, :, :, :length] = v.repeat_interleave(g, dim=0)
            x = x + self.o[i](self._attend(q, k, v, bias))
            x = x + self._mlp(i, _rms(x, layer.post_attention_layernorm))
        self.bias = torch.full((n, slots), float("-inf"), dtype=dtype, device=device)  # (N, S) additive mask
        self.bias[:, :length].masked_fill_(mask.repeat_interleave(g, dim=0), 0.0)
        self.next_pos = positions[:, -1].repeat_interleave(g, dim=0) + 1  # (N,)
        self.filled = length
        return self._logits(x[:, -1]).repeat_interleave(g, dim=0)  # (N, V)

    @torch.no_grad()
    def step(self, tokens: Tensor, keep: Tensor | None = None) -> Tensor:
        """Append ``tokens`` (R,) at the next slot and return the (R, V) logits for the token after them.

        ``keep`` (R,) indices into the current rows, when given, first drops every other row from the cache
        (finished responses): later steps compute only the rows still decoding. ``tokens`` are then the kept
        rows' tokens, in ``keep`` order.
        """
        if keep is not None:
            self.k_cache = self.k_cache[:, keep]
            self.v_cache = self.v_cache[:, keep]
            self.bias, self.next_pos = self.bias[keep], self.next_pos[keep]
        s = self.filled
        if s >= self.k_cache.shape[3]:
            raise RuntimeError("FastForward cache full: more steps than max_new_tokens")
        self.bias[:, s] = 0.0  # the new slot is attended from now on
        bias = self.bias[:, None, None, : s + 1]  # (R, 1, 1, s+1)
        dtype = self.k_cache.dtype
        cos, sin = self._rope(self.next_pos, dtype)  # (R, d)
        x = F.embedding(tokens, self.inner.embed_tokens.weight)  # (R, D)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, _rms(x, layer.input_layernorm), cos, sin)  # (R, ·, d)
            self.k_cache[i, :, :, s] = k
            self.v_cache[i, :, :, s] = v
            out = self._attend(q[:, None], self.k_cache[i, :, :, : s + 1], self.v_cache[i, :, :, : s + 1], bias)
            x = x + self.o[i](out[:, 0])
            x = x + self._mlp(i, _rms(x, layer.post_attention_layernorm))
        self.filled = s + 1
        self.next_pos = self.next_pos + 1
        return self._logits(x)  # (R, V)
