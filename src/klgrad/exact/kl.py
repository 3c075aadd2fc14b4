r"""Exact sequence-level quantities of two causal LMs on given prompts, by enumerating the response prefix tree.

:func:`enumerate_responses` walks the tree of responses breadth-first from each prompt and returns every
complete response (a leaf: EOS emitted, or ``max_new_tokens`` reached) with its log-probability under the
policy π and under the reference π_ref, both at the sampling temperature. A child whose probability is below
``prune`` under *both* models is not followed: its whole subtree becomes one pruned outcome, kept with its
masses π(a), π_ref(a). Leaves and pruned outcomes together partition the response space, so their π masses
add up to 1 (and their π_ref masses too); with ``prune=0`` nothing is pruned and every sum is exact.

KL(π‖π_ref) over whole responses (:func:`tree_kl`) is the sum over that partition,

    KL = Σ_leaves π(y) log π(y)/π_ref(y) + Σ_pruned π(a) log π(a)/π_ref(a),

which is the KL between the two distributions coarsened to the partition: by the log-sum inequality it is
≤ the full KL, and the missing part, Σ_a π(a)·KL(π(·|a) ‖ π_ref(·|a)) ≥ 0, is the KL inside the pruned
subtrees. It equals the chain-rule sum Σ_{expanded prefixes} π(prefix)·KL_step(prefix), each per-step KL over
the full vocabulary. For short answers the tree is small (a 2-digit sum: a few thousand nodes).

The forward KL(π_ref‖π) is the same sum with the roles swapped, Σ π_ref(y)·log π_ref(y)/π(y) over the same
partition, and is a lower bound in the same way (the missing part Σ_a π_ref(a)·KL(π_ref(·|a) ‖ π(·|a))). The
enumeration expands a child when either model gives it mass ≥ ``prune``, so π_ref's pruned mass is held as
small as π's and both directions are covered alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrad.logprobs import position_ids_from_mask


@torch.no_grad()
def _next_logprobs(model, rows: list[list[int]], pad_id: int, temperature: float) -> Tensor:
    """Log-probs of the next token after each (unpadded) row of ids: (R, V) float64 on the CPU, rows
    left-padded together and run on the model's device."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = True
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, logits_to_keep=1).logits[:, -1]
    return torch.log_softmax(logits.double() / temperature, dim=-1).cpu()


@dataclass(frozen=True)
class ResponseTree:
    """The enumerated responses of P prompts: L leaves and A pruned outcomes (whole subtrees or leaves)."""

    leaf_prompt: Tensor
    """(L,) long: index of the prompt each leaf answers."""
    responses: list[list[int]]
    """L response token lists (EOS last when emitted)."""
    logp: Tensor
    """(L,) float64: log π(y | x) at the temperature."""
    ref_logp: Tensor
    """(L,) float64: log π_ref(y | x)."""
    pruned_prompt: Tensor
    """(A,) long: prompt of each pruned outcome."""
    pruned_logp: Tensor
    """(A,) float64: log π(a | x) of each pruned outcome (the mass of its whole subtree)."""
    pruned_ref_logp: Tensor
    """(A,) float64: log π_ref(a | x)."""
    nodes: int
    """Prefixes expanded (forward passes per model)."""
    n_prompts: int

    def pruned_mass(self, ref: bool = False) -> Tensor:
        """(P,) π mass (π_ref mass with ``ref``) of the pruned outcomes, per prompt."""
        lp = self.pruned_ref_logp if ref else self.pruned_logp
        out = torch.zeros(self.n_prompts, dtype=torch.float64)
        return out.index_add_(0, self.pruned_prompt, lp.exp())


