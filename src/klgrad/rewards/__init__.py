"""Rewards: plain ``str -> float`` functions, no torch.

- :func:`math_verify_reward` — Math-Verify equality with the gold answer, bounded in time and size;
- :func:`regex_format_reward`, :data:`FORMAT_PATTERNS` — format checks per task;
- :func:`load_reward_fn`, :class:`RewardSpec`, :func:`compute_rewards` — TRL-signature reward functions
  by name or ``module:function``, evaluated with failures isolated and counted;
  :func:`merge_rewards` joins the results of consecutive row blocks (ranks).
"""

from klgrad.rewards.accuracy import math_verify_reward
from klgrad.rewards.format import FORMAT_PATTERNS, format_pattern, make_format_reward, regex_format_reward
from klgrad.rewards.registry import (
    ACCURACY_REWARDS,
    BUILTIN_REWARDS,
    RewardFn,
    RewardResult,
    RewardSpec,
    accuracy_reward,
    accuracy_reward_name,
    compute_rewards,
    final_number_reward,
    format_reward,
    load_reward_fn,
    merge_rewards,
)

__all__ = [
    "ACCURACY_REWARDS",
    "BUILTIN_REWARDS",
    "FORMAT_PATTERNS",
    "RewardFn",
    "RewardResult",
    "RewardSpec",
    "accuracy_reward",
    "accuracy_reward_name",
    "compute_rewards",
    "final_number_reward",
    "format_pattern",
    "format_reward",
    "load_reward_fn",
    "make_format_reward",
    "math_verify_reward",
    "merge_rewards",
    "regex_format_reward",
]
