r"""Rollout samplers behind one small interface: klgrad's KV-cache sampler and transformers ``generate``.

A sampler turns left-padded prompts (P prompts) into P·G responses, groups contiguous (rows
``[i*G:(i+1)*G]`` answer prompt i), and returns the sampler's own per-token log-probs of what it drew:
log softmax(logits / temperature) at the drawn token, i.e. the policy being trained at the sampling
temperature. With ``top_p < 1`` the *behaviour* distribution is the truncated one; the returned log-probs are
still the untruncated policy's, and an off-policy correction must account for the truncation.

Convention: response token j is predicted by the logits at the previous position (the one shift convention,
the same as :func:`klgrad.logprobs.sequence_logprobs`). After EOS a response is padded with ``pad_id`` and
masked out; a response that reaches ``max_new_tokens`` without EOS is marked truncated.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from klgrad.models.fast_forward import FastForward, unsupported_reason
from klgrad.rollout.batch import Rollout, Sampler


def _check_uniforms(uniforms: Tensor, n: int, max_new_tokens: int) -> Tensor:
    if uniforms.shape != (n, max_new_tokens):
        raise ValueError(f"uniforms must be (N, max_new_tokens) = ({n}, {max_new_tokens}), got {tuple(uniforms.shape)}")
    return uniforms


def _sample(logits: Tensor, temperature: float, top_p: float, greedy: bool, u: Tensor) -> tuple[Tensor, Tensor]:
    """Draw one token per row from logits (N, V) by inverse CDF; return (tokens (N,), log-prob at temperature (N,)).

    Row n takes the first token v with F_n(v) > u_n·F_n(V), F_n the cumulative (top-p truncated) probabilities
    and ``u`` (N,) uniforms in [0, 1). One uniform per row and step, whatever the vocabulary: the draw of a
    row depends only on its own logits and uniform, so a batch split across processes draws the same tokens.
    """
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V)
    if greedy:
        tok = logprobs.argmax(-1)  # (N,)
    else:
        probs = logprobs.exp()  # (N, V)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)  # (N, V)
            drop = sorted_p.cumsum(-1) - sorted_p > top_p  # (N, V) keep the smallest set with mass >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)  # (N, V)
        cdf = probs.cumsum(-1)  # (N, V)
        target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]  # (N, 1)
        tok = (cdf <= target).sum(-1).clamp(max=probs.shape[-1] - 1)  # (N,) first v with F(v) > u·F(V)
        # a zero-probability token can only be hit through float ties at the edge: step back to a live one
        dead = probs.gather(-1, tok[:, None]).squeeze(-1) == 0  # (N,)
        tok = torch.where(dead, probs.argmax(-1), tok)  # no host sync per decode step
    return tok, logprobs.gather(-1, tok[:, None]).squeeze(-1)


def draw_uniforms(n: int, max_new_tokens: int, generator: torch.Generator | None) -> Tensor:
    """(n, max_new_tokens) uniforms in [0, 1): the only randomness a sampler uses (row n, step t -> u[n, t])."""
    return torch.rand(n, max_new_tokens, generator=generator)


def _finish(
    tokens: list[Tensor],
    logps: list[Tensor],
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
) -> Rollout:
    resp = torch.stack(tokens, dim=1)  # (N, T)
    lp = torch.stack(logps, dim=1)  # (N, T)
    is_eos = resp == eos_id  # (N, T)
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # (N, T) strictly after the first EOS
    mask = ~after_eos
    resp = resp.masked_fill(~mask, pad_id)
    lp = lp.masked_fill(~mask, 0.0)
    truncated = (
        ~is_eos.any(-1)
        if resp.shape[1] == max_new_tokens
        else torch.zeros(resp.shape[0], dtype=torch.bool, device=resp.device)
    )
    return Rollout(prompt_ids, prompt_mask, resp, mask, lp, truncated)


COMPACT_BELOW = 0.75
"""Fast path: once the rows still decoding are at most this fraction of the rows computed, the finished ones
are dropped from the cache (one copy of the cache each time, so at most a few copies per rollout)."""


def cast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A detached copy of ``model`` with every floating parameter and buffer in ``dtype`` (eval mode, no grad):
    its forward then computes in ``dtype`` (weights and activations), as an inference engine's does."""
    twin = copy.deepcopy(model).to(dtype).eval()
    twin.requires_grad_(False)
    return twin


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """target ← source, parameter by parameter and buffer by buffer, each rounded to the target's dtype
    (round-to-nearest: bf16 keeps 8 significant bits, so |w_target − w| ≤ 2⁻⁹·|w|)."""
    theirs = target.state_dict()
    for name, value in source.state_dict().items():
        theirs[name].copy_(value)