@torch.no_grad()
def enumerate_responses(
    policy,
    ref,
    prompts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    prune: float = 1e-4,
    batch_size: int = 512,
) -> ResponseTree:
    """Every response of each prompt (token ids incl. BOS) with its log-probs under π and π_ref.

    A child y≤t is kept when max(π(y≤t), π_ref(y≤t)) ≥ ``prune`` (``prune=0``: when either is > 0); kept EOS
    children and kept children at ``max_new_tokens`` are leaves, other kept children are expanded, the rest
    are pruned outcomes. Expanding where either model has mass keeps both π's and π_ref's pruned mass below
    ``prune`` per pruned child, so sums under either distribution (E_π, E_π_ref) are covered alike.
    """
    leaf_prompt: list[int] = []
    responses: list[list[int]] = []
    leaf_lp: list[Tensor] = []
    leaf_lr: list[Tensor] = []
    cut_prompt: list[Tensor] = []
    cut_lp: list[Tensor] = []
    cut_lr: list[Tensor] = []
    # frontier: (prompt index, prefix, log π(prefix), log π_ref(prefix))
    frontier: list[tuple[int, list[int], float, float]] = [(i, [], 0.0, 0.0) for i in range(len(prompts))]
    nodes = 0
    for t in range(max_new_tokens):
        nxt: list[tuple[int, list[int], float, float]] = []
        for start in range(0, len(frontier), batch_size):
            chunk = frontier[start : start + batch_size]
            rows = [prompts[i] + prefix for i, prefix, _, _ in chunk]
            nodes += len(chunk)
            base_p = torch.tensor([c[2] for c in chunk], dtype=torch.float64)[:, None]  # (R, 1)
            base_r = torch.tensor([c[3] for c in chunk], dtype=torch.float64)[:, None]  # (R, 1)
            child_p = base_p + _next_logprobs(policy, rows, pad_id, temperature)  # (R, V) log π(y≤t)
            child_r = base_r + _next_logprobs(ref, rows, pad_id, temperature)  # (R, V) log π_ref(y≤t)
            top = torch.maximum(child_p, child_r).exp()  # (R, V)
            keep = top >= prune if prune > 0 else top > 0  # (R, V)
            ends = torch.zeros_like(keep)
            if t + 1 == max_new_tokens:
                ends[:] = True
            else:
                ends[:, eos_id] = True
            row_prompt = torch.tensor([c[0] for c in chunk], dtype=torch.long)  # (R,)
            cut = ~keep & (top > 0)  # zero-mass children under both models are nothing
            k_cut, _ = cut.nonzero(as_tuple=True)
            cut_prompt.append(row_prompt[k_cut])
            cut_lp.append(child_p[cut])
            cut_lr.append(child_r[cut])
            for k, v in (keep & ends).nonzero().tolist():
                i, prefix = chunk[k][0], chunk[k][1]
                leaf_prompt.append(i)
                responses.append([*prefix, v])
            leaf_lp.append(child_p[keep & ends])
            leaf_lr.append(child_r[keep & ends])
            for k, v in (keep & ~ends).nonzero().tolist():
                i, prefix = chunk[k][0], chunk[k][1]
                nxt.append((i, [*prefix, v], float(child_p[k, v]), float(child_r[k, v])))
        frontier = nxt
        if not frontier:
            break
    empty = torch.zeros(0, dtype=torch.float64)
    return ResponseTree(
        leaf_prompt=torch.tensor(leaf_prompt, dtype=torch.long),
        responses=responses,
        logp=torch.cat(leaf_lp) if leaf_lp else empty,
        ref_logp=torch.cat(leaf_lr) if leaf_lr else empty,
        pruned_prompt=torch.cat(cut_prompt) if cut_prompt else torch.zeros(0, dtype=torch.long),
        pruned_logp=torch.cat(cut_lp) if cut_lp else empty,
        pruned_ref_logp=torch.cat(cut_lr) if cut_lr else empty,
        nodes=nodes,
        n_prompts=len(prompts),
    )


