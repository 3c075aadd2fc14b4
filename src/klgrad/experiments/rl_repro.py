"""The paper's claims that need real training runs: off-policy KL correction, and group-norm amplification.

- ``offpolicy``: several PPO updates per rollout batch (``ppo_epochs`` × ``mini_batches``), so every update
  after the first is off-policy. An as-loss KL head (k2, sequence level) is applied three ways: differentiated
  directly without IS (the common bug), with sequence-level IS, and with IS + symmetric clipping (SPEC §7).
- ``group-norm``: a reward with no signal, 1 + 1e-5·noise(completion). GRPO's group normalisation turns the
  1e-5 noise into unit-size advantages, so the policy drifts away from the reference for nothing; with
  ``std_min = 0.1`` the advantages stay ~1e-4 and the policy stays put (paper appendix J).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from klgrad.config import load_config
from klgrad.trainer import read_jsonl, train


def near_constant_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 + 1e-5·u(completion), u ∈ [-1, 1] a fixed hash of the text: near-constant, pure noise, no signal."""
    out = []
    for c in completions:
        h = int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest(), "little")
        out.append(1.0 + 1e-5 * (2.0 * h / 2**64 - 1.0))
    return out


def _run(out_dir: Path, name: str, overrides: dict, config: str) -> list[dict]:
    run_dir = out_dir / "runs" / name
    cfg = load_config(config, {**overrides, "train.out_dir": str(run_dir), "train.tensorboard": False})
    summary = run_dir / "summary.json"
    if not (summary.is_file() and json.loads(summary.read_text()).get("steps") == cfg.train.steps):
        train(cfg, resume=(run_dir / "metrics.jsonl").exists(), progress=False)
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def _plot(curves: dict[str, list[dict]], panels: tuple[tuple[str, str], ...], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, rs in curves.items():
            ax.plot([r["step"] for r in rs], [r[key] for r in rs], lw=1.5, label=name)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=115)
    plt.close(fig)


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
    variants = {
        "no IS (bug)": {"kl.is_correction": False},
        "IS": {"kl.is_correction": True, "kl.clip_eps": None},
        "IS + clip 0.2": {"kl.is_correction": True, "kl.clip_eps": 0.2},
    }
    curves = {
        name: _run(out_dir, name.split()[0].lower() + ("_clip" if "clip" in name else ""), {**base, **o}, config)
        for name, o in variants.items()
    }
    tail = {
        name: {k: sum(r[k] for r in rs[-10:]) / len(rs[-10:]) for k in ("kl/k1", "reward/mean", "clip/kl_frac")}
        for name, rs in curves.items()
    }
    result = {"setup": base, "variants": variants, "last10_mean": tail}
    (out_dir / "offpolicy.json").write_text(json.dumps(result, indent=1))
    _plot(
        curves,
        (
            ("kl/k1", "sequence KL to the reference (k1)"),
            ("reward/mean", "reward"),
            ("ratio/max", "max importance ratio"),
        ),
        out_dir / "offpolicy.png",
        "Off-policy k2-as-loss KL: 4 epochs × 2 mini-batches per rollout",
    )
    lines = [
        "# Off-policy KL correction (paper appendix: off-policy correction; SPEC §7)",
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
    (out_dir / "verdict.md").write_text("\n".join(lines) + "\n")
    return result


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
        "reward.functions": [{"name": "klgrad.experiments.rl_repro:near_constant_reward", "weight": 1.0}],
    }
    no_kl = {"kl.head": "none"}
    k2 = {"kl.head": "k2_as_loss", "kl.beta": 0.5, "kl.level": "sequence"}
    variants = {
        "no KL, no std clip": ("nokl_noclip", {**no_kl}),
        "no KL, std_min = 0.1": ("nokl_stdmin", {**no_kl, "algo.std_min": 0.1}),
        "k2 KL β=0.5, no std clip": ("k2_noclip", {**k2}),
        "k2 KL β=0.5, std_min = 0.1": ("k2_stdmin", {**k2, "algo.std_min": 0.1}),
    }
    curves = {name: _run(out_dir, d, {**base, **o}, config) for name, (d, o) in variants.items()}
    tail = {
        name: {k: sum(r[k] for r in rs[-10:]) / len(rs[-10:]) for k in ("kl/k1", "entropy", "reward/mean")}
        for name, rs in curves.items()
    }
    result = {
        "setup": {k: v for k, v in base.items() if k != "reward.functions"},
        "reward": "1 + 1e-5·noise",
        "last10_mean": tail,
    }
    (out_dir / "group_norm_rl.json").write_text(json.dumps(result, indent=1))
    _plot(
        curves,
        (("kl/k1", "sequence KL to the reference (k1)"), ("entropy", "entropy"), ("grad_norm", "grad norm")),
        out_dir / "group_norm_rl.png",
        "Signal-free reward 1 + 1e-5·noise: does group normalisation make the policy drift?",
    )
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
    (out_dir / "verdict.md").write_text("\n".join(lines) + "\n")
    return result
