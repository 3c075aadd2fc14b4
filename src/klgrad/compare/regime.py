r"""Which regime are a config's prompts in? ``klgrad regime``: the sequence-level fixed points from the
reference's own samples.

At sequence level both fixed points depend on a response only through its reward R and its reference
probability (docs/math.md, "Where training ends"):

- k1_in_reward, k2_as_loss (exact reverse-KL gradient): π*(y) ∝ π_ref(y)·e^{R(y)/β};
- k3_as_loss, k3_in_reward (the forward-KL gradient): π_f(y) = β·π_ref(y)/(λ − R(y)), λ ∈ (max R, max R + β].

Grouping a prompt's responses by reward value is therefore exact: with reference masses m_j on reward values R_j,

    π*_j = m_j·e^{R_j/β} / Σ_k m_k·e^{R_k/β},    KL(π*‖π_ref) = Σ_j π*_j·log(π*_j / m_j),
    π_f,j = β·m_j/(λ − R_j),                      KL(π_f‖π_ref) = Σ_j π_f,j·log(π_f,j / m_j),

and the KL of a prompt set is the mean over its prompts. Worked check (one prompt, β = 0.5): masses
{1: 0.6, 0: 0.4} give reverse 0.2589, forward 0.1517 (k3 holds the policy closer: sharpening); {1: 0.02, 0: 0.98}
give 0.1418 and 1.3487 (k2 holds closer: discovery).

Beside each fixed point's KL(·‖π_ref) the report gives its forward KL to the reference, KL(π_ref‖·), the direction
forgetting tracks (arXiv 2509.04259): KL(π_ref‖π*) = Σ_j m_j·log(m_j/π*_j), KL(π_ref‖π_f) = Σ_j m_j·log(m_j/π_f,j)
(``forward_kl_reverse``, ``forward_kl_forward`` per prompt; ``predicted_forward_kl`` over the set). Worked check,
β = 0.5: {1: 0.6, 0: 0.4} give 0.3756 (π*) and 0.1875 (π_f); {1: 0.02, 0: 0.98} give 0.0803 and 0.6328.

Here the masses are estimated from K samples of the reference per prompt, at the config's temperature and
length cap, scored by the config's rewards. What that estimate can and cannot see:

- a reward value no sample reached has estimated mass 0, and then no fixed point puts mass on it: a prompt whose
  K samples all fail predicts KL 0 for both heads, although with a true success mass of 1/(10K) the forward
  optimum would move far. ``prompts_never_rewarded`` counts them; more samples shrink the blind spot;
- the sampling uncertainty of the set means (and of their difference) is a bootstrap over each prompt's samples
  (resampled with replacement, every prompt independently): the 2.5 and 97.5 percentiles of B resamples;
- token-level heads (what GRPO, TRL and verl use) are approximated by the same sequence-level numbers.

``closer`` is ``k3_as_loss`` when the forward-KL optimum is closer to the reference (smaller KL) than the reverse
one with the difference's bootstrap interval excluding 0, ``k2_as_loss`` in the opposite case, else ``tie``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from klgrad.exact.optima import forward_kl_optimum, kl_divergence, reverse_kl_optimum

DEFAULT_SAMPLES = 32
"""K, reference samples per prompt."""
DEFAULT_PROMPTS = 64
"""Training prompts sampled (the first ones of the config's training split)."""
BOOTSTRAP = 400
"""Bootstrap resamples behind the intervals."""


def reward_masses(rewards: Sequence[float]) -> list[tuple[float, float]]:
    """[(R_j, m_j)]: each distinct reward value among one prompt's samples and its share of them, by R."""
    counts = Counter(float(r) for r in rewards)
    n = len(rewards)
    return sorted((value, count / n) for value, count in counts.items())


def fixed_point_kls(masses: Sequence[tuple[float, float]], beta: float) -> tuple[float, float]:
    """(KL(π*‖π_ref), KL(π_f‖π_ref)) of one prompt whose reference puts mass m_j on reward R_j (float64)."""
    reward = torch.tensor([r for r, _ in masses], dtype=torch.float64)
    ref = torch.tensor([m for _, m in masses], dtype=torch.float64)
    if len(masses) == 1:  # one reward value: every fixed point is the reference
        return 0.0, 0.0
    pi_star = reverse_kl_optimum(ref, reward, beta)
    pi_f, _ = forward_kl_optimum(ref, reward, beta)
    return kl_divergence(pi_star, ref), kl_divergence(pi_f, ref)


def fixed_point_forward_kls(masses: Sequence[tuple[float, float]], beta: float) -> tuple[float, float]:
    """(KL(π_ref‖π*), KL(π_ref‖π_f)): the forward KL to the reference of both fixed points of one prompt whose
    reference puts mass m_j on reward R_j (float64)."""
    reward = torch.tensor([r for r, _ in masses], dtype=torch.float64)
    ref = torch.tensor([m for _, m in masses], dtype=torch.float64)
    if len(masses) == 1:
        return 0.0, 0.0
    pi_star = reverse_kl_optimum(ref, reward, beta)
    pi_f, _ = forward_kl_optimum(ref, reward, beta)
    return kl_divergence(ref, pi_star), kl_divergence(ref, pi_f)


def prompt_entry(rewards: Sequence[float], beta: float, successes: Sequence[bool]) -> dict[str, Any]:
    """One prompt of ``regime.json``: its success rate (the share of ``successes``: samples the accuracy reward
    scored correct), its reward masses and both fixed points' KL to the reference, in both directions."""
    masses = reward_masses(rewards)
    reverse, forward = fixed_point_kls(masses, beta)
    fkl_reverse, fkl_forward = fixed_point_forward_kls(masses, beta)
    return {
        "success_rate": sum(successes) / len(successes),
        "masses": [[r, m] for r, m in masses],
        "kl_reverse": reverse,
        "kl_forward": forward,
        "forward_kl_reverse": fkl_reverse,
        "forward_kl_forward": fkl_forward,
    }


def bootstrap_intervals(
    per_prompt_rewards: Sequence[Sequence[float]], beta: float, resamples: int, seed: int
) -> dict[str, list[float]]:
    """95% percentile intervals of the set means of KL(π*‖π_ref), KL(π_f‖π_ref) and their difference (forward −
    reverse), and of the forward KLs KL(π_ref‖π*), KL(π_ref‖π_f) (``forward_kl_reverse``, ``forward_kl_forward``),
    resampling every prompt's samples with replacement ``resamples`` times."""
    rng = np.random.default_rng(seed)
    means = np.zeros((resamples, 4))
    cache: dict[tuple, tuple[float, ...]] = {}
    for b in range(resamples):
        total = np.zeros(4)
        for rewards in per_prompt_rewards:
            draw = np.asarray(rewards)[rng.integers(0, len(rewards), len(rewards))]
            key = tuple(reward_masses(draw.tolist()))
            if key not in cache:
                cache[key] = (*fixed_point_kls(key, beta), *fixed_point_forward_kls(key, beta))
            total += cache[key]
        means[b] = total / len(per_prompt_rewards)
    diff = means[:, 1] - means[:, 0]

    def interval(x: np.ndarray) -> list[float]:
        return [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))]

    return {
        "reverse": interval(means[:, 0]),
        "forward": interval(means[:, 1]),
        "forward_minus_reverse": interval(diff),
        "forward_kl_reverse": interval(means[:, 2]),
        "forward_kl_forward": interval(means[:, 3]),
    }