def kl_terms(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """π(y)·(log π(y) − log π_ref(y)) per outcome, 0 where π(y) = 0: (N,) float64 from (N,) log-probs."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - ref_logp), torch.zeros_like(p))


@torch.no_grad()
def tree_kl(
    policy,
    ref,
    prompts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    prune: float = 1e-4,
    batch_size: int = 512,
) -> dict:
    """Exact (up to ``prune``) sequence KL(π‖π_ref) for each prompt (token ids incl. BOS).

    The KL of the partition of :func:`enumerate_responses` (leaves and pruned subtrees): a lower bound on the
    full KL, exact with ``prune=0`` (see the module docstring).

    Returns:
        ``{"kl": mean over prompts, "per_prompt": [...], "forward_kl": mean over prompts of the forward
        KL(π_ref‖π) of the same partition, "per_prompt_forward": [...], "pruned_mass": max over prompts of π's
        pruned mass, "pruned_mass_ref": the same of π_ref's, "nodes": n}``.
    """
    tree = enumerate_responses(
        policy,
        ref,
        prompts,
        eos_id=eos_id,
        pad_id=pad_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        prune=prune,
        batch_size=batch_size,
    )
    kl = torch.zeros(len(prompts), dtype=torch.float64)
    kl.index_add_(0, tree.leaf_prompt, kl_terms(tree.logp, tree.ref_logp))
    kl.index_add_(0, tree.pruned_prompt, kl_terms(tree.pruned_logp, tree.pruned_ref_logp))
    fwd = torch.zeros(len(prompts), dtype=torch.float64)
    fwd.index_add_(0, tree.leaf_prompt, kl_terms(tree.ref_logp, tree.logp))
    fwd.index_add_(0, tree.pruned_prompt, kl_terms(tree.pruned_ref_logp, tree.pruned_logp))
    per_prompt, per_prompt_fwd = kl.tolist(), fwd.tolist()
    return {
        "kl": sum(per_prompt) / len(per_prompt),
        "per_prompt": per_prompt,
        "forward_kl": sum(per_prompt_fwd) / len(per_prompt_fwd),
        "per_prompt_forward": per_prompt_fwd,
        "pruned_mass": float(tree.pruned_mass().max()),
        "pruned_mass_ref": float(tree.pruned_mass(ref=True).max()),
        "nodes": tree.nodes,
    }


def sampled_kl_estimates(seq_log_ratio: Tensor) -> dict[str, float]:
    """Mean k1, k2, k3 (in float64) of the sequence log-ratios U (N,) of sampled responses, and k1's standard
    error."""
    from klgrad.kl import sequence_kl_estimates

    u = seq_log_ratio.detach().double()  # (N,)
    out: dict[str, float] = {k: float(v.mean()) for k, v in sequence_kl_estimates(u).items()}
    out["k1_stderr"] = float(u.std() / max(1, u.numel()) ** 0.5) if u.numel() > 1 else float("nan")
    return out


def _step_logprobs(model, ids: Tensor, mask: Tensor, n_resp: int, temperature: float) -> Tensor:
    """(R, T, V) float64 next-token log-probs at the response positions: position j − 1 predicts token j."""
    pos = position_ids_from_mask(mask)
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, logits_to_keep=n_resp + 1).logits
    return torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)


@torch.no_grad()
def stepwise_kl(
    policy,
    ref,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    response_mask: Tensor,
    temperature: float = 1.0,
    rows_per_pass: int = 8,
) -> Tensor:
    r"""Per sampled response, the sum of exact next-token KLs along its path: (N,) float64.

    For y ~ π(·|x), with both distributions at temperature τ over the full vocabulary,

        S(y) = Σ_{t < |y|} KL( π(·|x, y_{<t}) ‖ π_ref(·|x, y_{<t}) ),   E_{y~π}[S(y)] = KL(π(·|x) ‖ π_ref(·|x))

    by the chain rule of KL over whole responses (EOS and the length cap end both models' responses at the same
    place). Each term is the conditional mean of the matching term of the sampled log-ratio k1 = Σ_t r_t,
    r_t = log π(y_t|·)/π_ref(y_t|·), given the prefix: s_t = E[r_t | y_{<t}], so S has k1's mean. S is not one
    conditional expectation of k1 (each term conditions on another prefix), so Rao–Blackwell bounds each term's
    variance, not the sum's: with m_t = r_t − s_t (mean 0 given y_{<t}),

        Var(k1) = Var(S) + Var(Σ_t m_t) + 2·Σ_{u<t} Cov(m_u, s_t),

    and S has more variance than k1 when the log-ratio of a drawn token falls as the KL of the steps after it
    rises. Example: π_ref uniform on {aa, ab, ba, bb}, π uniform on {aa, ab, ba}: k1 = log 4/3 for every y
    (Var 0), S = 0.057 on aa, ab and 0.750 on ba (Var (2/9)·log²2 = 0.107); ``tests/exact/test_kl.py`` checks it.
    On sampled LM responses it has been the smaller one (docs/reproduction.md, the real-model comparison). It is
    the estimator of sequence KL for vocabularies too large for tree enumeration.

    ``input_ids``/``attention_mask`` (N, L) hold left-padded prompts in ``[:, :response_start]`` and responses
    after; ``response_mask`` (N, L − response_start) marks the generated tokens (EOS included).
    """
    device = next(policy.parameters()).device
    n_resp = input_ids.shape[1] - response_start
    out = torch.zeros(input_ids.shape[0], dtype=torch.float64)
    for lo in range(0, input_ids.shape[0], rows_per_pass):
        sl = slice(lo, lo + rows_per_pass)
        ids, mask = input_ids[sl].to(device), attention_mask[sl].to(device)
        lp, lq = (_step_logprobs(m, ids, mask, n_resp, temperature) for m in (policy, ref))
        kl_t = (lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0)  # (R, T); ≥ 0 up to rounding
        out[sl] = (kl_t * response_mask[sl].to(device)).sum(-1).cpu()
    return out


def clustered_mean_se(values: Tensor, groups: Tensor) -> tuple[float, float]:
    """Mean over groups of each group's mean, and its standard error from the within-group spread.

    ``values`` (N,) are i.i.d. draws within each group (samples of one prompt), ``groups`` (N,) long their
    group; the estimand is the average over the G fixed groups of each group's expectation, so
    SE² = Σ_g s_g²/n_g / G² (s_g² the unbiased sample variance of group g; a group of one draw contributes 0).
    """
    v = values.double()
    ids = groups.unique()
    means, var_terms = [], []
    for g in ids:
        x = v[groups == g]
        means.append(float(x.mean()))
        var_terms.append(float(x.var() / x.numel()) if x.numel() > 1 else 0.0)
    k = len(ids)
    return sum(means) / k, (sum(var_terms) ** 0.5) / k
