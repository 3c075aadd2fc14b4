r"""Sampled estimates for models whose responses cannot be enumerated: the distance KL(π‖π*) to the optimum of
J_β, and the KL in both directions to the reference.

**Distance to the optimum.** For a prompt x, reward R and β > 0, π*(y) = π_ref(y)·e^{R(y)/β}/Z with
Z = E_{π_ref}[e^{R/β}], and (:mod:`klgrad.exact.objective`)

    KL(π‖π*) = KL(π‖π_ref) − E_π[R]/β + log Z.

From n policy samples y_i ~ π(·|x) and K reference samples y'_k ~ π_ref(·|x) of one prompt
(:func:`kl_to_optimum_from_samples`):

    D_i = S(y_i) − R(y_i)/β,        S(y) the stepwise KL (:func:`~klgrad.exact.kl.stepwise_kl`), E_π[S] = KL(π‖π_ref),
    W_k = e^{R(y'_k)/β},    Ẑ = mean_k W_k    (a 0/1 reward: Ẑ = 1 + p̂_ref·(e^{1/β} − 1), p̂_ref its success rate),
    estimate = mean_i D_i + log Ẑ,
    SE² = s_D²/n + s_W²/(K·Ẑ²)       (s² the unbiased sample variances),

the second term being log Ẑ's own sampling variance by the delta method (Var log Ẑ ≈ Var Ẑ/Z²); the two terms
add because the policy's and the reference's samples are independent, and D's spread already holds the
covariance of S and R on the same sample. Over P prompts the estimate is the mean of the per-prompt estimates,
SE² = Σ_x SE_x²/P² (the prompts are fixed, their samples random, as in
:func:`~klgrad.exact.kl.clustered_mean_se`).
log Ẑ is biased low by about Var(W)/(2K·Z²) (Jensen), second order in 1/K against the SE's 1/√K: at K = 256, a
0/1 reward with p_ref = 0.5 and β = 0.5, 0.001 against a log Ẑ SE of 0.048.

What the SE does not cover: reward values no reference sample reached. A prompt the reference never rewarded
(every sample at the bottom of the reward range; p̂_ref = 0) gets Ẑ = e^{r_lo/β} and a zero log-Z variance,
although a true success rate of 1/(10K) moves log Z by log(1 + (e^{1/β} − 1)/(10K)) (at β = 0.1, K = 256: 2.3
nats). For every prompt whose samples stay below the top r_hi of the reward range, the share q of reference mass
above the largest sampled reward is at most q₉₅ = 1 − 0.05^{1/K} ≈ 3/K (the rule of three) with 95%
confidence, so

    Z ≤ (1 − q₉₅)·Ẑ + q₉₅·e^{r_hi/β},

and likewise Z ≥ (1 − q₉₅)·Ẑ + q₉₅·e^{r_lo/β} for prompts whose samples stay above r_lo. The estimate with these
per-prompt limits in place of log Ẑ is reported as ``kl_to_optimum_unseen_95`` (a range, not a confidence
interval of the mean), and the prompts never rewarded (and always rewarded: every sample at r_hi) are counted.

**Both directions to the reference** (:func:`forgetting_kl`). KL(π‖π_ref) is the stepwise sum along policy
samples, KL(π_ref‖π) the same sum with the roles swapped along *reference* samples,

    S_fwd(y') = Σ_t KL(π_ref(·|x, y'_{<t}) ‖ π(·|x, y'_{<t})),  y' ~ π_ref(·|x),  E[S_fwd] = KL(π_ref(·|x) ‖ π(·|x)),

each a mean over prompts with its clustered SE (within-prompt spread only: the prompts are the fixed set given).
Both are KLs between the distributions at the sampling temperature over responses cut at ``max_new_tokens`` (the
cap ends both models' responses at the same place, so the chain rule holds).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from klgrad.exact.kl import clustered_mean_se, stepwise_kl

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "chat_prompts" / "prompts.jsonl"
"""32 short general chat prompts shipped with klgrad (written for it): the set :func:`forgetting_kl` measures what a
run cost the model away from its task on."""

MIN_REF_SAMPLES = 256
"""Reference samples per prompt recommended for log Z: the rule-of-three blind spot q₉₅ ≈ 3/K is then ≈ 1.2%."""

FORGETTING_MAX_NEW_TOKENS = 64
"""Response cap of the chat-prompt KLs (``klgrad forgetting``, a grid's ``forgetting`` measurement): both KLs are of
responses cut at 64 tokens (a haiku or two sentences fit; the longer answers are cut at the same place in both
models)."""

UNSEEN_CONFIDENCE = 0.95
"""Confidence of the per-prompt limits on reward mass no reference sample reached."""


def chat_prompts(path: Path = CHAT_PROMPTS) -> list[str]:
    """The prompts of a JSONL file of ``{"prompt": ...}`` rows (default: the shipped general chat prompts)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["prompt"] for r in rows]