def most_influential(prompts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The prompt whose leaving out moves the set's predicted gap most, and the gap without it.

    With d_i = KL(π_f‖π_ref) − KL(π*‖π_ref) of prompt i and d̄ their mean over n prompts, leaving prompt j out gives
    (n·d̄ − d_j)/(n − 1) = d̄ + (d̄ − d_j)/(n − 1): the prompt with the largest |d_j − d̄|. A prompt the reference
    gets right very rarely has its forward-KL fixed point far from the reference (KL ~ log(1/p)), so one such prompt
    can carry a set's verdict (a run that rarely sees its reward does not reach that fixed point either). Returns
    its index (and ``id`` when the entry has one), success rate, d_j, d̄ and the mean without it; None below 2
    prompts."""
    n = len(prompts)
    if n < 2:
        return None
    d = [p["kl_forward"] - p["kl_reverse"] for p in prompts]
    mean = sum(d) / n
    j = max(range(n), key=lambda i: abs(d[i] - mean))
    return {
        "index": j,
        "id": prompts[j].get("id"),
        "success_rate": prompts[j]["success_rate"],
        "forward_minus_reverse": d[j],
        "mean_forward_minus_reverse": mean,
        "mean_without": (sum(d) - d[j]) / (n - 1),
    }


def summarize_regime(
    per_prompt_rewards: Sequence[Sequence[float]],
    beta: float,
    *,
    per_prompt_successes: Sequence[Sequence[bool]] | None = None,
    resamples: int = BOOTSTRAP,
    seed: int = 0,
) -> dict[str, Any]:
    """``regime.json``'s content from each prompt's sampled rewards (every prompt the same number of samples) and
    which samples were correct (default: reward ≥ 1, a 0/1 correctness reward)."""
    if not per_prompt_rewards:
        raise ValueError("regime: no prompts")
    if beta <= 0:
        raise ValueError(f"regime: beta must be > 0, got {beta}")
    if per_prompt_successes is None:
        per_prompt_successes = [[x >= 1.0 for x in r] for r in per_prompt_rewards]
    prompts = [prompt_entry(r, beta, ok) for r, ok in zip(per_prompt_rewards, per_prompt_successes, strict=True)]
    n = len(prompts)
    reverse = sum(p["kl_reverse"] for p in prompts) / n
    forward = sum(p["kl_forward"] for p in prompts) / n
    ci = bootstrap_intervals(per_prompt_rewards, beta, resamples, seed)
    lo, hi = ci["forward_minus_reverse"]
    closer = "k3_as_loss" if hi < 0 else "k2_as_loss" if lo > 0 else "tie"
    return {
        "beta": beta,
        "n_prompts": n,
        "samples_per_prompt": len(per_prompt_rewards[0]),
        "success_rate": sum(p["success_rate"] for p in prompts) / n,
        "predicted_kl": {"reverse": reverse, "forward": forward},
        "predicted_forward_kl": {
            "reverse": sum(p["forward_kl_reverse"] for p in prompts) / n,
            "forward": sum(p["forward_kl_forward"] for p in prompts) / n,
        },
        "interval_95": ci,
        "closer": closer,
        "prompts_never_rewarded": sum(p["success_rate"] == 0 for p in prompts),
        "prompts_always_rewarded": sum(p["success_rate"] == 1 for p in prompts),
        "prompts": prompts,
    }


def binary_crossover(beta: float) -> float:
    """The success rate p at which the two fixed points of a binary reward (1 with mass p, else 0) are equally
    far from the reference: below it k2 holds closer (discovery), above it k3 does (sharpening). Bisection on
    p ∈ (0, 1), where forward − reverse falls from positive to negative."""

    def gap(p: float) -> float:
        reverse, forward = fixed_point_kls([(0.0, 1 - p), (1.0, p)], beta)
        return forward - reverse

    lo, hi = 1e-9, 1 - 1e-9
    if gap(lo) * gap(hi) > 0:
        return math.nan
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return 0.5 * (lo + hi)


def plot_regime(result: dict[str, Any], path: Path, title: str) -> None:
    """Prompts by success rate, the binary-reward KL curves of both fixed points with the crossover for β, and the
    predicted KL of each head with its interval."""
    from klgrad.plotting import pyplot, save

    plt = pyplot()
    beta = result["beta"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.0))
    rates = [p["success_rate"] for p in result["prompts"]]
    axes[0].hist(rates, bins=np.linspace(0, 1, 21), color="#1f5f8b", edgecolor="white")
    axes[0].set_title(f"prompts by reference success rate (K = {result['samples_per_prompt']})", fontsize=10)
    axes[0].set_xlabel("success rate")
    axes[0].set_ylabel("prompts")
    ps = np.geomspace(1e-4, 0.999, 240)
    curves = np.array([fixed_point_kls([(0.0, 1 - p), (1.0, p)], beta) for p in ps])
    axes[1].plot(ps, curves[:, 0], color="#1f5f8b", label="reverse KL optimum π* (k1_in_reward, k2_as_loss)")
    axes[1].plot(ps, curves[:, 1], color="#c0392b", label="forward KL optimum π_f (k3)")
    cross = binary_crossover(beta)
    if math.isfinite(cross) and cross >= ps[0]:
        axes[1].axvline(cross, color="gray", ls=":", label=f"crossover p = {cross:.3g}: k2 closer left of it")
    seen = [r for r in rates if r > 0]
    never = len(rates) - len(seen)
    axes[1].plot(
        seen,
        np.full(len(seen), 1.5e-3),
        "|",
        color="black",
        ms=12,
        label=f"this set's prompts ({never} never rewarded: not shown)",
    )
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_ylim(1e-3, None)
    axes[1].set_title(f"KL(optimum‖π_ref) for a 0/1 reward, β = {beta:g}", fontsize=10)
    axes[1].set_xlabel("reference success rate p")
    axes[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ci = result["interval_95"]
    values = [result["predicted_kl"]["reverse"], result["predicted_kl"]["forward"]]
    # percentile intervals need not contain the estimate (the bootstrap mean of a KL of estimated masses is biased):
    # draw each interval as it is, beside the bar
    keys = ("reverse", "forward")
    names = ["k1_in_reward / k2_as_loss\n(π*)", "k3_as_loss\n(π_f)"]
    axes[2].bar(names, values, color=["#1f5f8b", "#c0392b"], alpha=0.8)
    for i, k in enumerate(keys):
        axes[2].plot([i, i], ci[k], color="black", lw=2, marker="_", ms=14, label="95% bootstrap" if i == 0 else None)
    axes[2].legend(fontsize=8)
    axes[2].set_title(f"predicted KL to π_ref ({result['n_prompts']} prompts, 95% bootstrap)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: closer to the reference at the fixed point: {result['closer']}", fontsize=11)
    fig.tight_layout()
    save(fig, path, dpi=110)


def run_regime(
    cfg, out: Path, *, beta: float | None, samples: int, prompts: int, seed: int, split: str = "train"
) -> dict[str, Any]:
    """Sample the config's reference K times on the first ``prompts`` prompts of its ``split`` ("train" or
    "heldout", the prompts ``klgrad compare`` measures its final KL on, in the same order), score with its rewards
    and write ``regime.json`` and ``regime.png`` into ``out``; returns the result. Each prompt's entry carries its
    example ``id``."""
    from tqdm import tqdm

    from klgrad.data.example import examples_to_columns, repeat_columns
    from klgrad.models import load_model_and_tokenizer
    from klgrad.models.sources import reference_path
    from klgrad.rewards import accuracy_reward_name, compute_rewards
    from klgrad.rollout.encoding import decode_responses, encode_prompts, uses_chat
    from klgrad.rollout.samplers import make_sampler
    from klgrad.trainer.setup import load_data, reward_specs

    beta = cfg.kl.beta if beta is None else beta
    if beta <= 0:
        raise ValueError(f"--beta must be > 0 (the fixed points are of J_β), got {beta}")
    if samples < 1 or prompts < 1:
        raise ValueError(f"--samples and --prompts must be >= 1, got {samples} and {prompts}")
    if split not in ("train", "heldout"):
        raise ValueError(f"--split must be train or heldout, got {split!r}")
    train_set, heldout = load_data(cfg)
    examples = (train_set if split == "train" else heldout)[:prompts]
    specs = reward_specs(cfg)
    model, tok = load_model_and_tokenizer(reference_path(cfg))
    chat = uses_chat(cfg.data.prompt_format, tok)
    sampler = make_sampler("klgrad", tok.eos_token_id, tok.pad_token_id)
    gen = torch.Generator().manual_seed(seed)
    per_prompt: list[list[float]] = []
    successes: list[list[bool]] = []
    accuracy = accuracy_reward_name(s.name for s in specs)
    batch = max(1, 256 // samples)
    for i in tqdm(range(0, len(examples), batch), desc="klgrad regime", unit="batch"):
        chunk = examples[i : i + batch]
        ids, mask = encode_prompts(tok, [e.prompt for e in chunk], chat=chat)
        with torch.no_grad():
            rollout = sampler.generate(
                model,
                ids,
                mask,
                group_size=samples,
                max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                generator=gen,
            )
        texts = decode_responses(tok, rollout)
        columns = repeat_columns(examples_to_columns(chunk), samples)
        scored = compute_rewards(specs, [e.prompt for e in chunk for _ in range(samples)], texts, columns)
        hits = scored.per_function[accuracy] if accuracy else None
        for j in range(len(chunk)):
            rows = slice(j * samples, (j + 1) * samples)
            per_prompt.append(list(scored.total[rows]))
            successes.append([h == 1.0 for h in hits[rows]] if hits else [])
    result = summarize_regime(per_prompt, beta, per_prompt_successes=successes if accuracy else None, seed=seed)
    for entry, example in zip(result["prompts"], examples, strict=True):
        entry["id"] = example.id
    result["split"] = split
    result["config"] = {
        "task": cfg.data.task,
        "digits": cfg.data.digits,
        "model": str(cfg.model.path or "embedded"),
        "temperature": cfg.rollout.temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens,
    }
    result["crossover_success_rate"] = binary_crossover(beta)
    result["most_influential"] = most_influential(result["prompts"])  # after the ids: it names the prompt
    out.mkdir(parents=True, exist_ok=True)
    (out / "regime.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    plot_regime(result, out / "regime.png", f"{cfg.data.task} ({result['config']['model']})")
    return result