class KlgradSampler:
    """klgrad's batched sampler: prefill each prompt once, copy its KV cache to the G samples, decode.

    Llama-family models (llama, qwen2, mistral; see :mod:`klgrad.models.fast_forward`) decode through
    :class:`~klgrad.models.fast_forward.FastForward`, a functional forward on the model's own weights with a
    static cache; ``fast_forward=False`` (config ``model.fast_forward``), or any other HF causal LM that accepts
    ``past_key_values`` and ``position_ids``, uses the transformers forward with a ``DynamicCache``. Decoding
    stops when every response has produced EOS or after ``max_new_tokens`` steps.

    ``dtype`` (config ``rollout.sampler_dtype``): sample instead from a copy of the model cast to ``dtype``
    (weights and activations, e.g. bfloat16), as an inference engine does. The copy is made on the first
    :meth:`generate` with a model and refreshed by :meth:`sync_weights` (the trainer calls it after every
    update); the returned log-probs are the copy's, log softmax(float(z_dtype) / temperature), so they differ from
    the trainer's float32 recomputation by the engine's rounding. ``None``: the model itself (no mismatch).
    """

    def __init__(
        self, eos_id: int, pad_id: int, *, fast_forward: bool = True, dtype: torch.dtype | None = None
    ) -> None:
        self.eos_id, self.pad_id = eos_id, pad_id
        self.fast_forward = fast_forward
        self.dtype = dtype
        self._source: torch.nn.Module | None = None  # the model the copy was made from
        self._copy: torch.nn.Module | None = None

    def sync_weights(self, model: torch.nn.Module) -> None:
        """With ``dtype``: the copy takes ``model``'s current weights (rounded to ``dtype``). Otherwise nothing:
        it samples from ``model`` itself (:class:`~klgrad.rollout.batch.Sampler`)."""
        if self.dtype is None:
            return
        if self._source is model and self._copy is not None:
            copy_weights(model, self._copy)
        else:
            self._source, self._copy = model, cast_copy(model, self.dtype)

    def in_model_dtype(self) -> KlgradSampler:
        """The same sampler on the model itself, in its own arithmetic (held-out evaluation measures the trained
        policy, not the engine's rounding of it)."""
        return KlgradSampler(self.eos_id, self.pad_id, fast_forward=self.fast_forward)

    def engine_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module that samples for ``model``: ``model`` itself, or with ``dtype`` its cast copy (made from
        ``model`` when the copy is of another module or there is none yet; refreshed only by sync_weights)."""
        if self.dtype is None:
            return model
        if self._source is not model or self._copy is None:
            self._source, self._copy = model, cast_copy(model, self.dtype)
        return self._copy

    def uses_fast_path(self, model: torch.nn.Module) -> bool:
        return self.fast_forward and unsupported_reason(model) is None

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        uniforms: Tensor | None = None,
    ) -> Rollout:
        """``uniforms`` (P·G, max_new_tokens) in [0, 1), when given, replace draws from ``generator``."""
        prompt_mask = prompt_mask.bool()
        model = self.engine_model(model)
        fast = self.uses_fast_path(model)
        if fast:
            decoder = FastForward(model)
            last_logits = decoder.prefill(prompt_ids, prompt_mask, group_size, max_new_tokens)  # (N, V)
            advance = decoder.step
        else:
            last_logits, advance = _hf_decoder(model, prompt_ids, prompt_mask, group_size)
        n, device = last_logits.shape[0], last_logits.device
        u_all = _check_uniforms(uniforms, n, max_new_tokens) if uniforms is not None else None
        if u_all is None and not greedy:
            u_all = draw_uniforms(n, max_new_tokens, generator)  # on the CPU generator's device
        u_all = u_all.to(device) if u_all is not None else None
        done = torch.zeros(n, dtype=torch.bool, device=device)
        alive = torch.arange(n, device=device)  # rows the decoder still computes (finished rows are dropped)
        tokens: list[Tensor] = []
        logps: list[Tensor] = []
        for step in range(max_new_tokens):
            u = u_all[alive, step] if u_all is not None else None  # (A,)
            tok_a, lp_a = _sample(last_logits, temperature, top_p, greedy, u)  # (A,), (A,)
            done_a = done[alive]  # finished but not yet dropped: pad
            tok_a = torch.where(done_a, torch.full_like(tok_a, self.pad_id), tok_a)
            tok = torch.full((n,), self.pad_id, dtype=tok_a.dtype, device=device)
            tok[alive] = tok_a
            lp = torch.zeros(n, dtype=lp_a.dtype, device=device)
            lp[alive] = torch.where(done_a, torch.zeros_like(lp_a), lp_a)
            tokens.append(tok)
            logps.append(lp)
            done[alive] = done_a | (tok_a == self.eos_id)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            live = ~done[alive]  # (A,)
            if fast and int(live.sum()) <= COMPACT_BELOW * alive.numel():
                keep = live.nonzero().squeeze(1)  # drop finished rows from the decoder
                alive = alive[keep]
                last_logits = advance(tok_a[keep], keep)
            else:
                last_logits = advance(tok_a)  # (A, V)
        rep_ids = prompt_ids.repeat_interleave(group_size, dim=0)
        rep_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        return _finish(tokens, logps, self.eos_id, self.pad_id, max_new_tokens, rep_ids, rep_mask)


def _hf_decoder(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int):
    """Prefill through the transformers forward; returns (N, V) logits and a ``step(tokens) -> logits``."""
    from transformers import DynamicCache

    position = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (P, L) left padding allowed
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        position_ids=position,
        past_key_values=DynamicCache(),
        use_cache=True,
    )  # prefill once per prompt
    cache = out.past_key_values
    cache.batch_repeat_interleave(group_size)  # (P·G, ...) every sample shares its prompt's prefill
    state = {
        "attn": prompt_mask.repeat_interleave(group_size, dim=0).long(),  # (N, L + steps)
        "pos": position[:, -1:].repeat_interleave(group_size, dim=0) + 1,  # (N, 1)
    }

    def step(tok: Tensor) -> Tensor:
        n = tok.shape[0]
        state["attn"] = torch.cat([state["attn"], torch.ones(n, 1, dtype=torch.long, device=tok.device)], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=state["attn"],
            position_ids=state["pos"],
            past_key_values=cache,
            use_cache=True,
        )
        state["pos"] = state["pos"] + 1
        return out.logits[:, -1]  # (N, V)

    return out.logits[:, -1].repeat_interleave(group_size, dim=0), step


class HFGenerateSampler:
    """transformers ``generate`` behind the same interface (prompts repeated G times, logits returned)."""

    def __init__(self, eos_id: int, pad_id: int) -> None:
        self.eos_id, self.pad_id = eos_id, pad_id

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing: ``generate`` runs ``model`` itself (:class:`~klgrad.rollout.batch.Sampler`)."""

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        if generator is not None:  # generate draws from the global RNG: seed it from ours
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        ids = prompt_ids.repeat_interleave(group_size, dim=0)
        mask = prompt_mask.bool().repeat_interleave(group_size, dim=0)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_p=top_p if not greedy else None,
            top_k=0,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        resp = out.sequences[:, ids.shape[1] :]  # (N, T)
        tokens = [resp[:, j] for j in range(resp.shape[1])]
        logps = [
            torch.log_softmax(lg.float() / temperature, -1).gather(-1, t[:, None]).squeeze(-1)
            for lg, t in zip(out.logits, tokens, strict=True)
        ]
        return _finish(tokens, logps, self.eos_id, self.pad_id, max_new_tokens, ids, mask)