def unseen_mass_limit(samples: int, confidence: float = UNSEEN_CONFIDENCE) -> float:
    """q = 1 − (1 − confidence)^{1/K}: the largest mass an outcome can have while K independent samples miss it with
    probability ≥ 1 − confidence (≈ 3/K at 95%: the rule of three)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    return 1.0 - (1.0 - confidence) ** (1.0 / samples)


def log_z_estimate(ref_rewards: Tensor, beta: float, reward_range: tuple[float, float]) -> dict[str, float]:
    r"""log Ẑ of one prompt from its K reference rewards (K,), its delta-method SE and its unseen-reward limits.

    W_k = e^{R_k/β} is computed as e^{R_k/β − c}·e^c with c = max_k R_k/β, so that small β does not overflow:

        log Ẑ = c + log mean_k e^{R_k/β − c},    SE(log Ẑ) = s_W/(√K·Ẑ)   (0 when K = 1),
        log_z_lo = log((1 − q)·Ẑ + q·e^{r_lo/β})  if min R > r_lo, else log Ẑ,
        log_z_hi = log((1 − q)·Ẑ + q·e^{r_hi/β})  if max R < r_hi, else log Ẑ,     q = :func:`unseen_mass_limit`.

    Returns ``{"log_z", "log_z_se", "log_z_lo", "log_z_hi", "never_rewarded", "always_rewarded"}`` (the last two
    1.0 or 0.0: every sample at r_lo, every sample at r_hi).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    r = ref_rewards.double()  # (K,)
    k = r.numel()
    lo, hi = reward_range
    x = r / beta  # (K,)
    c = float(x.max())
    w = (x - c).exp()  # (K,) W_k·e^{−c}, in (0, 1]
    w_mean = float(w.mean())
    log_z = c + math.log(w_mean)
    se = float(w.std() / (math.sqrt(k) * w_mean)) if k > 1 else 0.0
    q = unseen_mass_limit(k)

    def limit(bound: float) -> float:  # log((1 − q)·Ẑ + q·e^{bound/β}) in log space
        a, b = math.log1p(-q) + log_z, math.log(q) + bound / beta
        return max(a, b) + math.log1p(math.exp(-abs(a - b)))

    return {
        "log_z": log_z,
        "log_z_se": se,
        "log_z_lo": limit(lo) if float(r.min()) > lo else log_z,
        "log_z_hi": limit(hi) if float(r.max()) < hi else log_z,
        "never_rewarded": float(float(r.max()) <= lo),
        "always_rewarded": float(float(r.min()) >= hi),
    }


