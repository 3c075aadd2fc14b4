"""Table and figure of the mismatch grids (experiments/mismatch/<prefix>_*; issue 37, item 3): the embedded model's
(prefix ``tiny``, the default) or SmolLM2's (``--prefix smollm2``, experiments/mismatch/mismatch_smollm2.sh).

Reads every finished run (runs/*/final.json, runs/*/metrics.jsonl) of each grid, so a grid cut short still
reports the runs it finished, and writes <prefix>_table.md, <prefix>_grids.json and <prefix>_mismatch.png.

    PYTHONPATH=src python experiments/mismatch/mismatch_report.py experiments/mismatch [--prefix smollm2]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

GRIDS = {  # folder suffix -> (sampler, correction) as the table names them
    "fp32": ("float32", "none"),
    "bf16_none": ("bfloat16", "none"),
    "bf16_token": ("bfloat16", "token TIS"),
    "bf16_sequence": ("bfloat16", "sequence TIS"),
    "bf16_token_mask": ("bfloat16", "token masked IS"),
}
HEADS = ["none", "k2_as_loss", "k3_as_loss", "k1_in_reward", "trl/grpo-k3-bias-correction"]
TITLES = {"tiny": "tiny_add", "smollm2": "SmolLM2-135M-Instruct on smollm2_sharpen"}


def final_kl(row: dict) -> float | None:
    """The run's final KL(π‖π_ref) on held-out prompts: exact (enumerated) when the grid computed it, else the
    stepwise estimate (a real model's vocabulary is not enumerable), else k1."""
    for key in ("exact_kl", "stepwise_kl", "sampled_k1"):
        if row.get(key) is not None:
            return float(row[key])
    return None


def run_rows(grid: Path) -> list[dict]:
    rows = []
    for final in sorted(grid.glob("runs/*/final.json")):
        row = json.loads(final.read_text())
        name = re.fullmatch(r"(.+)-beta[^-]+-seed(\d+)", final.parent.name)  # compare's run_name
        row["method"], row["seed"] = name.group(1).replace("+", "/"), int(name.group(2))
        records = [json.loads(x) for x in (final.parent / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in records if "reward/mean" in r]
        none_valued = sum(1 for r in steps for k in ("loss/policy", "loss/kl", "grad_norm") if r.get(k) is None)
        row["skipped_updates"] = sum(int(r.get("skipped_updates") or 0) for r in steps)
        row["non_finite_values"] = none_valued  # NaN/inf are written as null
        for key in ("mismatch/logp_diff_abs", "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/capped_frac",
                    "mismatch/masked_frac", "mismatch/weight_max"):  # fmt: skip
            vals = [r[key] for r in steps if r.get(key) is not None]
            row[key] = max(vals) if key == "mismatch/weight_max" and vals else (statistics.mean(vals) if vals else None)
        row["final_kl"] = final_kl(row)
        rows.append(row)
    return rows


def mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {sd:.3f}"


def fmt(x: float | None, digits: int = 4) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def heads_of(results: dict[str, list[dict]]) -> list[str]:
    """The KL methods the grids ran, in :data:`HEADS`' order."""
    ran = {r["method"] for rows in results.values() for r in rows}
    return [h for h in HEADS if h in ran] + sorted(ran - set(HEADS))


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| head | sampler | correction | runs | final KL(π‖π_ref) | held-out greedy acc | skipped / non-finite | "
        "mean \\|Δ log p\\| | KL(sampler‖trainer) k3 | capped / masked frac | max weight |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for head in heads_of(results):
        for grid, (sampler, correction) in GRIDS.items():
            rows = [r for r in results.get(grid, []) if r["method"] == head]
            if not rows:
                continue

            def avg(key: str, rows: list[dict] = rows) -> float | None:
                vals = [r[key] for r in rows if r.get(key) is not None]
                return statistics.mean(vals) if vals else None

            weight_max = max((r["mismatch/weight_max"] for r in rows if r.get("mismatch/weight_max")), default=None)
            frac = "–" if avg("mismatch/capped_frac") is None else (
                f"{avg('mismatch/capped_frac'):.4f} / {avg('mismatch/masked_frac'):.4f}")  # fmt: skip
            lines.append(
                f"| `{head}` | {sampler} | {correction} | {len(rows)} | {mean_sd([r['final_kl'] for r in rows])} | "
                f"{mean_sd([r.get('greedy_accuracy') for r in rows])} | "
                f"{sum(r['skipped_updates'] for r in rows)} / {sum(r['non_finite_values'] for r in rows)} | "
                f"{fmt(avg('mismatch/logp_diff_abs'))} | {fmt(avg('mismatch/kl_k3'), 5)} | {frac} | "
                f"{fmt(weight_max, 3)} |"
            )
    return "\n".join(lines) + "\n"


def figure(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = heads_of(results)
    fig, axes = plt.subplots(1, 3, figsize=(6 + 2.4 * len(heads), 4.8))
    width = 0.8 / len(GRIDS)
    colors = ["#444444", "#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    for ax, key, label in ((axes[0], "final_kl", "final KL(π‖π_ref), held-out"),
                           (axes[1], "greedy_accuracy", "held-out greedy accuracy")):  # fmt: skip
        for g, (grid, (sampler, correction)) in enumerate(GRIDS.items()):
            for h, head in enumerate(heads):
                vals = [r.get(key) for r in results.get(grid, []) if r["method"] == head and r.get(key) is not None]
                if not vals:
                    continue
                x = h + (g - (len(GRIDS) - 1) / 2) * width
                ax.bar(x, statistics.mean(vals), width, color=colors[g], alpha=0.35,
                       label=f"{sampler}, {correction}" if h == 0 and ax is axes[0] else None)  # fmt: skip
                ax.scatter([x] * len(vals), vals, color=colors[g], s=12, zorder=3)
        ax.set_xticks(range(len(heads)))
        ax.set_xticklabels([h.replace("trl/", "trl/\n") for h in heads], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    key = "reference_greedy_accuracy"
    refs = [r[key] for rows in results.values() for r in rows if r.get(key) is not None]
    if refs:
        axes[1].axhline(statistics.mean(refs), color="k", ls="--", lw=1, label="reference")
        axes[1].legend(fontsize=7)
    ax = axes[2]  # paired by head and seed: each bf16 grid's final KL minus the float32 run's
    base = {(r["method"], r["seed"]): r.get("final_kl") for r in results.get("fp32", [])}
    for g, (grid, (_, correction)) in enumerate(GRIDS.items()):
        if grid == "fp32":
            continue
        for h, head in enumerate(heads):
            mine = [r for r in results.get(grid, []) if r["method"] == head and r.get("final_kl") is not None]
            diffs = [r["final_kl"] - base[(head, r["seed"])] for r in mine if base.get((head, r["seed"])) is not None]
            if not diffs:
                continue
            x = h + (g - (len(GRIDS) - 1) / 2) * width
            ax.bar(x, statistics.mean(diffs), width, color=colors[g], alpha=0.35, label=correction if h == 0 else None)
            ax.scatter([x] * len(diffs), diffs, color=colors[g], s=12, zorder=3)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(heads)))
    ax.set_xticklabels([h.replace("trl/", "trl/\n") for h in heads], fontsize=8)
    ax.set_ylabel("final KL: bf16 sampler − float32 sampler (same seed)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, title="bf16 sampler, correction", title_fontsize=7)
    axes[0].legend(fontsize=7, title="sampler, mismatch correction", title_fontsize=7)
    fig.suptitle(f"{title}, bf16 sampler vs float32 trainer: bars = mean over seeds, dots = seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="experiments/mismatch", type=Path)
    parser.add_argument("--prefix", default="tiny", choices=sorted(TITLES))
    args = parser.parse_args()
    root, prefix = args.root, args.prefix
    results = {grid: run_rows(root / f"{prefix}_{grid}") for grid in GRIDS if (root / f"{prefix}_{grid}").is_dir()}
    (root / f"{prefix}_table.md").write_text(table(results), encoding="utf-8")
    keep = ("method", "seed", "final_kl", "greedy_accuracy", "sampled_accuracy", "skipped_updates",
            "non_finite_values", "mismatch/logp_diff_abs", "mismatch/kl_k1", "mismatch/kl_k3",
            "mismatch/capped_frac", "mismatch/masked_frac", "mismatch/weight_max")  # fmt: skip
    out = {grid: [{k: r.get(k) for k in keep} for r in rows] for grid, rows in results.items()}
    (root / f"{prefix}_grids.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    figure(results, root / f"{prefix}_mismatch.png", TITLES[prefix])
    print(table(results))


if __name__ == "__main__":
    main()
