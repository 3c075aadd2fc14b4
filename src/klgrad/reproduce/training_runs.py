"""Real training runs for the reproduce targets that need them (``offpolicy``, the RL half of ``group-norm``).

Each variant is one :func:`klgrad.trainer.train` run of ``configs/tiny_add.yaml`` (or another config) with
dotted overrides, in ``out_dir/runs/<name>``; a finished run is reused, an interrupted one resumed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from klgrad.config import load_config
from klgrad.plotting import pyplot, save
from klgrad.trainer import read_jsonl, train


def train_variant(out_dir: Path, name: str, overrides: dict, config: str) -> list[dict]:
    """Train (or reuse, or resume) ``out_dir/runs/<name>``; return its per-step training metrics records."""
    run_dir = out_dir / "runs" / name
    cfg = load_config(config, {**overrides, "train.out_dir": str(run_dir), "train.tensorboard": False})
    summary = run_dir / "summary.json"
    if not (summary.is_file() and json.loads(summary.read_text()).get("steps") == cfg.train.steps):
        train(cfg, resume=(run_dir / "metrics.jsonl").exists(), progress=False)
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def last_steps_mean(curves: dict[str, list[dict]], keys: Iterable[str], n: int = 10) -> dict[str, dict[str, float]]:
    """Per variant, the mean of each metric in ``keys`` over the last ``n`` steps (fewer if the run is shorter)."""
    return {name: {k: sum(r[k] for r in rs[-n:]) / len(rs[-n:]) for k in keys} for name, rs in curves.items()}


def plot_curves(curves: dict[str, list[dict]], panels: tuple[tuple[str, str], ...], path: Path, title: str) -> None:
    """One panel per (metric key, title) in ``panels``, one line per variant, against the training step."""
    plt = pyplot()
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
    save(fig, path, dpi=115)
