"""Held-out evaluation: greedy accuracy, sampled reward, sequence KL to the reference, the exact objective.

Used by the loop every ``train.eval_every`` steps (and for the reference at step 0); ``klgrad compare`` judges
each run's final policy with the same pieces (:func:`reference_log_ratios`, :func:`objective_on`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.config import Config
from klgrad.data.example import Example, examples_to_columns, repeat_columns
from klgrad.exact.objective import exact_objective
from klgrad.kl import sequence_kl_estimates, sequence_log_ratio
from klgrad.logprobs import sequence_logprobs
from klgrad.rewards import accuracy_reward_name, compute_rewards
from klgrad.rollout.batch import Rollout
from klgrad.rollout.encoding import decode_responses, encode_prompts, uses_chat


@torch.no_grad()
def evaluate(policy, ref, tokenizer, examples: list[Example], cfg: Config, specs, sampler, seed: int) -> dict:
    """Greedy accuracy, sampled reward and sequence KL to the reference on held-out prompts.

    The sampled reward is of the configured sampler (``rollout.top_p`` included). The KL estimates k1, k3 are of
    KL(π‖π_ref) between the full distributions, so they come from samples of the full policy: with
    ``top_p < 1`` (allowed only without a KL head) a second, untruncated sample is drawn for them, since the
    sampler's log-probs are of the full distribution and a truncated sample would make k1 estimate nothing.

    On the first :func:`eval_objective_prompts` prompts it also computes, by enumerating every response, the
    exact objective J_β = E_π[R] − β·KL(π‖π_ref) at β = ``kl.beta`` (the configured β, also under an adaptive β,
    so that every evaluation and every method of a comparison is judged on the same objective), its optimum J*,
    KL(π‖π*) = (J* − J_β)/β and KL(π‖π_ref), all against the reference in force (:func:`objective_metrics`).
    """
    prompts = [e.prompt for e in examples]
    device = next(policy.parameters()).device
    chat = uses_chat(cfg.data.prompt_format, tokenizer)
    ids, mask = (x.to(device) for x in encode_prompts(tokenizer, prompts, chat=chat))
    columns = examples_to_columns(examples)
    out: dict[str, float] = {}
    greedy = sampler.generate(policy, ids, mask, group_size=1, max_new_tokens=cfg.rollout.max_new_tokens, greedy=True)
    limits = {"failure_value": cfg.reward.failure_value, "timeout_s": cfg.reward.timeout_s}  # as in training
    greedy_rewards = compute_rewards(specs, prompts, decode_responses(tokenizer, greedy), columns, **limits)
    acc_name = accuracy_reward_name(greedy_rewards.per_function)  # only a real accuracy reward is accuracy
    if acc_name is not None:
        accuracy = greedy_rewards.per_function[acc_name]
        out["eval/greedy_accuracy"] = sum(a or 0.0 for a in accuracy) / len(accuracy)
    out["eval/greedy_reward"] = sum(greedy_rewards.total) / len(greedy_rewards.total)
    gen = torch.Generator().manual_seed(seed)

    k = cfg.train.eval_samples

    def sample(top_p: float):
        return sampler.generate(
            policy,
            ids,
            mask,
            group_size=k,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=top_p,
            generator=gen,
        )

    sampled = sample(cfg.rollout.top_p)  # (P·k) responses, each prompt's k contiguous
    texts = decode_responses(tokenizer, sampled)
    sampled_rewards = compute_rewards(
        specs, [p for p in prompts for _ in range(k)], texts, repeat_columns(columns, k), **limits
    )
    out["eval/sampled_reward"] = sum(sampled_rewards.total) / len(sampled_rewards.total)
    if acc_name is not None:
        hits = sampled_rewards.per_function[acc_name]
        out["eval/sampled_accuracy"] = sum(a or 0.0 for a in hits) / len(hits)
    if cfg.rollout.top_p < 1.0:  # the KL estimates need a sample of the full distribution
        sampled = sample(1.0)
    estimates = sequence_kl_estimates(reference_log_ratios(sampled, ref, ids.shape[1], cfg.rollout.temperature))
    out["eval/kl_k1"] = float(estimates["k1"].mean())
    out["eval/kl_k3"] = float(estimates["k3"].mean())
    n_objective = eval_objective_prompts(cfg)
    if n_objective:
        out.update(objective_metrics(objective_on(policy, ref, tokenizer, examples[:n_objective], specs, cfg)))
    return out


@torch.no_grad()
def reference_log_ratios(sampled: Rollout, ref, prompt_width: int, temperature: float) -> Tensor:
    """(N,) sequence log-ratios log π(y|x) − log π_ref(y|x) of sampled responses: the sampler's log-probs of
    the policy against the reference's, at the sampling temperature."""
    ref_logp, _ = sequence_logprobs(ref, sampled.input_ids, sampled.attention_mask, prompt_width, temperature)
    return sequence_log_ratio(sampled.logp, ref_logp, sampled.response_mask)


def objective_on(policy, ref, tokenizer, examples: list[Example], specs, cfg: Config) -> dict:
    """The exact objective J_β of ``policy`` against ``ref`` on ``examples`` at β = ``kl.beta`` (every response
    enumerated: :func:`~klgrad.exact.objective.exact_objective`), its optimum and KL(π‖π*)."""
    return exact_objective(
        policy,
        ref,
        tokenizer,
        examples,
        specs,
        beta=cfg.kl.beta,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        reward_batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        reward_timeout_s=cfg.reward.timeout_s,
        reward_failure_value=cfg.reward.failure_value,
        chat=uses_chat(cfg.data.prompt_format, tokenizer),
    )


def eval_objective_prompts(cfg: Config) -> int:
    """Held-out prompts of the exact objective at each evaluation: ``train.eval_objective_prompts``, or when
    null 20 for short answers (``rollout.max_new_tokens`` ≤ 10, small response trees) with ``kl.beta`` > 0 and
    ``rollout.top_p`` = 1, else 0."""
    if cfg.train.eval_objective_prompts is not None:
        return cfg.train.eval_objective_prompts
    short = cfg.rollout.max_new_tokens <= 10
    return 20 if short and cfg.kl.beta > 0 and cfg.rollout.top_p == 1.0 else 0


def objective_metrics(obj: dict) -> dict[str, float]:
    """The metrics-record keys of an :func:`~klgrad.exact.objective.exact_objective` result."""
    return {
        "eval/J": obj["J"],
        "eval/J_star": obj["J_star"],
        "eval/kl_to_optimum": obj["kl_to_optimum"],
        "eval/exact_kl": obj["kl"],
        "eval/objective_pruned_mass": obj["pruned_mass"],
        "eval/objective_pruned_mass_ref": obj["pruned_mass_ref"],
        "eval/objective_reward_error": obj["reward_error"],
        "eval/J_star_error": obj["J_star_error"],
        "time/eval_objective": obj["seconds"],
        "time/eval_objective_rewards": obj["seconds_rewards"],
    }
