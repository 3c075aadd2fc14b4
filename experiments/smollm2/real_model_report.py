"""Summarise klgrad runs on a real model side by side: a Markdown table and one figure.

    python experiments/smollm2/real_model_report.py runs/smollm2_sharpen ... --out experiments/smollm2

Reads each run's ``config.yaml`` and ``metrics.jsonl``; writes ``OUT/summary.md`` (held-out greedy and sampled
accuracy at the first and last evaluation, held-out KL estimate, median s/step, wall time) and ``OUT/curves.png``
(train reward, held-out sampled accuracy and held-out KL against the step, one line per run), and copies each run's
metrics and config under ``OUT/<run name>/`` so the numbers can be re-read without the run directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from klgrad.config import load_config
from klgrad.plotting import pyplot, save


def read_run(run: Path) -> dict:
    """The numbers of one run directory."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    steps = [r for r in records if "time/step" in r]
    cfg = load_config(run / "config.yaml")
    return {
        "name": run.name,
        "mode": f"LoRA r={cfg.model.lora_rank}" if cfg.model.lora_rank else "full",
        "lr": cfg.optim.lr,
        "task": f"{cfg.data.task}, {cfg.data.digits} digit(s), {cfg.data.n_eval} held-out × {cfg.train.eval_samples}",
        "first": evals[0],
        "last": evals[-1],
        "evals": evals,
        "train": steps,
        "median_step_s": statistics.median(r["time/step"] for r in steps),
        "wall_s": sum(r["time/step"] for r in steps),
    }


def table(runs: list[dict]) -> str:
    """One row per run: held-out accuracy first → last evaluation, KL, speed."""
    lines = [
        "| run | task | tuning (lr) | held-out greedy acc. | held-out sampled acc. | KL(π‖π_ref) held-out (k1) "
        "| s/step (median) | steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        f, last = r["first"], r["last"]
        lines.append(
            f"| {r['name']} | {r['task']} | {r['mode']} ({r['lr']:g}) | {f['eval/greedy_accuracy']:.3f} → "
            f"{last['eval/greedy_accuracy']:.3f} | {f['eval/sampled_accuracy']:.3f} → "
            f"{last['eval/sampled_accuracy']:.3f} | {last['eval/kl_k1']:.3f} | {r['median_step_s']:.1f} "
            f"| {len(r['train'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """Train reward, held-out sampled accuracy and held-out KL against the step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        style = "--" if r["mode"] != "full" else "-"
        (line,) = axes[0].plot([t["step"] for t in r["train"]], [t["reward/mean"] for t in r["train"]], style, lw=1.2)
        kw = {"color": line.get_color(), "marker": "o", "ms": 4, "ls": style, "label": f"{r['name']} ({r['mode']})"}
        axes[1].plot([e["step"] for e in r["evals"]], [e["eval/sampled_accuracy"] for e in r["evals"]], **kw)
        axes[2].plot([e["step"] for e in r["evals"]], [e["eval/kl_k1"] for e in r["evals"]], **kw)
    for ax, title in zip(
        axes,
        ("train reward (batch mean)", "held-out sampled accuracy", "held-out KL(π‖π_ref), k1 estimate"),
        strict=True,
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("klgrad train on SmolLM2-135M-Instruct (2 CPU cores)", fontsize=11)
    fig.tight_layout()
    save(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [read_run(r) for r in args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    for run in args.runs:
        keep = args.out / run.name
        keep.mkdir(exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml", "summary.json", "curves.png"):
            if (run / name).is_file():
                shutil.copy2(run / name, keep / name)
    (args.out / "summary.md").write_text(table(runs), encoding="utf-8")
    plot(runs, args.out / "curves.png")
    print(table(runs))


if __name__ == "__main__":
    main()
