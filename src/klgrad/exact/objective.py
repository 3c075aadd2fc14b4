r"""The exact KL-regularised objective of a policy, its optimum, and the policy's distance to it.

For a prompt x, responses y, reward R and β > 0,

    J_β(π) = E_π[R] − β·KL(π‖π_ref).

Its maximiser over all distributions is π*(y) = π_ref(y)·exp(R(y)/β) / Z with Z = E_{π_ref}[exp(R/β)], its
maximum is J* = β·log Z, and for every π

    J* − J_β(π) = β·KL(π‖π*)

(expand log π* in KL(π‖π*) = E_π[log π − log π_ref − R/β + log Z]). So KL(π‖π*) measures how far a trained
policy is from the best policy for the same β, in the same units as the KL to the reference.

For short answers all of it is computed exactly by enumerating the responses of each prompt
(:func:`klgrad.exact.kl.enumerate_responses`) and scoring every leaf with the run's own reward
functions. Children with probability below ``prune`` under both π and π_ref are not followed; each such
subtree a is kept as one outcome with its masses π(a), π_ref(a) and reward 0, so the numbers are those of the
distributions coarsened to leaves and pruned subtrees (exact with ``prune=0``). With rewards in [r_lo, r_hi]
and pruned masses m = Σ_a π(a), m_ref = Σ_a π_ref(a), the pruning changes (:func:`pruning_bounds`):

- E_π[R] by Σ_a π(a)·E[R | a] ∈ m·[r_lo, r_hi], so by at most ``reward_error`` = m·max(|r_lo|, |r_hi|);
- Z by Σ_a π_ref(a)·(E_{π_ref}[e^{R/β} | a] − 1) ∈ m_ref·[e^{r_lo/β} − 1, e^{r_hi/β} − 1], so J* by at most
  ``J_star_error`` = β·max(|log(1 + m_ref(e^{r_lo/β} − 1)/Z)|, |log(1 + m_ref(e^{r_hi/β} − 1)/Z)|);
- KL(π‖π_ref) by the KL inside the pruned subtrees, Σ_a π(a)·KL(π(·|a)‖π_ref(·|a)) ≥ 0, which the masses
  alone do not bound: the reported KL is a lower bound, J is exact up to ``reward_error`` from above
  (J_exact ≤ J + reward_error), and KL(π‖π*) ≥ kl_to_optimum − (reward_error + J_star_error)/β.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from klgrad.exact.kl import ResponseTree, enumerate_responses, kl_terms

PRUNE = 1e-4
"""Default pruning threshold of the enumeration: a 2-digit sum at ``max_new_tokens`` = 8 then leaves ~0.6% of
π's mass in pruned subtrees (mean over 20 held-out prompts, shipped reference) for ~1.5 s on two CPU cores."""

BUILTIN_RANGE = (0.0, 1.0)
"""Values of the built-in ``accuracy`` and ``format`` rewards (a failed call counts 0)."""