def _vllm_sampler(eos_id: int, pad_id: int, **options) -> Sampler:
    """vLLM, imported only here (GPU machines; ``pip install 'klgrad[vllm]'``)."""
    from klgrad.rollout.vllm_engine import VLLMSampler

    return VLLMSampler(eos_id, pad_id, **options)


SAMPLERS = {"klgrad": KlgradSampler, "hf": HFGenerateSampler, "vllm": _vllm_sampler}


def make_sampler(engine: str, eos_id: int, pad_id: int, **options) -> Sampler:
    """``klgrad`` (KV-cache), ``hf`` (transformers generate) or ``vllm`` (GPU; built lazily).

    ``options``: ``fast_forward`` and ``dtype`` for ``klgrad`` (see :class:`KlgradSampler`); the
    vLLM sampler's own (see
    :class:`klgrad.rollout.vllm_engine.VLLMSampler`).
    """
    if engine not in SAMPLERS:
        raise ValueError(f"rollout.engine must be one of {sorted(SAMPLERS)}, got {engine!r}")
    allowed = {"klgrad": {"fast_forward", "dtype"}, "hf": set()}.get(engine)
    if allowed is not None and set(options) - allowed:
        raise ValueError(f"rollout.engine {engine!r} takes only {sorted(allowed)}, got {sorted(options)}")
    return SAMPLERS[engine](eos_id, pad_id, **options)