def log_z_of_masses(masses: Sequence[tuple[float, float]], beta: float, samples: int) -> tuple[float, float]:
    r"""log Z = log Σ_r m(r)·e^{r/β} of one prompt from its reward classes' masses m(r) (the share of K reference
    samples at reward r, as ``klgrad regime`` records them), and the delta-method variance of log Ẑ:

        Var(log Ẑ) ≈ Var(W) / (K·Z²),  W = e^{R/β},  Var(W) = Σ_r m(r)·e^{2r/β} − Z².

    With m the empirical shares of K samples this is :func:`log_z_estimate`'s ``log_z`` and, up to its K − 1
    divisor (``log_z_se``² · (K − 1)/K), its variance. Computed as a log-sum-exp (no overflow at small β)."""
    if not beta > 0 or samples < 1:
        raise ValueError(f"beta must be > 0 and samples >= 1, got beta={beta}, samples={samples}")
    a = [(math.log(m) + r / beta, r) for r, m in masses if m > 0]  # log(m·e^{r/β}) per reward class
    top = max(x for x, _ in a)
    z_scaled = sum(math.exp(x - top) for x, _ in a)  # Z·e^{−top}
    w2_scaled = sum(math.exp(x - top + r / beta - top) for x, r in a)  # E[W²]·e^{−2·top}
    return top + math.log(z_scaled), (w2_scaled - z_scaled**2) / (samples * z_scaled**2)


def kl_to_optimum_from_samples(
    stepwise: Tensor,
    rewards: Tensor,
    prompt: Tensor,
    ref_rewards: Tensor,
    ref_prompt: Tensor,
    beta: float,
    reward_range: tuple[float, float],
) -> dict:
    r"""KL(π‖π*) estimated from policy and reference samples of P prompts (module docstring), with its SE.

    Args:
        stepwise: (N,) float stepwise KL S(y_i) of each policy sample.
        rewards: (N,) float R(y_i) of the same samples.
        prompt: (N,) long prompt index in [0, P) of each policy sample.
        ref_rewards: (M,) float R(y'_k) of the reference samples.
        ref_prompt: (M,) long prompt index of each reference sample; every prompt needs ≥ 1 sample of each kind.
        beta: β > 0.
        reward_range: [r_lo, r_hi], every reward's range (for the unseen-reward limits).

    Returns:
        ``{"kl_to_optimum", "kl_to_optimum_se", "kl_to_optimum_unseen_95": [lo, hi], "kl", "kl_se", "reward",
        "log_z", "log_z_se", "J", "J_star", "beta", "n_prompts", "prompts_never_rewarded",
        "prompts_always_rewarded", "per_prompt": [{"kl_to_optimum", "se", "kl", "reward", "log_z", "log_z_se",
        "log_z_lo", "log_z_hi", "ref_reward_mean", "never_rewarded", "always_rewarded"}, ...]}``; every number a
        mean over prompts
        except the SEs (of those means) and the counts. J = E_π[R] − β·KL(π‖π_ref) and J* = β·log Z, so
        J* − J = β·KL(π‖π*) holds for the estimates exactly.
    """
    n_prompts = int(max(int(prompt.max()), int(ref_prompt.max()))) + 1
    d = stepwise.double() - rewards.double() / beta  # (N,) D_i
    per: list[dict] = []
    for i in range(n_prompts):
        mine, theirs = prompt == i, ref_prompt == i
        if not bool(mine.any()) or not bool(theirs.any()):
            raise ValueError(f"prompt {i} has no policy or no reference samples")
        di, n = d[mine], int(mine.sum())
        z = log_z_estimate(ref_rewards[theirs], beta, reward_range)
        var_d = float(di.var() / n) if n > 1 else 0.0
        per.append(
            {
                "kl_to_optimum": float(di.mean()) + z["log_z"],
                "se": math.sqrt(var_d + z["log_z_se"] ** 2),
                "kl": float(stepwise[mine].double().mean()),
                "reward": float(rewards[mine].double().mean()),
                **{k: z[k] for k in ("log_z", "log_z_se", "log_z_lo", "log_z_hi")},
                "ref_reward_mean": float(ref_rewards[theirs].double().mean()),
                "never_rewarded": bool(z["never_rewarded"]),
                "always_rewarded": bool(z["always_rewarded"]),
            }
        )
    _, kl_se = clustered_mean_se(stepwise, prompt)

    def mean(key: str) -> float:
        return sum(p[key] for p in per) / n_prompts

    def shifted(key: str) -> float:  # the estimate with each prompt's log Z replaced by its limit ``key``
        return sum(p["kl_to_optimum"] - p["log_z"] + p[key] for p in per) / n_prompts

    reward, kl, log_z = mean("reward"), mean("kl"), mean("log_z")
    return {
        "kl_to_optimum": mean("kl_to_optimum"),
        "kl_to_optimum_se": math.sqrt(sum(p["se"] ** 2 for p in per)) / n_prompts,
        "kl_to_optimum_unseen_95": [shifted("log_z_lo"), shifted("log_z_hi")],
        "kl": kl,
        "kl_se": kl_se,
        "reward": reward,
        "log_z": log_z,
        "log_z_se": math.sqrt(sum(p["log_z_se"] ** 2 for p in per)) / n_prompts,
        "J": reward - beta * kl,
        "J_star": beta * log_z,
        "beta": beta,
        "n_prompts": n_prompts,
        "prompts_never_rewarded": sum(p["never_rewarded"] for p in per),
        "prompts_always_rewarded": sum(p["always_rewarded"] for p in per),
        "per_prompt": per,
    }


