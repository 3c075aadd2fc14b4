r"""Every framework's KL term as its released code computes it: the presets of ``klgrad audit --framework``.

Each preset was read from the framework's code at the commit in its ``source``; its ``versions`` were found by
reading the same lines in every release tag (or released package) and its ``default`` says in which versions
it is what switching the framework's KL on gives. Per-token rules take (l, r, o, mask): l = log π (carries
gradient), r = reference, o = behaviour (the rollout's log-prob: the trainer's recomputation or, where the
framework uses it, the inference engine's), at KL weight β = 1 (:mod:`klgrad.audit.framework_kl`).

Read 2026-11-25 from these snapshots (sha, commit date): huggingface/trl f2cd5771 (2026-07-24) and the released
packages 1.9.2–1.16.0; volcengine/verl b178a3cd (2026-01-29) and the 0.7.1–0.9.1 packages; OpenRLHF/OpenRLHF
3c3be623 (2026-08-13); THUDM/slime 624b824a (2026-08-21); NVIDIA-NeMo/RL 7ea279ab (2026-08-22);
complex-reasoning/RPG ec8e30bd (2026-06-14); alibaba/ROLL 8eb27cc2 (2026-08-19); inclusionAI/AReaL 4aef98d8
(2026-05-21); allenai/open-instruct e6c3044a (2026-08-20); pytorch/torchtune bd2a0fc7 (2026-04-23);
PrimeIntellect-ai/prime-rl 559b4477 (2026-08-21); NovaSky-AI/SkyRL a9564572 (2026-08-21); modelscope/ms-swift
3602360a (2026-08-22); thinking-machines-lab/tinker-cookbook 9dfcc3a2 (2026-08-19, v0.5.5). Re-read 2026-11-26, with
the same snapshots: ROLL (its tags v0.1.0–v0.3.0), ms-swift (tags v3.12.6–v4.5.2), TRL's bias-correction presets
(the 1.9.2, 1.10.0 and 1.16.0 packages), OpenRLHF's KL loss (the 0.11.1 and 0.11.2 packages) and SkyRL (the skyrl
0.3.0 package); those presets' sources say so.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from klgrad.audit.framework_kl import (
    FrameworkKL,
    k1_value,
    k2_value,
    k3_value,
    low_var_kl,
    sequence_mean_ratio,
    straight_through,
    token_ratio,
)
from klgrad.choices import FRAMEWORKS


def nemo_kl(l: Tensor, r: Tensor, weight: Tensor, input_clamp: float | None = 20.0, output_clamp: float | None = 10.0):
    """NeMo-RL's ``calculate_kl`` (k3): log-ratio x = r − l clamped to ±``input_clamp``, the weight detached where
    that clamp acts, weight·(e^x − 1 − x), then clamped to ±``output_clamp`` (None: no clamp)."""
    x = r - l
    if input_clamp is not None:
        clamped = x.clamp(-input_clamp, input_clamp)
        weight = torch.where(x == clamped, weight, weight.detach())
        x = clamped
    kl = weight * (torch.exp(x) - 1 - x)
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


def clamp10(x: Tensor) -> Tensor:
    return x.clamp(-10.0, 10.0)


def openrlhf_unbiased_gradient(l: Tensor, r: Tensor, o: Tensor, m: Tensor) -> Tensor:
    """OpenRLHF ``--algo.kl.unbiased_gradient``: the value of the chosen estimator (k1 by default), clamped ±10,
    with the gradient of w·½(l − r)², w = e^{l − o} capped at 10 and detached (its straight-through form)."""
    w = token_ratio(l, o).clamp(max=10.0).detach()
    return straight_through(clamp10(k1_value(l, r)), w * k2_value(l, r))


def zero(l: Tensor, r: Tensor, o: Tensor, m: Tensor) -> Tensor:
    """No term at all (a flag the code reads and ignores)."""
    return torch.zeros_like(l)


_TRL = "huggingface/trl@f2cd57710ae3 (2026-07-24; same lines in the 1.9.2–1.16.0 packages) "
_VERL = "volcengine/verl@b178a3cd56f5 (2026-01-29; 0.8.0–0.9.1 packages) verl/trainer/ppo/core_algos.py kl_penalty"
_ORLHF = "OpenRLHF/OpenRLHF@3c3be6234e0c (2026-08-13) openrlhf/models/utils.py compute_approx_kl"
_SLIME = "THUDM/slime@624b824a898a (2026-08-21) slime/"
_NEMO = "NVIDIA-NeMo/RL@7ea279abfbeb (2026-08-22) nemo_rl/algorithms/"
_RPG = "complex-reasoning/RPG@ec8e30bdc6f8 (2026-06-14) verl/trainer/ppo/core_algos.py kl_penalty('{}')"

PRESETS_BY_FRAMEWORK: dict[str, tuple[FrameworkKL, ...]] = {}


def _add(*presets: FrameworkKL) -> None:
    for p in presets:
        PRESETS_BY_FRAMEWORK.setdefault(p.framework, ())
        PRESETS_BY_FRAMEWORK[p.framework] += (p,)


# ---------------------------------------------------------------------------------------------------- TRL
_add(
    FrameworkKL(
        "trl/grpo-k3",
        "GRPOTrainer beta > 0: k3 in the loss",
        "loss",
        lambda l, r, o, m: k3_value(l, r),
        ">=0.14",
        _TRL + "trl/trainer/grpo_trainer.py _compute_loss: per_token_kl = exp(ref − logp) − (ref − logp) − 1; "
        "per_token_loss + beta·per_token_kl; loss_type default dapo (global token mean) since 0.22",
        "token_mean",
        default=">=0.14,<1.10",
        note="beta defaults to 0 (KL off) since 0.19; loss_type grpo (per-sequence mean) was the only reduction "
        "in 0.14–0.15",
    ),
    FrameworkKL(
        "trl/grpo-k3-bias-correction",
        "use_bias_correction_kl: k3 × π/π_old, token ratio",
        "loss",
        lambda l, r, o, m: k3_value(l, r) * token_ratio(l, o),
        ">=0.26",
        _TRL + "trl/trainer/grpo_trainer.py: per_token_kl * coef_1, coef_1 = exp(logp − old_logp), neither "
        "detached nor clipped (added in 0.26, commit f7d4985). Default True from 1.10 (PR #6503), read in the "
        "released packages (the snapshot predates it and says False): trl 1.10.0 trl/trainer/grpo_config.py:965-966 "
        "use_bias_correction_kl default=True, trl/trainer/grpo_trainer.py:3124-3146; trl 1.9.2 "
        "grpo_config.py:962-963 default=False",
        "token_mean",
        default=">=1.10",
    ),
    FrameworkKL(
        "trl/grpo-k3-bias-correction-gspo",
        "use_bias_correction_kl with importance_sampling_level=sequence (GSPO)",
        "loss",
        lambda l, r, o, m: k3_value(l, r) * sequence_mean_ratio(l, o, m),
        ">=0.26",
        _TRL + "trl/trainer/grpo_trainer.py: coef_1 = exp(Σ_t m_t(logp − old)/|y|), shape (B, 1), times every "
        "token's k3 (re-read 2026-11-26 in the trl 1.10.0 package, grpo_trainer.py:3127-3146, and 1.16.0, "
        "grpo_trainer.py:3087-3105: unchanged)",
        "token_mean",
        note="TRL's docstring says the correction is unbiased only at token level; PR #6594 (the per-token ratio "
        "here) was closed unmerged and PR #7188 (the same) is open, so no release has it; with the 1.10 default "
        "this is what GSPO users get when beta > 0",
    ),
    FrameworkKL(
        "trl/rloo-k1-reward",
        "RLOOTrainer beta > 0: Σ k1(old − ref) subtracted from the reward",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.12",
        _TRL + "trl/trainer/rloo_trainer.py: kl = ((old − ref)·mask).sum(-1); rewards − beta·kl before the "
        "leave-one-out baseline; ratio exp(Σ(logp − old)) clipped 0.2, mean over sequences",
        "token_sum",
        default=">=0.12",
        returns="sequence",
        ratio="sequence",
        note="beta defaults to 0.05: on by default; the pre-0.22 trainer (kl_coef, rloo_k) computes the same sum",
    ),
    FrameworkKL(
        "trl/ppo-k1-reward",
        "PPOTrainer kl_estimator=k1: per-token reward, GAE γ = 1, λ = 0.95",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.12,<1.13",
        _TRL + "trl/experimental/ppo/ppo_trainer.py (1.12.0 package): non_score_reward = −kl_coef·kl per token, "
        "GAE gamma 1.0, lam 0.95; removed in 1.13 (PR #7020)",
        "token_mean",
        default=">=0.12,<1.13",
        returns="to_go",
        lam=0.95,
        note="audited with a zero critic (GAE = λ-discounted reward-to-go); advantages are whitened",
    ),
    FrameworkKL(
        "trl/ppo-k3-reward",
        "PPOTrainer kl_estimator=k3: per-token reward, GAE γ = 1, λ = 0.95",
        "reward",
        lambda l, r, o, m: k3_value(l, r),
        ">=0.17,<1.13",
        _TRL + "trl/experimental/ppo/ppo_trainer.py: kl = (exp(ref − logprobs) − 1) − (ref − logprobs) (added "
        "in 0.17, commit 4bfb8eb)",
        "token_mean",
        returns="to_go",
        lam=0.95,
    ),
)

# ---------------------------------------------------------------------------------------------------- verl
_add(
    FrameworkKL(
        "verl/kl-loss-k1",
        "actor.use_kl_loss, kl_loss_type=kl (k1)",
        "loss",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.2",
        _VERL + "_forward: logprob − ref_logprob; dp_actor: agg_loss(kld, loss_agg_mode) · kl_loss_coef",
        "token_mean",
    ),
    FrameworkKL(
        "verl/kl-loss-abs",
        "actor.use_kl_loss, kl_loss_type=abs",
        "loss",
        lambda l, r, o, m: (l - r).abs(),
        ">=0.2",
        _VERL + "_forward: (logprob − ref_logprob).abs()",
        "token_mean",
    ),
    FrameworkKL(
        "verl/kl-loss-mse",
        "actor.use_kl_loss, kl_loss_type=mse (k2)",
        "loss",
        lambda l, r, o, m: k2_value(l, r),
        ">=0.2",
        _VERL + "_forward: 0.5 · (logprob − ref_logprob).square()",
        "token_mean",
    ),
    FrameworkKL(
        "verl/kl-loss-low-var-kl",
        "actor.use_kl_loss, kl_loss_type=low_var_kl (k3, the default type)",
        "loss",
        lambda l, r, o, m: low_var_kl(l, r),
        ">=0.2",
        _VERL + "_forward: clamp(r − l, ±20) (since 0.4.1; it acts only where the outer clamp already does), "
        "k3, clamp(k3, ±10)",
        "token_mean",
        default=">=0.2",
    ),
    FrameworkKL(
        "verl/kl-loss-low-var-kl-plus",
        "actor.use_kl_loss, kl_loss_type=low_var_kl+ (k3 value, k2 gradient)",
        "loss",
        lambda l, r, o, m: straight_through(low_var_kl(l, r), k2_value(l, r)),
        ">=0.8",
        _VERL + ": '+' suffix stripped, backward k2 − k2.detach() + forward.detach() (0.8.0 package, PR #6058); "
        "in 0.6.0–0.7.1 every '+' name raised NotImplementedError",
        "token_mean",
    ),
    FrameworkKL(
        "verl/kl-reward-grpo",
        "algorithm.use_kl_in_reward (k1) with adv_estimator=grpo",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.4",
        _VERL + " + ray_trainer.apply_kl_penalty: token_level_rewards = scores − β·kl(old, ref); GRPO sums the "
        "token rewards, subtracts the group mean, divides by the group std",
        "token_mean",
        returns="sequence",
        std_normalised="the group std (GRPO's default normalisation, as its source line records)",
        note="in 0.2–0.3 there was no switch: k1 in the reward was on whenever use_kl_loss was off",
    ),
    FrameworkKL(
        "verl/kl-reward-gae",
        "algorithm.use_kl_in_reward (k1) with adv_estimator=gae (γ = λ = 1, the defaults)",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.4",
        _VERL + " + ray_trainer.apply_kl_penalty + compute_gae_advantage_return (gamma 1.0, lam 1.0)",
        "token_mean",
        default=">=0.4",
        returns="to_go",
        note="audited with a zero critic: reward-to-go",
    ),
)

# ---------------------------------------------------------------------------------------------------- OpenRLHF
_add(
    FrameworkKL(
        "openrlhf/k1-reward",
        "default: k1 in the reward (init_kl_coef 0.01), GAE γ = λ = 1, clamped ±10",
        "reward",
        lambda l, r, o, m: clamp10(k1_value(l, r)),
        ">=0.8.6",
        _ORLHF + " (clamp ±10 of the estimator's output since 0.8.6, commit d90b3d1) + compute_reward: "
        "−kl_coef·kl per token, reward-to-go in every advantage estimator",
        "token_mean",
        default=">=0.8.6",
        returns="to_go",
        note="audited with a zero critic; the group-normalising estimators scale the task reward only, never the KL",
    ),
    FrameworkKL(
        "openrlhf/k1-reward-unclamped",
        "default: k1 in the reward, reward-to-go, no clamp",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        "<0.8.6",
        "OpenRLHF/OpenRLHF v0.8.5 openrlhf/models/utils.py compute_approx_kl: no clamp",
        "token_mean",
        default="<0.8.6",
        returns="to_go",
        note="λ was 0.95 in ≤0.5.6 and 0.6.0–0.6.3 (not audited); per-sequence token mean before 0.7.0",
    ),
    FrameworkKL(
        "openrlhf/kl-loss-k1",
        "use_kl_loss with the default kl_estimator k1",
        "loss",
        lambda l, r, o, m: clamp10(k1_value(l, r)),
        ">=0.8.6",
        _ORLHF + ": log_ratio.clamp(±10) on l − r; ppo_actor: actor_loss + kl_loss·kl_ctl",
        "token_mean",
        note="the CLI only prints 'Recommend k2 or k3'; the default estimator stays k1",
    ),
    FrameworkKL(
        "openrlhf/kl-loss-k2",
        "use_kl_loss, kl_estimator=k2",
        "loss",
        lambda l, r, o, m: clamp10(k2_value(l, r)),
        ">=0.8.6",
        _ORLHF + "(kl_estimator='k2'): (l − r)²/2, clamp ±10",
        "token_mean",
    ),
    FrameworkKL(
        "openrlhf/kl-loss-k3",
        "use_kl_loss, kl_estimator=k3",
        "loss",
        lambda l, r, o, m: clamp10(k3_value(l, r)),
        ">=0.8.6",
        _ORLHF + "(kl_estimator='k3'): e^{r−l} − 1 − (r − l), clamp ±10; the 0.11.2 package also clamps l − r "
        "at −10 before the exponential (models/utils.py:106-109), where k3 > 10 is clamped anyway: the same value "
        "and gradient",
        "token_mean",
    ),
    FrameworkKL(
        "openrlhf/kl-loss-k3-unclamped",
        "use_kl_loss, kl_estimator=k3, no clamp",
        "loss",
        lambda l, r, o, m: k3_value(l, r),
        ">=0.6,<0.8.6",
        "OpenRLHF/OpenRLHF v0.8.5 openrlhf/models/utils.py compute_approx_kl (use_kl_estimator_k3 in 0.4.6–0.6.0)",
        "token_mean",
    ),
    FrameworkKL(
        "openrlhf/kl-loss-unbiased-gradient",
        "--algo.kl.use_loss --algo.kl.unbiased_gradient: the estimator's value, the gradient of w·k2 (w = π/π_old "
        "capped at 10, detached)",
        "loss",
        openrlhf_unbiased_gradient,
        ">=0.11.1",
        "openrlhf 0.11.1 and 0.11.2 packages (PR #1309, merged 2026-08-14, after the v0.11.0 snapshot 3c3be623, "
        "which lacks it; read 2026-11-26) openrlhf/models/utils.py compute_approx_kl: value.clamp(±10) of the "
        "estimator; if unbiased_gradient: w = exp(logp − old).clamp(max=10).detach(), value.detach() + "
        "w·½(l − r)² − (w·½(l − r)²).detach() (0.11.2: models/utils.py:113-127); trainer/ray/ppo_actor.py:318-325 "
        "passes old_action_log_probs; cli/train_ppo_ray.py:458-460 --algo.kl.unbiased_gradient default False",
        "token_mean",
        note="off by default; the estimator (k1/k2/k3) only changes the logged value, every one gets this gradient; "
        "the ½(l − r)² surrogate is not clamped",
    ),
)

# ---------------------------------------------------------------------------------------------------- slime
_add(
    FrameworkKL(
        "slime/kl-coef-grpo",
        "--kl-coef with the default --advantage-estimator grpo (also gspo, cispo): ignored",
        "reward",
        zero,
        ">=0.1",
        _SLIME + "backends/megatron_utils/loss.py get_grpo_returns: returns = ones_like(kl)·reward; the KL is read "
        "for its shape only, with no warning",
        "seq_mean",
        default=">=0.1",
        note="a nonzero --kl-coef still loads the reference model",
    ),
    FrameworkKL(
        "slime/kl-coef-reinforce-pp",
        "--kl-coef with --advantage-estimator reinforce_plus_plus (k1, reward-to-go γ = 1)",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.1",
        _SLIME + "backends/megatron_utils/loss.py: rewards = −kl_coef·kl per token, task reward on the last "
        "token, chunked_discounted_returns(gamma 1.0); --normalize-advantages required",
        "seq_mean",
        returns="to_go",
    ),
    FrameworkKL(
        "slime/kl-coef-reinforce-pp-baseline",
        "--kl-coef with reinforce_plus_plus_baseline (each token its own k1, no return)",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.1",
        _SLIME + "backends/megatron_utils/loss.py: ones_like(kl)·reward − kl_coef·kl",
        "seq_mean",
        returns="token",
    ),
    FrameworkKL(
        "slime/kl-coef-ppo",
        "--kl-coef with --advantage-estimator ppo (GAE γ = λ = 1)",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.2",
        _SLIME + "backends/megatron_utils/loss.py: token reward −kl_coef·kl, GAE(gamma 1.0, lambd 1.0)",
        "seq_mean",
        returns="to_go",
        note="audited with a zero critic",
    ),
    FrameworkKL(
        "slime/kl-loss-k1",
        "--use-kl-loss with the default --kl-loss-type k1",
        "loss",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.1",
        _SLIME + "utils/ppo_utils.py compute_approx_kl: log_probs − log_probs_base, no clamp; "
        "loss + kl_loss_coef·sum_of_sample_mean(kl)",
        "seq_mean",
        default=">=0.1",
        note="--kl-loss-coef defaults to 0; the type was named 'kl' in 0.1",
    ),
    FrameworkKL(
        "slime/kl-loss-low-var-kl",
        "--use-kl-loss --kl-loss-type low_var_kl",
        "loss",
        lambda l, r, o, m: clamp10(k3_value(l, r)),
        ">=0.1",
        _SLIME + "utils/ppo_utils.py compute_approx_kl: k3, clamp ±10 (low_var_kl only; no input clamp)",
        "seq_mean",
    ),
    FrameworkKL(
        "slime/kl-loss-low-var-kl-unbiased",
        "--use-kl-loss --kl-loss-type low_var_kl --use-unbiased-kl",
        "loss",
        lambda l, r, o, m: clamp10(token_ratio(l, o) * k3_value(l, r)),
        ">=0.2.1",
        _SLIME + "utils/ppo_utils.py compute_approx_kl: kl = exp(logp − old)·k3 (ratio not detached, not "
        "clipped), then clamp ±10 (added in 0.2.1, commit cfad76e)",
        "seq_mean",
    ),
)

# ---------------------------------------------------------------------------------------------------- NeMo-RL
_add(
    FrameworkKL(
        "nemo-rl/k3-loss",
        "reference_policy_kl_penalty > 0: k3 × exp(l − sg(l)), clamps 20/10",
        "loss",
        lambda l, r, o, m: nemo_kl(l, r, torch.exp(l - l.detach())),
        ">=0.7",
        _NEMO + "utils.py calculate_kl + loss/loss_functions.py ClippedPGLossFn: weight exp(curr − curr.detach()) "
        "(#2506 33bce20d, #2958 2206ae11, first in 0.7.0)",
        "token_mean",
        default=">=0.7",
        note="reference_policy_kl_penalty defaults to 0.01 in the GRPO configs: on by default",
    ),
    FrameworkKL(
        "nemo-rl/k3-loss-on-policy-approximation",
        "use_on_policy_kl_approximation: k3 × exp(l − log π_gen), clamps 20/10",
        "loss",
        lambda l, r, o, m: nemo_kl(l, r, token_ratio(l, o)),
        ">=0.7",
        _NEMO + "loss/loss_functions.py: weight exp(curr − generation_logprobs), differentiable, unclipped",
        "token_mean",
        note="the weight's denominator is the inference engine's log-prob (the audit's behaviour)",
    ),
    FrameworkKL(
        "nemo-rl/k3-loss-detached-weight",
        "reference_policy_kl_penalty > 0: k3, weight 1 (or a detached exp(l − log π_gen)), clamps 20/10",
        "loss",
        lambda l, r, o, m: nemo_kl(l, r, torch.ones_like(l)),
        ">=0.5,<0.7",
        "NVIDIA-NeMo/RL v0.6.0 nemo_rl/algorithms/loss_functions.py: kl_importance_weights = ones (or "
        "exp(curr − gen).detach()), times calculate_kl (input ±20, output ±10, since 0.5.0)",
        "token_mean",
        default=">=0.5,<0.7",
    ),
    FrameworkKL(
        "nemo-rl/k3-loss-input-clamp",
        "reference_policy_kl_penalty > 0: k3, log-ratio clamped ±20",
        "loss",
        lambda l, r, o, m: nemo_kl(l, r, torch.ones_like(l), output_clamp=None),
        ">=0.4,<0.5",
        "NVIDIA-NeMo/RL v0.4.0 nemo_rl/algorithms/utils.py calculate_kl_penalty_joschu2020(clamp_value=20)",
        "token_mean",
        default=">=0.4,<0.5",
    ),
    FrameworkKL(
        "nemo-rl/k3-loss-unclamped",
        "reference_policy_kl_penalty > 0: k3, no clamp",
        "loss",
        lambda l, r, o, m: k3_value(l, r),
        "<0.4",
        "NVIDIA-NeMo/RL v0.3.1 nemo_rl/algorithms/utils.py calculate_kl_penalty_joschu2020: exp(r) − r − 1",
        "token_mean",
        default="<0.4",
    ),
    FrameworkKL(
        "nemo-rl/reinforce-pp-kl-in-reward",
        "reinforce_plus_plus with use_kl_in_reward: k3 per token in the advantage, no return",
        "reward",
        lambda l, r, o, m: nemo_kl(l, r, torch.ones_like(l)),
        ">=0.7",
        _NEMO + "advantage_estimator.py ReinforcePlusPlusAdvantageEstimator: adv = (r − group mean) − "
        "kl_coef·calculate_kl(prev_logprobs, ref) per token, then whitened",
        "token_mean",
        returns="token",
        note="in 0.6.0 the KL was applied both here and as the loss term (fixed in 0.7.0, #2530)",
    ),
    FrameworkKL(
        "nemo-rl/gae-kl-in-reward",
        "GAE with use_kl_in_reward: k3 per-token reward, λ = 0.95 (the PPO recipe's)",
        "reward",
        lambda l, r, o, m: nemo_kl(l, r, torch.ones_like(l)),
        ">=0.7",
        _NEMO + "advantage_estimator.py GeneralizedAdvantageEstimator._build_token_level_rewards: −kl_coef·"
        "calculate_kl(prev_logprobs, ref) per token; examples/configs/ppo_math_1B.yaml gae_lambda 0.95",
        "token_mean",
        returns="to_go",
        lam=0.95,
        note="audited with a zero critic",
    ),
    FrameworkKL(
        "nemo-rl/gae-k1-in-reward",
        "GAE with use_kl_in_reward, reference_policy_kl_type k1, gae_lambda 1",
        "reward",
        lambda l, r, o, m: clamp10(-(r - l).clamp(-20.0, 20.0)),
        ">=0.7",
        _NEMO + "advantage_estimator.py GeneralizedAdvantageEstimator: calculate_kl(logprobs, ref, "
        "loss_config.reference_policy_kl_type) (k1 = −clamp(r − l, ±20), output clamp ±10), GAE(gae_lambda)",
        "token_mean",
        returns="to_go",
        note="audited with a zero critic; the flags are this audit's choice, not a NeMo-RL recipe",
    ),
)

# ---------------------------------------------------------------------------------------------------- DeepSeek
_add(
    FrameworkKL(
        "deepseek-v3.2/unbiased-kl",
        "unbiased KL: k3 × π/π_old",
        "loss",
        lambda l, r, o, m: k3_value(l, r) * token_ratio(l, o),
        "report (arXiv 2512.02556)",
        "DeepSeek-V3.2 report (arXiv 2512.02556, eq. 7, as quoted in TRL #4637 and slime #1004): "
        "(π/π_old)(π_ref/π − log(π_ref/π) − 1), the ratio differentiable as in every public implementation",
        "token_sum",
        default="report (arXiv 2512.02556)",
    ),
)

# ---------------------------------------------------------------------------------------------------- RPG
_RPG_RULES: tuple[tuple[str, str, object], ...] = (
    ("fkl", "rpg_fkl: −log w", lambda l, r, o, m: -(l - r)),
    ("rkl", "rpg_rkl: w log w", lambda l, r, o, m: clamp10(torch.exp(l - r) * (l - r))),
    ("js", "rpg_js: ½(w + 1) log w", lambda l, r, o, m: clamp10(0.5 * (torch.exp(l - r) + 1) * (l - r))),
    ("ufkl", "rpg_ufkl: w − log w − 1", lambda l, r, o, m: clamp10(torch.exp(l - r) - (l - r) - 1)),
    ("urkl", "rpg_urkl: w(log w − 1) + 1", lambda l, r, o, m: clamp10(torch.exp(l - r) * (l - r - 1) + 1)),
    ("ujs", "rpg_ujs: ½(w − 1) log w", lambda l, r, o, m: clamp10(0.5 * (torch.exp(l - r) - 1) * (l - r))),
)
_RF_RULES: tuple[tuple[str, str, object], ...] = (
    ("rf-fkl", "rpg_rf_fkl: −1", lambda l, r, o, m: -torch.ones_like(l)),
    ("rf-rkl", "rpg_rf_rkl: w(log w + 1)", lambda l, r, o, m: clamp10(torch.exp(l - r) * (l - r + 1))),
    ("rf-ufkl", "rpg_rf_ufkl: w − 1", lambda l, r, o, m: clamp10(torch.exp(l - r) - 1)),
    ("rf-urkl", "rpg_rf_urkl: w log w", lambda l, r, o, m: clamp10(torch.exp(l - r) * (l - r))),
)
for _key, _label, _rule in _RPG_RULES:
    _separate = FrameworkKL(
        f"rpg/{_key}",
        f"{_label}, separate reference (use_iterative_ref_model=False)",
        "loss",
        _rule,
        "main@2026-06-14",
        _RPG.format("rpg_" + _key) + ": w = exp(logprob − ref_logprob), value clamped ±10 (rpg_fkl: none); "
        "dp_actor: agg_loss(token-mean)",
        "token_mean",
    )
    _add(
        _separate,
        dataclasses.replace(
            _separate,
            id=f"rpg/{_key}-iterative",
            variant=f"{_label}, reference = π_old (use_iterative_ref_model=True, as RPG's scripts run it)",
            reference_is_behaviour=True,
            default="main@2026-06-14",
            note="with the reference equal to π_old the term is 0 on each rollout's first mini-batch; later "
            "mini-batches of the same rollout are off-policy, which the audit's off-policy regime is",
        ),
    )
for _key, _label, _rule in _RF_RULES:
    _add(
        FrameworkKL(
            f"rpg/{_key}-reward",
            f"{_label} in the reward, reference = π_old (the rf scripts)",
            "reward",
            _rule,
            "main@2026-06-14",
            _RPG.format("rpg_" + _key.replace("-", "_"))
            + " via apply_kl_penalty(old_log_probs, ref = old_log_probs); compute_rpg_outcome_advantage sums the "
            "token rewards",
            "token_mean",
            returns="sequence",
            reference_is_behaviour=True,
            note="log w = 0 exactly (both are the same tensor): a per-token constant, i.e. a length bonus (rf_fkl) "
            "or penalty (rf_rkl), or nothing; compute_policy_loss_reinforce is imported but never called",
        )
    )

# ---------------------------------------------------------------------------------------------------- ROLL
_ROLL = "alibaba/ROLL@8eb27cc2dc34 (2026-08-19; re-read 2026-11-26) roll/"
_ROLL_AGG_0_1_0 = (
    "; roll/pipeline/rlvr/rlvr_config.py:232-233 loss_agg_mode default seq-mean-token-sum, "
    "roll/utils/functionals.py:232-237 agg_loss: Σ_t per response, mean over responses (a token sum at β/B)"
)
_ROLL_AGG = (
    "; loss_agg_mode default seq-mean-token-mean from v0.1.1 (v0.1.1 roll/pipeline/rlvr/rlvr_config.py:236-237, "
    "commit d9e9407f; roll/configs/base_config.py:571-573 at the snapshot)"
)
_ROLL_COEF = ("kl_loss_coef", 0.0)  # rlvr_config.py:209 at v0.1.0, configs/base_config.py:569 at the snapshot
_ROLL_INIT_KL = ("init_kl_coef", 0.2)  # rlvr_config.py:173-174 at v0.1.0, configs/base_config.py:535 at the snapshot
_roll_k3 = FrameworkKL(
    "roll/kl-loss-k3",
    "use_kl_loss: k3 (hard-coded), clamped ±10",
    "loss",
    lambda l, r, o, m: clamp10(k3_value(l, r)),
    ">=0.1.1",
    _ROLL + "utils/functionals.py:181-206 compute_approx_kl(kl_penalty='k3'): clamp(k3, ±10); pipeline/rlvr/"
    "actor_pg_worker.py:118-124, 154: agg_loss(kl, loss_agg_mode), total_loss + kl_loss·kl_loss_coef" + _ROLL_AGG,
    "seq_mean",
    default=">=0.1.1",
    coef_default=_ROLL_COEF,
    note="use_kl_loss: true alone adds nothing: the term is computed and logged with weight kl_loss_coef, whose "
    "default is 0 (configs/base_config.py:569)",
)
_roll_gae = FrameworkKL(
    "roll/token-level-kl-gae",
    "add_token_level_kl (k1 of old − ref) with the default adv_estimator gae (γ = 1, λ = 0.95)",
    "reward",
    lambda l, r, o, m: k1_value(l, r),
    ">=0.1.1",
    _ROLL + "utils/functionals.py:615-627 compute_token_reward: token_level_rewards − init_kl_coef·kld "
    "(kl_penalty='kl'), compute_gae_advantage_return (functionals.py:502; gamma 1, lambd 0.95, configs/"
    "base_config.py:513-514)" + _ROLL_AGG,
    "seq_mean",
    default=">=0.1.1",
    returns="to_go",
    lam=0.95,
    coef_default=_ROLL_INIT_KL,
    note="audited with a zero critic; the KL is added after the task reward's group normalisation "
    "(pipeline/rlvr/rlvr_pipeline.py: reward_postprocess, then compute_token_reward)",
)
_roll_reinforce = FrameworkKL(
    "roll/token-level-kl-reinforce",
    "add_token_level_kl (k1) with adv_estimator grpo or reinforce (reward-to-go, γ = 1)",
    "reward",
    lambda l, r, o, m: k1_value(l, r),
    ">=0.1.1",
    _ROLL + "utils/functionals.py:488-500 compute_reinforce_return: cumulative reward_t + gamma·cumulative" + _ROLL_AGG,
    "seq_mean",
    returns="to_go",
    coef_default=_ROLL_INIT_KL,
)


def _roll_0_1_0(preset: FrameworkKL, source: str) -> FrameworkKL:
    """The same term in ROLL 0.1.0, whose default loss_agg_mode was seq-mean-token-sum: a token sum."""
    return dataclasses.replace(
        preset,
        id=preset.id + "-seq-mean-token-sum",
        variant=preset.variant + "; 0.1.0's default loss_agg_mode seq-mean-token-sum",
        versions=">=0.1,<0.1.1",
        source="alibaba/ROLL v0.1.0 roll/" + source + _ROLL_AGG_0_1_0,
        aggregation="token_sum",
        default=None if preset.default is None else ">=0.1,<0.1.1",
        note=preset.note.replace("configs/base_config.py:569", "pipeline/rlvr/rlvr_config.py:209"),
    )


_add(
    _roll_k3,
    _roll_0_1_0(
        _roll_k3,
        "utils/functionals.py:160-190 compute_approx_kl(kl_penalty='k3'): clamp(k3, ±10); pipeline/rlvr/"
        "actor_worker.py:32-37, 76-77: agg_loss(kl, loss_agg_mode), total_loss + kl_loss·kl_loss_coef",
    ),
    _roll_gae,
    _roll_0_1_0(
        _roll_gae,
        "utils/functionals.py:493-505 compute_token_reward: token_level_rewards − init_kl_coef·kld; "
        "compute_gae_advantage_return (functionals.py:396), rlvr_config.py:159-160 lambd 0.95, gamma 1",
    ),
    _roll_reinforce,
    _roll_0_1_0(_roll_reinforce, "utils/functionals.py:382 compute_reinforce_return (γ = 1)"),
)

# ---------------------------------------------------------------------------------------------------- AReaL
_add(
    FrameworkKL(
        "areal/k1-reward",
        "kl_ctl > 0: k1 of the inference log-prob in the reward, clamped ±10, GAE γ = λ = 1",
        "reward",
        lambda l, r, o, m: clamp10(k1_value(l, r)),
        ">=0.3.4",
        "inclusionAI/AReaL@4aef98d8d818 (2026-05-21) areal/trainer/ppo/actor.py _compute_advantages: rewards = "
        "−kl_ctl·KLEstimator('k1')(old_logp, ref_logp) (clamp ±10), GAE discount 1.0, gae_lambda 1.0",
        "token_mean",
        default=">=0.3.4",
        returns="to_go",
        note="old_logp is the inference engine's unless recompute_logprob and not use_decoupled_loss; with the "
        "code defaults (kl_ctl 0.1, ref None) the reference log-prob is 0 and the 'KL' is a surprisal bonus",
    ),
    FrameworkKL(
        "areal/k1-reward-unclamped",
        "kl_ctl > 0: k1 in the reward, no clamp, GAE γ = λ = 1",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.3,<0.3.4",
        "inclusionAI/AReaL v0.3.3 areal/engine/ppo/actor.py: rewards = −kl_ctl·(old_logp − ref_logp)",
        "token_mean",
        default=">=0.3,<0.3.4",
        returns="to_go",
    ),
)

# ---------------------------------------------------------------------------------------------------- Open-Instruct
_OI = "allenai/open-instruct@e6c3044aa620 (2026-08-20) open_instruct/"


def _oi_diff(l: Tensor, r: Tensor) -> Tensor:
    return (l - r).clamp(-40.0, 40.0)


_add(
    FrameworkKL(
        "open-instruct/k3-loss",
        "kl_estimator=2 (default; 'kl3' before 2025-12): k3 of the log-ratio clamped ±40",
        "loss",
        lambda l, r, o, m: torch.expm1(-_oi_diff(l, r)) + _oi_diff(l, r),
        ">=0.1",
        _OI + "grpo_utils.py compute_grpo_loss: d = (new − ref).clamp(±40); model_utils.estimate_kl[2] = "
        "expm1(−d) + d; pg_loss + beta·kl, global token mean",
        "token_mean",
        default=">=0.1",
        note="beta defaults to 0.05: on by default; the same rule since grpo_fast.py was written (2025-03)",
    ),
    FrameworkKL(
        "open-instruct/ratio-k1-loss",
        "kl_estimator=3 ('kl4' before 2025-12): ρ·(l − r), ρ differentiable",
        "loss",
        lambda l, r, o, m: token_ratio(l, o) * _oi_diff(l, r),
        ">=0.1",
        _OI + "model_utils.estimate_kl[3] = ratio·d, ratio = exp(new − old) from grpo_fast.py, not detached",
        "token_mean",
    ),
    FrameworkKL(
        "open-instruct/k1-loss",
        "kl_estimator=0: l − r clamped ±40",
        "loss",
        lambda l, r, o, m: _oi_diff(l, r),
        ">=0.1",
        _OI + "model_utils.estimate_kl[0] = d",
        "token_mean",
    ),
    FrameworkKL(
        "open-instruct/k2-loss",
        "kl_estimator=1: ½(l − r)², log-ratio clamped ±40",
        "loss",
        lambda l, r, o, m: _oi_diff(l, r) ** 2 / 2,
        ">=0.1",
        _OI + "model_utils.estimate_kl[1] = d²/2",
        "token_mean",
    ),
)

# ---------------------------------------------------------------------------------------------------- torchtune
_add(
    FrameworkKL(
        "torchtune/grpo-k3",
        "GRPOSimpleLoss kl_coeff > 0: unclamped k3, no ratio",
        "loss",
        lambda l, r, o, m: k3_value(l, r),
        "main@2026-04-23",
        "pytorch/torchtune@bd2a0fc7c314 (2026-04-23) torchtune/dev/grpo/loss.py GRPOSimpleLoss: per_token_kl = "
        "exp(ref − pi) − (ref − pi) − 1; masked_mean(per_token_loss, dim=1).mean() (since cf0142b, 2025-02-21)",
        "seq_mean",
        default="main@2026-04-23",
        note="in no release: the 0.6.x packages ship the GRPO recipe without torchtune/dev/grpo",
    ),
)

# ---------------------------------------------------------------------------------------------------- prime-rl
_add(
    FrameworkKL(
        "prime-rl/inference-kl",
        "default loss: kl_tau·(l − log π_inf)² to the inference policy (audited at kl_tau = ½); no reference KL",
        "loss",
        lambda l, r, o, m: 0.5 * (l - o) ** 2,
        ">=0.5",
        "PrimeIntellect-ai/prime-rl@559b44772e47 (2026-08-21) src/prime_rl/trainer/rl/loss.py default_loss_fn: "
        "kl_loss = loss_mask·(trainer − inference)²; −pg_loss + kl_tau·kl_loss, summed, / global token count",
        "token_mean",
        default=">=0.5",
        reference_is_behaviour=True,
        note="kl_tau defaults to 1e-3; a trust region to the inference policy, not a KL to a reference model",
    ),
    FrameworkKL(
        "prime-rl/kimi-kl",
        "kl_tau > 0 (Kimi form): −sg(ρ(A − kl_tau·(l − log π_inf)))·l",
        "loss",
        lambda l, r, o, m: (token_ratio(l, o) * (l - o)).detach() * l,
        ">=0.2,<0.5",
        "PrimeIntellect-ai/prime-rl v0.4.0 src/prime_rl/trainer/rl/loss.py: coeff = ratio·(advantages − "
        "kl_tau·log_ratio); loss = −(coeff.detach()·trainer_logprobs).sum()",
        "token_mean",
        reference_is_behaviour=True,
        note="kl_tau defaulted to 0 in these versions",
    ),
)

# ---------------------------------------------------------------------------------------------------- SkyRL
_SKY = "NovaSky-AI/SkyRL@a9564572eb8e (2026-08-21; re-read 2026-11-26) skyrl/backends/skyrl_train/"
_SKY_K3 = (
    "; kl_estimator_type default 'k3' at the snapshot (skyrl/train/config/config.py:828) and in the skyrl 0.3.0 "
    "package (config.py:602): PR #1445 (k3 → k2) is not merged"
)
_SKY_GRPO_STD = (
    "the group std: compute_grpo_outcome_advantage (skyrl/backends/skyrl_train/utils/ppo_utils.py:1367-1389) "
    "divides the summed token rewards minus the group mean by the group std + 1e-6 (grpo_norm_by_std, default "
    "True, skyrl/train/config/config.py:892)"
)
_add(
    FrameworkKL(
        "skyrl/kl-loss-k3",
        "use_kl_loss (on by default), kl_estimator_type k3: verl's low_var_kl, per-sequence mean",
        "loss",
        lambda l, r, o, m: low_var_kl(l, r),
        ">=0.1",
        _SKY + "utils/ppo_utils.py:88-120 compute_approx_kl (clamp(r − l, ±20), k3, clamp ±10); workers/"
        "worker.py:1070-1080 masked_mean(kl, dim=-1).mean() whatever loss_reduction says" + _SKY_K3,
        "seq_mean",
        default=">=0.1",
        note="the policy loss's default loss_reduction is token_mean, so the two terms aggregate differently",
    ),
    FrameworkKL(
        "skyrl/kl-loss-k2",
        "use_kl_loss, kl_estimator_type k2",
        "loss",
        lambda l, r, o, m: k2_value(l, r),
        ">=0.1",
        _SKY + "utils/ppo_utils.py compute_approx_kl: 0.5·(log_probs − base)²",
        "seq_mean",
    ),
    FrameworkKL(
        "skyrl/kl-reward-grpo",
        "use_kl_in_reward (k3 by default) with the default grpo estimator",
        "reward",
        lambda l, r, o, m: low_var_kl(l, r),
        ">=0.1",
        "NovaSky-AI/SkyRL@a9564572eb8e (2026-08-21; re-read 2026-11-26) skyrl/train/trainer.py:1409-1432 "
        "apply_reward_kl_penalty: rewards − kl·kl_loss_coef per token; GRPO sums the token rewards" + _SKY_K3,
        "token_mean",
        returns="sequence",
        std_normalised=_SKY_GRPO_STD,
        note="mutually exclusive with use_kl_loss (asserted)",
    ),
    FrameworkKL(
        "skyrl/kl-reward-grpo-k1",
        "use_kl_in_reward with kl_estimator_type k1, use_kl_loss false, grpo",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.1",
        "NovaSky-AI/SkyRL@a9564572eb8e (2026-08-21; re-read 2026-11-26) skyrl/train/trainer.py:1409-1432 "
        "apply_reward_kl_penalty with compute_approx_kl(kl_estimator_type='k1'): log_probs − base, no clamp",
        "token_mean",
        returns="sequence",
        std_normalised=_SKY_GRPO_STD,
    ),
)

# ---------------------------------------------------------------------------------------------------- ms-swift
_SWIFT = "modelscope/ms-swift@3602360a5623 (2026-08-22; re-read 2026-11-26) swift/"
_add(
    FrameworkKL(
        "ms-swift/k3-loss",
        "GRPO beta > 0 (0.04 by default): k3 with verl's clamps",
        "loss",
        lambda l, r, o, m: low_var_kl(l, r),
        ">=4.0.4",
        _SWIFT + "rlhf_trainers/grpo_trainer.py:987-990: safe_ratio = clamp(ref − logp, ±20); clamp(exp − safe − "
        "1, ±10); loss_type grpo (per-sequence token mean). First released in v4.0.4 (rlhf_trainers/"
        "grpo_trainer.py:1135-1136) as the cherry-pick 93e4f2bbe (2026-04-03) of #8464, whose main-branch commit "
        "7b8f04b (2026-03-30) is first in v4.1.0",
        "seq_mean",
        default=">=4.0.4",
        note="beta defaults to 0.04: on by default; rollout importance weights, when on, also scale the KL",
    ),
    FrameworkKL(
        "ms-swift/k3-loss-unclamped",
        "GRPO beta > 0: k3, no clamp",
        "loss",
        lambda l, r, o, m: k3_value(l, r),
        ">=3.4,<4.0.4",
        "modelscope/ms-swift v4.0.0 swift/rlhf_trainers/grpo_trainer.py:1126-1127 (swift/trainers/rlhf_trainer/"
        "grpo_trainer.py in 3.x, e.g. v3.12.6:1115-1116): exp(r − l) − (r − l) − 1",
        "seq_mean",
        default=">=3.4,<4.0.4",
    ),
    FrameworkKL(
        "ms-swift/kl-in-reward",
        "kl_in_reward (default for rloo and reinforce_plus_plus): Σ k1(old − ref) off the reward",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=3.10",
        _SWIFT + "rlhf_trainers/grpo_trainer.py:456-464: kl = ((old − ref)·mask).sum(-1) per response; "
        "rl_core/advantage.py:60-61 compute_advantages: rewards − beta·kl, before the group mean (65-70) and the "
        "std (72-97) (all inline in grpo_trainer.py in 3.10–4.3, e.g. v4.3.2 grpo_trainer.py:483-497)",
        "seq_mean",
        returns="sequence",
        std_normalised="with advantage_estimator grpo: the group std (scale_rewards' grpo default 'group'); "
        "reinforce_plus_plus: the batch std of the group-centred reward ('batch'); rloo: none, leave-one-out "
        "mean ('none') (arguments/rlhf_args.py:384-390, rl_core/advantage.py:67-97)",
        note="kl_in_reward defaults to True for rloo and reinforce_plus_plus, False for grpo "
        "(arguments/rlhf_args.py:369-375)",
    ),
)

# ---------------------------------------------------------------------------------------------------- Tinker
_add(
    FrameworkKL(
        "tinker/kl-advantage",
        "kl_penalty_coef > 0: k1 per token into the advantage, batch-mean baseline, no return",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.1",
        "thinking-machines-lab/tinker-cookbook@9dfcc3a2cf44 (2026-08-19) tinker_cookbook/rl/metrics.py "
        "incorporate_kl_penalty: advantages += coef·mask·(avg_logp_diff − logprob_diffs), kl_discount_factor 0",
        "token_sum",
        default=">=0.1",
        returns="token",
        clip=None,
        batch_baseline=True,
        note="the loss is the server's importance_sampling: −Σ exp(l − l_sampler)·A (from Tinker's docs; the "
        "server's code is not public); kl_discount_factor > 0 turns the penalty into a discounted return",
    ),
    FrameworkKL(
        "tinker/kl-advantage-discounted",
        "kl_penalty_coef > 0, kl_discount_factor 1: the baselined k1 summed as a return",
        "reward",
        lambda l, r, o, m: k1_value(l, r),
        ">=0.1",
        "thinking-machines-lab/tinker-cookbook@9dfcc3a2cf44 (2026-08-19) tinker_cookbook/rl/metrics.py: "
        "discounted_future_sum_vectorized(kl_advantages, kl_discount_factor)",
        "token_sum",
        returns="to_go",
        clip=None,
        batch_baseline=True,
        note="the batch-mean baseline is summed too: each token gets mean × (tokens to go), which depends on the "
        "response's length",
    ),
)

assert set(FRAMEWORKS) == set(PRESETS_BY_FRAMEWORK), set(FRAMEWORKS) ^ set(PRESETS_BY_FRAMEWORK)

PRESETS: tuple[FrameworkKL, ...] = tuple(p for name in FRAMEWORKS for p in PRESETS_BY_FRAMEWORK[name])
"""Every preset of ``klgrad audit --framework``, ids unique."""
assert len({p.id for p in PRESETS}) == len(PRESETS)

PACKAGES: dict[str, tuple[str, ...]] = {
    "trl": ("trl",),
    "verl": ("verl",),
    "openrlhf": ("openrlhf",),
    "nemo-rl": ("nemo-rl", "nemo_rl"),
    "areal": ("areal",),
    "torchtune": ("torchtune",),
    "prime-rl": ("prime-rl",),
    "skyrl": ("skyrl", "skyrl-train"),
    "ms-swift": ("ms-swift",),
    "tinker": ("tinker-cookbook",),
    "open-instruct": ("open-instruct",),
}
"""The Python distributions whose installed version ``klgrad audit --framework NAME`` reads (slime, RPG, ROLL and
the DeepSeek report have none of their own on PyPI)."""
