"""The RL half of `klgrad reproduce group-norm`: GRPO on a reward with no signal, with and without a std floor.

The reward is 1 + 1e-5·noise(completion). GRPO's group normalisation turns the 1e-5 noise into unit-size
advantages, so the policy drifts away from the reference for nothing; with ``std_min = 0.1`` the advantages
stay ~1e-4 and, next to a KL head, the policy stays put (paper appendix J; the amplification itself, without
training: :mod:`klgrad.reproduce.group_norm`). Results: docs/reproduction.md, section "6. Group
normalisation (appendix J)".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from klgrad.reproduce.training_runs import last_steps_mean, plot_curves, train_variant

REWARD_NAME = "klgrad.reproduce.group_norm_rl:near_constant_reward"
"""How the runs' config names :func:`near_constant_reward` (``reward.functions``' ``module:function`` form)."""
NO_KL = {"kl.head": "none"}
K2 = {"kl.head": "k2_as_loss", "kl.beta": 0.5, "kl.level": "sequence"}
VARIANTS: dict[str, tuple[str, dict]] = {
    "no KL, no std clip": ("nokl_noclip", {**NO_KL}),
    "no KL, std_min = 0.1": ("nokl_stdmin", {**NO_KL, "algo.std_min": 0.1}),
    "k2 KL β=0.5, no std clip": ("k2_noclip", {**K2}),
    "k2 KL β=0.5, std_min = 0.1": ("k2_stdmin", {**K2, "algo.std_min": 0.1}),
}
"""Label in the table -> (run directory, config overrides)."""


def near_constant_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 + 1e-5·u(completion), u ∈ [-1, 1] a fixed hash of the text: near-constant, pure noise, no signal."""
    out = []
    for c in completions:
        h = int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest(), "little")
        out.append(1.0 + 1e-5 * (2.0 * h / 2**64 - 1.0))
    return out


def run_group_norm_rl(out_dir: Path, *, steps: int = 40, config: str = "configs/tiny_add.yaml", seed: int = 0) -> dict:
    """GRPO on a signal-free near-constant reward, with/without std_min = 0.1, without and with a KL head.

    AdamW is invariant to the scale of the gradient, so with the reward as the *only* loss term, shrinking
    the advantages (std_min) barely changes the update; the floor acts relative to other terms (a KL head).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "train.steps": steps,
        "train.seed": seed,
        "train.eval_every": 0,
        "train.save_every": steps,
        "algo.shaping": "grpo",
        "optim.lr": 3e-4,
        "reward.functions": [{"name": REWARD_NAME, "weight": 1.0}],
    }
    curves = {name: train_variant(out_dir, d, {**base, **o}, config) for name, (d, o) in VARIANTS.items()}
    tail = last_steps_mean(curves, ("kl/k1", "entropy", "reward/mean"))
    result = {
        "setup": {k: v for k, v in base.items() if k != "reward.functions"},
        "reward": "1 + 1e-5·noise",
        "last10_mean": tail,
    }
    (out_dir / "group_norm_rl.json").write_text(json.dumps(result, indent=1))
    plot_curves(
        curves,
        (("kl/k1", "sequence KL to the reference (k1)"), ("entropy", "entropy"), ("grad_norm", "grad norm")),
        out_dir / "group_norm_rl.png",
        "Signal-free reward 1 + 1e-5·noise: does group normalisation make the policy drift?",
    )
    (out_dir / "verdict.md").write_text(group_norm_rl_verdict(tail, steps, seed))
    return result


def group_norm_rl_verdict(tail: dict[str, dict[str, float]], steps: int, seed: int) -> str:
    """The verdict markdown. Reproduced with a KL head iff the unfloored run's KL exceeds twice the floored one's."""
    kl = {n: t["kl/k1"] for n, t in tail.items()}
    lines = [
        "# Group normalisation on a near-constant reward (paper appendix J), RL runs",
        "",
        f"Reward 1 + 1e-5·noise(completion) (no signal), GRPO, lr 3e-4, AdamW, {steps} steps, seed {seed}. "
        "Mean of the last 10 steps:",
        "",
        "| variant | sequence KL to reference | entropy |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {t['kl/k1']:.4f} | {t['entropy']:.4f} |" for n, t in tail.items()]
    with_kl = kl["k2 KL β=0.5, no std clip"] > 2 * kl["k2 KL β=0.5, std_min = 0.1"]
    lines += [
        "",
        "Verdict: "
        + (
            "reproduced with a KL head: without a std floor the unit-size noise advantages outweigh the KL term "
            f"and the policy drifts (KL {kl['k2 KL β=0.5, no std clip']:.3f}); with std_min = 0.1 the KL term "
            f"dominates (KL {kl['k2 KL β=0.5, std_min = 0.1']:.3f})."
            if with_kl
            else f"not reproduced with a KL head at this size (KL {kl['k2 KL β=0.5, no std clip']:.3f} vs "
            f"{kl['k2 KL β=0.5, std_min = 0.1']:.3f})."
        )
        + f" Without any other loss term (no KL), std_min does not stop the drift (KL {kl['no KL, no std clip']:.3f} "
        f"vs {kl['no KL, std_min = 0.1']:.3f}): AdamW normalises the gradient's scale, so tiny advantages still "
        "produce full-size updates. The paper does not discuss this; the floor helps only relative to other terms.",
    ]
    return "\n".join(lines) + "\n"