def objective_from_leaves(logp: Tensor, ref_logp: Tensor, rewards: Tensor, beta: float) -> dict[str, float]:
    r"""J_β, J*, KL(π‖π_ref) and KL(π‖π*) of one prompt, from a distribution over N outcomes.

    Args:
        logp: (N,) float64 log π(y); the masses add up to 1.
        ref_logp: (N,) float64 log π_ref(y).
        rewards: (N,) float64 R(y).
        beta: β > 0.

    With π(y) = e^{log π(y)} (terms with π(y) = 0 count 0):

        E_π[R] = Σ π(y)·R(y),    KL(π‖π_ref) = Σ π(y)·(log π(y) − log π_ref(y)),
        KL(π_ref‖π) = Σ π_ref(y)·(log π_ref(y) − log π(y))   (the forward KL, reported beside the reverse),
        J = E_π[R] − β·KL(π‖π_ref),
        log Z = logsumexp_y (log π_ref(y) + R(y)/β),    J* = β·log Z,
        log π*(y) = log π_ref(y) + R(y)/β − log Z,    KL(π‖π*) = Σ π(y)·(log π(y) − log π*(y)).

    KL(π‖π*) is summed directly, not taken as (J* − J)/β, so the identity J* − J = β·KL(π‖π*) checks the sums.

    Returns:
        ``{"reward", "kl", "kl_forward", "J", "log_z", "J_star", "kl_to_optimum"}`` as floats.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    p = logp.exp()  # (N,)
    reward = float((p * rewards).sum())
    kl = float(kl_terms(logp, ref_logp).sum())
    log_z = float(torch.logsumexp(ref_logp + rewards / beta, dim=0))
    opt_logp = ref_logp + rewards / beta - log_z  # (N,) log π*(y)
    return {
        "reward": reward,
        "kl": kl,
        "kl_forward": float(kl_terms(ref_logp, logp).sum()),
        "J": reward - beta * kl,
        "log_z": log_z,
        "J_star": beta * log_z,
        "kl_to_optimum": float(kl_terms(logp, opt_logp).sum()),
    }


def pruning_bounds(
    pruned: float, pruned_ref: float, log_z: float, beta: float, reward_range: tuple[float, float]
) -> dict[str, float]:
    r"""Bounds on what the pruned outcomes (reward 0 in the sums) change in E_π[R] and in J*.

    With m = ``pruned`` (π's mass), m_ref = ``pruned_ref`` (π_ref's), rewards in [r_lo, r_hi]:

        reward_error = m·max(|r_lo|, |r_hi|),
        J_star_error = β·max_{r ∈ {r_lo, r_hi}} |log(1 + m_ref·(e^{r/β} − 1)/Z)|,

    evaluated in log space (e^{r/β}/Z = e^{r/β − log Z}) so that small β does not overflow.
    """
    lo, hi = reward_range
    reward_error = pruned * max(abs(lo), abs(hi))
    if pruned_ref <= 0:
        return {"reward_error": reward_error, "J_star_error": 0.0}
    base = math.log(pruned_ref) - log_z
    errs = []
    for r in (lo, hi):
        delta = math.exp(base + r / beta) - math.exp(base)  # m_ref·(e^{r/β} − 1)/Z, ≥ −m_ref/Z ≥ −1
        errs.append(abs(math.log1p(delta)) if delta > -1 else math.inf)
    return {"reward_error": reward_error, "J_star_error": beta * max(errs)}


def objective_of_tree(
    tree: ResponseTree, rewards: Tensor, beta: float, reward_range: tuple[float, float]
) -> list[dict[str, float]]:
    """Per prompt: :func:`objective_from_leaves` over the tree's leaves (rewards (L,) float64) and its pruned
    subtrees (reward 0), with :func:`pruning_bounds` for rewards in ``reward_range``."""
    m, m_ref = tree.pruned_mass(), tree.pruned_mass(ref=True)  # (P,)
    out = []
    for i in range(tree.n_prompts):
        leaf, cut = tree.leaf_prompt == i, tree.pruned_prompt == i
        res = objective_from_leaves(
            torch.cat([tree.logp[leaf], tree.pruned_logp[cut]]),
            torch.cat([tree.ref_logp[leaf], tree.pruned_ref_logp[cut]]),
            torch.cat([rewards[leaf], torch.zeros(int(cut.sum()), dtype=torch.float64)]),
            beta,
        )
        res.update(pruning_bounds(float(m[i]), float(m_ref[i]), res["log_z"], beta, reward_range))
        out.append(res)
    return out


def reward_range(specs: Sequence, observed: Sequence[float]) -> tuple[tuple[float, float], bool]:
    """The range [r_lo, r_hi] of the weighted total reward, and whether it is known.

    Known when every function is a built-in one (values in :data:`BUILTIN_RANGE`): [Σ min(0, w·lo, w·hi),
    Σ max(0, w·lo, w·hi)] over the weights w. Otherwise the range of the ``observed`` rewards widened to hold 0
    (an assumption: a pruned response could score outside it).
    """
    from klgrad.rewards import BUILTIN_REWARDS

    if all(s.fn is BUILTIN_REWARDS.get(s.name) for s in specs):
        lo = sum(min(0.0, s.weight * BUILTIN_RANGE[0], s.weight * BUILTIN_RANGE[1]) for s in specs)
        hi = sum(max(0.0, s.weight * BUILTIN_RANGE[0], s.weight * BUILTIN_RANGE[1]) for s in specs)
        return (lo, hi), True
    return (min([0.0, *observed]), max([0.0, *observed])), False


def score_leaves(
    specs: Sequence,
    examples: Sequence,
    leaf_prompt: list[int],
    texts: list[str],
    batch: int,
    *,
    timeout_s: float = 5.0,
    failure_value: float = 0.0,
):
    """Rewards of the leaves with :func:`klgrad.rewards.compute_rewards`, ``batch`` leaves a call, each call
    under ``timeout_s`` with ``failure_value`` for a failed leaf, as a training batch of that size is scored
    (callers pass the run's ``reward.timeout_s`` and ``reward.failure_value`` with its batch size, so an exact
    value is not biased by a timeout the run itself would not hit). Returns ``(totals, failures)``."""
    from klgrad.data.example import examples_to_columns
    from klgrad.rewards import compute_rewards

    columns = examples_to_columns(examples)
    totals: list[float] = []
    failures = 0
    for start in range(0, len(texts), batch):
        idx = leaf_prompt[start : start + batch]
        res = compute_rewards(
            specs,
            [examples[i].prompt for i in idx],
            texts[start : start + batch],
            {k: [col[i] for i in idx] for k, col in columns.items()},
            failure_value=failure_value,
            timeout_s=timeout_s,
        )
        totals += res.total
        failures += sum(res.failures.values())
    return totals, failures


@torch.no_grad()
def exact_objective(
    policy,
    ref,
    tokenizer,
    examples: Sequence,
    specs: Sequence,
    *,
    beta: float,
    max_new_tokens: int,
    temperature: float = 1.0,
    prune: float = PRUNE,
    reward_batch: int = 256,
    reward_timeout_s: float = 5.0,
    reward_failure_value: float = 0.0,
    chat: bool = False,
) -> dict:
    """J_β, J*, KL(π‖π*) and KL(π‖π_ref) of ``policy`` on the prompts of ``examples``, means over the prompts.

    ``chat``: prompts are encoded through the tokenizer's chat template, as the run encoded them.
    ``reward_batch``, ``reward_timeout_s``, ``reward_failure_value``: how the leaves are scored
    (:func:`score_leaves`).

    Responses are enumerated (:func:`klgrad.exact.kl.enumerate_responses`), decoded as the sampler's
    responses are (special tokens dropped) and scored by ``specs`` against each example's columns.

    Returns:
        ``{"beta", "J", "J_star", "kl_to_optimum", "kl", "kl_forward", "reward", "pruned_mass", "pruned_mass_ref",
        "pruned_mass_max", "reward_error", "J_star_error", "reward_range", "reward_range_known",
        "reward_failures", "n_prompts", "leaves", "nodes", "seconds", "seconds_rewards"}``: every number a
        mean over prompts except the counts, the times, ``pruned_mass_max`` (the largest π pruned mass of one
        prompt) and the range; the error bounds are means of the per-prompt bounds, so they bound the error
        of the means.
    """
    from klgrad.rollout.encoding import encode_prompts

    t0 = time.perf_counter()
    ids, mask = encode_prompts(tokenizer, [e.prompt for e in examples], chat=chat)
    rows = [ids[i][mask[i]].tolist() for i in range(len(examples))]
    tree = enumerate_responses(
        policy,
        ref,
        rows,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        prune=prune,
    )
    t1 = time.perf_counter()
    texts = tokenizer.batch_decode(tree.responses, skip_special_tokens=True)
    leaf_prompt = tree.leaf_prompt.tolist()
    totals, failures = score_leaves(
        specs,
        examples,
        leaf_prompt,
        texts,
        reward_batch,
        timeout_s=reward_timeout_s,
        failure_value=reward_failure_value,
    )
    t2 = time.perf_counter()
    rng, known = reward_range(specs, totals)
    per = objective_of_tree(tree, torch.tensor(totals, dtype=torch.float64), beta, rng)
    m, m_ref = tree.pruned_mass(), tree.pruned_mass(ref=True)  # (P,)

    def mean(k: str) -> float:
        return sum(r[k] for r in per) / len(per)

    return {
        "beta": beta,
        **{k: mean(k) for k in ("J", "J_star", "kl_to_optimum", "kl", "kl_forward", "reward")},
        "pruned_mass": float(m.mean()),
        "pruned_mass_ref": float(m_ref.mean()),
        "pruned_mass_max": float(m.max()),
        "reward_error": mean("reward_error"),
        "J_star_error": mean("J_star_error"),
        "reward_range": list(rng),
        "reward_range_known": known,
        "reward_failures": failures,
        "n_prompts": len(examples),
        "leaves": len(texts),
        "nodes": tree.nodes,
        "seconds": time.perf_counter() - t0,
        "seconds_rewards": t2 - t1,
    }
