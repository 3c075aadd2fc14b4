r"""Enumerable autoregressive tabular policies: exact expected gradients by summing over every response.

A policy over responses y = (y_1..y_T) with vocabulary {0..V-1} is a table of logits θ[s, v], one row per
*state* s (a prefix that has not ended). With ``eos=True`` token 0 ends a response (it is scored, then the
response stops), otherwise every response has exactly T tokens. There are Σ_{k<T} (V-1)^k states (V^k
without EOS), and every response is enumerated, so any expectation E_{y~q}[f(y)] is an exact finite sum.

The expected gradient of a per-sample loss ℓ(y; θ) under samples from a (detached) distribution q is
∇_θ Σ_y q(y) ℓ(y; θ): this is how the audit and the tests check each head's documented gradient, using the
library's own :func:`klgrad.kl.kl_loss_per_sequence` on a batch that holds every response once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TabularSpace:
    """All states and all responses of a tabular autoregressive policy.

    Attributes:
        vocab: V, number of tokens (token 0 is EOS when ``eos``).
        length: T, maximum response length.
        eos: whether token 0 ends a response.
        states: the prefixes (tuples) at which a token is drawn; ``states[0] == ()``.
        state_index: (N, T) long, state of each token position (0 at padding).
        tokens: (N, T) long, token ids (0 at padding).
        mask: (N, T) bool, True where the response has a token.
        prefix_states: (S, T) long and prefix_mask (S, T) bool: the path of tokens leading to each state,
            used for state reach probabilities.
    """

    vocab: int
    length: int
    eos: bool
    states: tuple[tuple[int, ...], ...]
    state_index: Tensor
    tokens: Tensor
    mask: Tensor
    prefix_state_index: Tensor
    prefix_tokens: Tensor
    prefix_mask: Tensor

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def lengths(self) -> Tensor:
        """(N,) response lengths."""
        return self.mask.sum(-1)


def build_space(vocab: int, length: int, eos: bool = True) -> TabularSpace:
    """Enumerate states and responses. vocab >= 2, length >= 1; keep V^T small (the audit uses ≤ ~10^4)."""
    if vocab < 2 or length < 1:
        raise ValueError(f"need vocab >= 2 and length >= 1, got vocab={vocab}, length={length}")
    if vocab**length > 200_000:
        raise ValueError(f"vocab**length = {vocab**length} responses is too many to enumerate (max 200000)")
    live = range(1, vocab) if eos else range(vocab)
    states = [p for k in range(length) for p in itertools.product(live, repeat=k)]
    index = {p: i for i, p in enumerate(states)}
    seqs: list[tuple[int, ...]] = []
    for p in states:  # a response ends with EOS after a live prefix ...
        if eos:
            seqs.append((*p, 0))
    if not eos:
        seqs = []
    seqs += list(itertools.product(live, repeat=length))  # ... or runs to the full length
    n, t = len(seqs), length
    state_index = torch.zeros(n, t, dtype=torch.long)
    tokens = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i, y in enumerate(seqs):
        for j, tok in enumerate(y):
            state_index[i, j], tokens[i, j], mask[i, j] = index[y[:j]], tok, True
    s = len(states)
    p_state = torch.zeros(s, max(t - 1, 1), dtype=torch.long)
    p_tok = torch.zeros(s, max(t - 1, 1), dtype=torch.long)
    p_mask = torch.zeros(s, max(t - 1, 1), dtype=torch.bool)
    for i, p in enumerate(states):
        for j, tok in enumerate(p):
            p_state[i, j], p_tok[i, j], p_mask[i, j] = index[p[:j]], tok, True
    return TabularSpace(vocab, length, eos, tuple(states), state_index, tokens, mask, p_state, p_tok, p_mask)


def random_logits(space: TabularSpace, generator: torch.Generator, scale: float = 1.0) -> Tensor:
    """(S, V) float64 logits with i.i.d. N(0, scale²) entries."""
    return scale * torch.randn(space.num_states, space.vocab, generator=generator, dtype=torch.float64)


def token_logps(space: TabularSpace, logits: Tensor) -> Tensor:
    """Per-token log-probs of every response, (S, V) -> (N, T); 0 at padding. Differentiable in logits."""
    logp_table = torch.log_softmax(logits, dim=-1)  # (S, V)
    lp = logp_table[space.state_index, space.tokens]  # (N, T)
    return torch.where(space.mask, lp, torch.zeros((), dtype=lp.dtype))


def sequence_logps(space: TabularSpace, logits: Tensor) -> Tensor:
    """log π(y) of every response, (S, V) -> (N,)."""
    return token_logps(space, logits).sum(-1)


def state_log_reach(space: TabularSpace, logits: Tensor) -> Tensor:
    """log P(reach state s) = Σ log-probs along its prefix, (S, V) -> (S,)."""
    logp_table = torch.log_softmax(logits, dim=-1)  # (S, V)
    lp = logp_table[space.prefix_state_index, space.prefix_tokens]  # (S, T-1)
    return torch.where(space.prefix_mask, lp, torch.zeros((), dtype=lp.dtype)).sum(-1)


# ----------------------------------------------------------------------------------------------------------
# exact objectives whose gradients are the documented targets


def exact_objective(space: TabularSpace, target: str, logits: Tensor, ref_logits: Tensor) -> Tensor:
    r"""Scalar whose gradient w.r.t. ``logits`` is the named target (see :mod:`klgrad.kl`).

    rkl: Σ_y π log(π/π_ref);  fkl: Σ_y π_ref log(π_ref/π);  mse: ½ Σ_y (π - π_ref)²;
    js: ½ Σ_y [π log(2π/(π + π_ref)) + π_ref log(2π_ref/(π + π_ref))] (Jensen–Shannon);
    local_{rkl,fkl,mse,js}: Σ_s sg(P(s)) D(π(·|s), π_ref(·|s));  expected_length: Σ_y π(y)|y|;  zero: 0.
    Length-weighted (what a per-sequence token mean 1/|y| can reach): rkl_per_token: Σ_y π log(π/π_ref)/|y|;
    fkl_per_token: Σ_y π_ref log(π_ref/π)/|y|;  inverse_length: Σ_y π(y)/|y|.
    """
    if target in ("rkl", "fkl", "mse", "js", "expected_length", "rkl_per_token", "fkl_per_token", "inverse_length"):
        lp = sequence_logps(space, logits)  # (N,)
        lr = sequence_logps(space, ref_logits).detach()  # (N,)
        p, pr = lp.exp(), lr.exp()
        if target == "rkl":
            return (p * (lp - lr)).sum()
        if target == "fkl":
            return (pr * (lr - lp)).sum()
        if target == "mse":
            return 0.5 * ((p - pr) ** 2).sum()
        if target == "js":
            return _js(p, lp, pr, lr).sum()
        length = space.lengths.to(p.dtype)  # (N,)
        if target == "rkl_per_token":
            return (p * (lp - lr) / length).sum()
        if target == "fkl_per_token":
            return (pr * (lr - lp) / length).sum()
        if target == "inverse_length":
            return (p / length).sum()
        return (p * length).sum()
    if target.startswith("local_"):
        reach = state_log_reach(space, logits).detach().exp()  # (S,)
        lp = torch.log_softmax(logits, -1)  # (S, V)
        lr = torch.log_softmax(ref_logits, -1).detach()  # (S, V)
        p, pr = lp.exp(), lr.exp()
        if target == "local_rkl":
            per_state = (p * (lp - lr)).sum(-1)
        elif target == "local_fkl":
            per_state = (pr * (lr - lp)).sum(-1)
        elif target == "local_mse":
            per_state = 0.5 * ((p - pr) ** 2).sum(-1)
        elif target == "local_js":
            per_state = _js(p, lp, pr, lr).sum(-1)
        else:
            raise ValueError(f"unknown target {target!r}")
        return (reach * per_state).sum()
    if target == "zero":
        return logits.sum() * 0.0
    raise ValueError(f"unknown target {target!r}")


def _js(p: Tensor, lp: Tensor, pr: Tensor, lr: Tensor) -> Tensor:
    """Elementwise ½[p log(2p/(p + pr)) + pr log(2pr/(p + pr))] from probabilities and their logs."""
    lm = torch.logaddexp(lp, lr) - math.log(2.0)  # log of the mixture (p + pr)/2
    return 0.5 * (p * (lp - lm) + pr * (lr - lm))


def exact_gradient(space: TabularSpace, target: str, logits: Tensor, ref_logits: Tensor) -> Tensor:
    """∇_θ of :func:`exact_objective`, (S, V)."""
    theta = logits.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(exact_objective(space, target, theta, ref_logits), theta, allow_unused=True)
    return torch.zeros_like(theta) if g is None else g


def expected_gradient(
    space: TabularSpace,
    per_sequence_loss,
    logits: Tensor,
    sampling_logits: Tensor,
    *,
    with_variance: bool = False,
) -> tuple[Tensor, float | None]:
    r"""E_{y~q}[∇_θ ℓ(y)] exactly, with q = softmax policy of ``sampling_logits`` (detached).

    Args:
        per_sequence_loss: callable (logp (N, T), sampling_logp (N, T)) -> (N,) losses for every response.
        logits: (S, V) current policy parameters θ.
        sampling_logits: (S, V) the policy the responses are drawn from (θ itself on-policy).
        with_variance: also return tr Cov_q[∇ℓ], the per-sample gradient variance (sum over parameters).
            Needs ℓ_i to depend on θ only through row i of logp (true for klgrad's per-sequence losses).

    Returns:
        (expected gradient (S, V), variance or None).
    """
    theta = logits.detach().clone().requires_grad_(True)
    logp = token_logps(space, theta)  # (N, T)
    sample_logp = token_logps(space, sampling_logits.detach())  # (N, T)
    q = sample_logp.sum(-1).exp()  # (N,)
    losses = per_sequence_loss(logp, sample_logp)  # (N,)
    if not with_variance:
        (g,) = torch.autograd.grad((q * losses).sum(), theta, allow_unused=True)
        return (torch.zeros_like(theta) if g is None else g), None
    # Per-sample gradients without a backward per sample: row i of the loss depends on θ only through row i
    # of logp, and ∂ log softmax(θ_s)[y] / ∂θ_s = e_y - softmax(θ_s), so g_i = Σ_t w_it (e_{y_it} - p_{s_it}).
    (w,) = torch.autograd.grad(losses.sum(), logp, allow_unused=True)  # (N, T)
    if w is None:
        return torch.zeros_like(theta), 0.0
    n = w.shape[0]
    v = space.vocab
    probs = torch.softmax(theta.detach(), -1)  # (S, V)
    score = torch.nn.functional.one_hot(space.tokens, v).to(w.dtype) - probs[space.state_index]  # (N, T, V)
    contrib = torch.where(space.mask[..., None], w[..., None] * score, 0.0)  # (N, T, V)
    flat_index = space.state_index[..., None] * v + torch.arange(v)  # (N, T, V)
    per_sample = torch.zeros(n, space.num_states * v, dtype=w.dtype).scatter_add_(
        1, flat_index.reshape(n, -1), contrib.reshape(n, -1)
    )  # (N, S*V)
    mean = (q[:, None] * per_sample).sum(0)  # (S*V,)
    var = float((q * ((per_sample - mean) ** 2).sum(-1)).sum())
    return mean.view_as(theta), var
