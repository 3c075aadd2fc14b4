"""`klgrad reproduce offpolicy`: an as-loss KL head off-policy, without IS (the common bug), with IS, IS + clip.

Several PPO updates per rollout batch (4 epochs × 2 mini-batches), so every update after the first is
off-policy. The k2 head at sequence level is applied three ways: differentiated directly without importance
sampling, with sequence-level IS, and with IS + symmetric clipping on the PPO-consistent side (docs/math.md,
"Off-policy: importance sampling and the clip side"). Results: docs/reproduction.md, section "7. Off-policy KL
correction".
"""

from __future__ import annotations

import json
from pathlib import Path

from klgrad.reproduce.training_runs import last_steps_mean, plot_curves, train_variant

VARIANTS: dict[str, dict] = {
    "no IS (bug)": {"kl.is_correction": False},
    "IS": {"kl.is_correction": True, "kl.clip_eps": None},
    "IS + clip 0.2": {"kl.is_correction": True, "kl.clip_eps": 0.2},
}
"""The three treatments of the KL head, as config overrides, by their label in the table."""


def run_offpolicy(out_dir: Path, *, steps: int = 40, config: str = "configs/tiny_add.yaml", seed: int = 0) -> dict:
    """k2 as loss with 4 epochs × 2 mini-batches per rollout: no IS vs IS vs IS + clip. Writes JSON/PNG/md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "train.steps": steps,
        "train.seed": seed,
        "train.eval_every": 0,
        "train.save_every": steps,
        "algo.ppo_epochs": 4,
        "algo.mini_batches": 2,
        "optim.lr": 3e-4,
        "kl.head": "k2_as_loss",
        "kl.level": "sequence",
        "kl.beta": 0.5,
    }
    curves = {name: train_variant(out_dir, _run_name(name), {**base, **o}, config) for name, o in VARIANTS.items()}
    tail = last_steps_mean(curves, ("kl/k1", "reward/mean", "clip/kl_frac"))
    result = {"setup": base, "variants": VARIANTS, "last10_mean": tail}
    (out_dir / "offpolicy.json").write_text(json.dumps(result, indent=1))
    plot_curves(
        curves,
        (
            ("kl/k1", "sequence KL to the reference (k1)"),
            ("reward/mean", "reward"),
            ("ratio/max", "max importance ratio"),
        ),
        out_dir / "offpolicy.png",
        "Off-policy k2-as-loss KL: 4 epochs × 2 mini-batches per rollout",
    )
    (out_dir / "verdict.md").write_text(offpolicy_verdict(tail, steps, seed))
    return result


def _run_name(label: str) -> str:
    """The run directory of a variant: "no IS (bug)" -> "no", "IS" -> "is", "IS + clip 0.2" -> "is_clip"."""
    return label.split()[0].lower() + ("_clip" if "clip" in label else "")


def offpolicy_verdict(tail: dict[str, dict[str, float]], steps: int, seed: int) -> str:
    """The verdict markdown: per variant the last-10-step means of the KL, the reward and the clip fraction."""
    lines = [
        "# Off-policy KL correction (paper appendix: off-policy correction; docs/math.md, "
        "“Off-policy: importance sampling and the clip side”)",
        "",
        f"k2 as loss, sequence level, β = 0.5, 4 PPO epochs × 2 mini-batches per rollout, lr 3e-4, {steps} "
        f"steps, seed {seed}. Mean of the last 10 steps:",
        "",
        "| variant | sequence KL (k1) | reward | KL-head clip fraction |",
        "|---|---|---|---|",
    ]
    for name, t in tail.items():
        lines.append(f"| {name} | {t['kl/k1']:.4f} | {t['reward/mean']:.4f} | {t['clip/kl_frac']:.3f} |")
    lines += [
        "",
        "Verdict: the exact-enumeration audit (`klgrad audit`) shows the uncorrected head's gradient is biased "
        "off-policy and the IS-corrected one exact; in this one-seed training run the table shows how much "
        "that bias moves the KL actually reached. One seed: read differences smaller than the step-to-step "
        "noise of the curves as unresolved.",
    ]
    return "\n".join(lines) + "\n"