@torch.no_grad()
def sample_stepwise(
    sampler_model,
    other,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator,
    prompts_per_call: int = 8,
    draws: Sequence | None = None,
):
    r"""Draw ``samples`` responses per prompt from ``sampler_model`` (full distribution at ``temperature``) and
    take S(y) = Σ_t KL(sampler(·|prefix) ‖ other(·|prefix)) along each: an unbiased estimate of
    KL(sampler‖other) per response.

    ``prompt_ids``/``prompt_mask`` (P, L) left-padded prompts. Returns ``(S (P·samples,) float64, rollouts)``,
    each prompt's samples contiguous; ``rollouts`` the sampler's :class:`~klgrad.rollout.batch.Rollout` of each
    chunk of ``prompts_per_call`` prompts, in order. ``draws``: the ``rollouts`` of an earlier call with the same
    sampler, prompts and settings, scored again instead of drawn (``generator`` is then not used).
    """
    from klgrad.rollout.samplers import make_sampler

    sampler = make_sampler("klgrad", eos_id, pad_id)
    device = next(sampler_model.parameters()).device
    out, rollouts = [], []
    for i, lo in enumerate(range(0, prompt_ids.shape[0], prompts_per_call)):
        ids, mask = prompt_ids[lo : lo + prompts_per_call], prompt_mask[lo : lo + prompts_per_call]
        if draws is not None:
            roll = draws[i]
        else:
            roll = sampler.generate(
                sampler_model,
                ids.to(device),
                mask.to(device),
                group_size=samples,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                generator=generator,
            )
        out.append(
            stepwise_kl(
                sampler_model,
                other,
                roll.input_ids,
                roll.attention_mask,
                ids.shape[1],
                roll.response_mask,
                temperature,
            )
        )
        rollouts.append(roll)
    return torch.cat(out), rollouts


