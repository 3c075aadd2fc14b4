"""klgrad.reproduce.group_norm_rl: the signal-free reward and the verdict's rule (the training:
reproduce/test_targets.py)."""

from __future__ import annotations

from klgrad.reproduce.group_norm_rl import REWARD_NAME, VARIANTS, group_norm_rl_verdict, near_constant_reward
from klgrad.rewards.registry import load_reward_fn


def test_near_constant_reward_is_near_constant_and_deterministic():
    r = near_constant_reward(["p"] * 3, ["12", "13", "12"])
    assert r[0] == r[2]
    assert all(abs(x - 1.0) <= 1e-5 for x in r)  # the reward's own design: 1 plus a spread of order 1e-5
    assert r[0] != r[1]


def test_the_configured_reward_name_resolves_to_it():
    assert load_reward_fn(REWARD_NAME) is near_constant_reward


def _tail(k2_noclip: float, k2_stdmin: float) -> dict[str, dict[str, float]]:
    kl = {
        "no KL, no std clip": 8.76,
        "no KL, std_min = 0.1": 6.54,
        "k2 KL β=0.5, no std clip": k2_noclip,
        "k2 KL β=0.5, std_min = 0.1": k2_stdmin,
    }
    assert set(kl) == set(VARIANTS)
    return {n: {"kl/k1": v, "entropy": 0.5, "reward/mean": 1.0} for n, v in kl.items()}


def test_verdict_reproduced_only_when_the_floor_more_than_halves_the_kl():
    v = group_norm_rl_verdict(_tail(0.481, 0.072), steps=40, seed=0)
    assert "Verdict: reproduced with a KL head" in v
    assert "(KL 0.481); with std_min = 0.1 the KL term dominates (KL 0.072)" in v
    assert "(KL 8.760 vs 6.540)" in v
    assert "| k2 KL β=0.5, no std clip | 0.4810 | 0.5000 |" in v
    v = group_norm_rl_verdict(_tail(0.2, 0.1), steps=40, seed=0)  # exactly 2×: not more than twice
    assert "Verdict: not reproduced with a KL head at this size (KL 0.200 vs 0.100)." in v