@torch.no_grad()
def forgetting_kl(
    policy,
    ref,
    tokenizer,
    prompts: Sequence[str],
    samples: int,
    max_new_tokens: int,
    temperature: float,
    *,
    chat: bool | None = None,
    seed: int = 0,
) -> dict:
    r"""KL(π‖π_ref) and KL(π_ref‖π) on ``prompts`` by the stepwise estimator, each under its own sampling
    distribution (the reverse KL along ``samples`` policy samples per prompt, the forward KL along as many
    reference samples), means over prompts with clustered SEs (module docstring).

    ``chat``: encode through the tokenizer's chat template (default: when it has one). The policy's and the
    reference's draws use separate generators seeded from ``seed``.

    Returns:
        ``{"reverse_kl", "reverse_kl_se", "forward_kl", "forward_kl_se", "n_prompts", "samples",
        "max_new_tokens", "temperature", "truncated_policy", "truncated_reference", "length_policy",
        "length_reference"}``: truncated_* the share of responses that hit ``max_new_tokens``, length_* the mean
        response length in tokens.
    """
    from klgrad.rollout.encoding import encode_prompts

    if samples < 2:
        raise ValueError(f"samples must be >= 2 (the SE needs a spread), got {samples}")
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    ids, mask = encode_prompts(tokenizer, list(prompts), chat=chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {
        "samples": samples,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "eos_id": tokenizer.eos_token_id,
        "pad_id": pad,
    }
    rev, rev_rolls = sample_stepwise(
        policy, ref, ids, mask, generator=torch.Generator().manual_seed(seed), **common
    )  # (P·samples,)
    device = str(next(ref.parameters()).device)  # the draws' tensors live there
    key = (weights_fingerprint(ref), device, ids.cpu().numpy().tobytes(), seed + 1, tuple(sorted(common.items())))
    fwd, fwd_rolls = sample_stepwise(
        ref, policy, ids, mask, generator=torch.Generator().manual_seed(seed + 1), draws=_REF_DRAWS.get(key), **common
    )  # (P·samples,)
    _REF_DRAWS.clear()  # one reference, prompts and seed give the same draws: a grid's runs share them
    _REF_DRAWS[key] = fwd_rolls
    prompt_of = torch.arange(len(prompts)).repeat_interleave(samples)  # (P·samples,)
    rev_mean, rev_se = clustered_mean_se(rev, prompt_of)
    fwd_mean, fwd_se = clustered_mean_se(fwd, prompt_of)

    def truncated(rolls) -> float:
        return float(torch.cat([r.truncated.float().cpu() for r in rolls]).mean())

    def length(rolls) -> float:
        return float(torch.cat([r.response_mask.sum(-1).float().cpu() for r in rolls]).mean())

    return {
        "reverse_kl": rev_mean,
        "reverse_kl_se": rev_se,
        "forward_kl": fwd_mean,
        "forward_kl_se": fwd_se,
        "n_prompts": len(prompts),
        "samples": samples,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "truncated_policy": truncated(rev_rolls),
        "truncated_reference": truncated(fwd_rolls),
        "length_policy": length(rev_rolls),
        "length_reference": length(fwd_rolls),
    }


@torch.no_grad()
def estimate_kl_to_optimum(
    policy,
    ref,
    tokenizer,
    examples: Sequence,
    specs: Sequence,
    *,
    beta: float,
    samples: int,
    ref_samples: int = MIN_REF_SAMPLES,
    max_new_tokens: int,
    temperature: float = 1.0,
    chat: bool = False,
    seed: int = 0,
    reward_batch: int = 256,
    reward_timeout_s: float = 5.0,
    reward_failure_value: float = 0.0,
) -> dict:
    r"""KL(π‖π*) of ``policy`` on the prompts of ``examples`` from samples (:func:`kl_to_optimum_from_samples`):
    ``samples`` policy samples per prompt (stepwise KL and reward), ``ref_samples`` reference samples per prompt
    (reward, for log Z), all at ``temperature`` and cut at ``max_new_tokens``, scored by ``specs`` as a training
    batch is. The reward range of the unseen-reward limits is :func:`~klgrad.exact.objective.reward_range`'s (the
    built-in rewards' known range, else the observed one widened to 0).

    Returns :func:`kl_to_optimum_from_samples`'s dict with ``"samples"``, ``"ref_samples"``, ``"reward_range"``,
    ``"reward_range_known"`` and ``"reward_failures"`` added.
    """
    from klgrad.exact.objective import reward_range, score_leaves
    from klgrad.rollout.encoding import decode_responses, encode_prompts

    if samples < 2 or ref_samples < 2:
        raise ValueError(f"samples and ref_samples must be >= 2, got {samples} and {ref_samples}")
    ids, mask = encode_prompts(tokenizer, [e.prompt for e in examples], chat=chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": max_new_tokens, "temperature": temperature, "eos_id": tokenizer.eos_token_id}
    steps, rolls = sample_stepwise(
        policy, ref, ids, mask, samples=samples, pad_id=pad, generator=torch.Generator().manual_seed(seed), **common
    )  # (P·samples,)
    texts = [t for r in rolls for t in decode_responses(tokenizer, r)]
    prompt_of = torch.arange(len(examples)).repeat_interleave(samples)  # (P·samples,)
    scoring = {"timeout_s": reward_timeout_s, "failure_value": reward_failure_value}  # as the run scores a batch
    rewards, failures = score_leaves(specs, examples, prompt_of.tolist(), texts, reward_batch, **scoring)
    key = (weights_fingerprint(ref), ids.cpu().numpy().tobytes(), ref_samples, seed + 1, tuple(sorted(common.items())))
    if key not in _REF_TEXTS:  # one reference, prompts and seed give the same draws: sample them once per process
        _REF_TEXTS.clear()
        _REF_TEXTS[key] = _reference_texts(ref, tokenizer, ids, mask, ref_samples, pad, seed + 1, **common)
    ref_texts = _REF_TEXTS[key]
    ref_prompt = torch.arange(len(examples)).repeat_interleave(ref_samples)  # (P·ref_samples,)
    ref_rewards, ref_failures = score_leaves(specs, examples, ref_prompt.tolist(), ref_texts, reward_batch, **scoring)
    rng, known = reward_range(specs, [*rewards, *ref_rewards])
    out = kl_to_optimum_from_samples(
        steps,
        torch.tensor(rewards, dtype=torch.float64),
        prompt_of,
        torch.tensor(ref_rewards, dtype=torch.float64),
        ref_prompt,
        beta,
        rng,
    )
    return {
        **out,
        "samples": samples,
        "ref_samples": ref_samples,
        "reward_range": list(rng),
        "reward_range_known": known,
        "reward_failures": failures + ref_failures,
    }


_REF_TEXTS: dict[tuple, list[str]] = {}
"""The last reference draw of :func:`estimate_kl_to_optimum`, keyed by the reference's weights, the prompts, the
count, the seed and the sampling settings: a grid's runs share one reference, and re-drawing 256 responses per
prompt for each run would cost more than the run's other final metrics together."""


_REF_DRAWS: dict[tuple, list] = {}
"""The last reference draw of :func:`forgetting_kl` (its forward direction), keyed as :data:`_REF_TEXTS`: a grid's
runs are measured against one reference, so only the policy's side is drawn again for each."""


@torch.no_grad()
def weights_fingerprint(model) -> str:
    """sha256 over a model's parameters and buffers (names, dtypes, shapes and bytes, in state-dict order)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def _reference_texts(
    ref,
    tokenizer,
    ids: Tensor,
    mask: Tensor,
    samples: int,
    pad: int,
    seed: int,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    rows_per_call: int = 256,
) -> list[str]:
    """``samples`` decoded reference responses per prompt, each prompt's contiguous (no KL: rewards only)."""
    from klgrad.rollout.encoding import decode_responses
    from klgrad.rollout.samplers import make_sampler

    sampler = make_sampler("klgrad", eos_id, pad)
    device = next(ref.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    per_call = max(1, rows_per_call // samples)
    texts: list[str] = []
    for lo in range(0, ids.shape[0], per_call):
        roll = sampler.generate(
            ref,
            ids[lo : lo + per_call].to(device),
            mask[lo : lo + per_call].to(device),
            group_size=samples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=gen,
        )
        texts += decode_responses(tokenizer, roll)
    return texts


@torch.no_grad()
def stepwise_mean_se(
    sampler_model,
    other,
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    *,
    seed: int,
) -> tuple[float, float]:
    """KL(sampler‖other) over P prompts: the mean over prompts of :func:`sample_stepwise`'s estimates and its
    clustered SE (:func:`~klgrad.exact.kl.clustered_mean_se`). With ``sampler_model`` the reference and ``other``
    the policy it is the forward KL(π_ref‖π)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    s, _ = sample_stepwise(
        sampler_model,
        other,
        prompt_ids,
        prompt_mask,
        samples=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_id=tokenizer.eos_token_id,
        pad_id=pad,
        generator=torch.Generator().manual_seed(seed),
    )  # (P·samples,)
    return clustered_mean_se(s, torch.arange(prompt_ids.shape[0]).repeat_interleave(samples))
