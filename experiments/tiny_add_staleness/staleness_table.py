r"""Collect the stale-rollout grids (one ``klgrad compare`` grid per staleness k) into a table and a figure.

    for K in 0 1 4; do
      klgrad compare --config configs/tiny_add.yaml --level sequence \
        --methods none,k1_in_reward,k2_as_loss,k3_as_loss --seeds 3 --steps 60 \
        --rollout.prompts_per_step 16 --rollout.staleness $K --out experiments/tiny_add_staleness/k$K
    done
    python experiments/tiny_add_staleness/staleness_table.py experiments/tiny_add_staleness

Reads ``DIR/k*/runs/*/final.json``, each run's final exact KL(π‖π_ref) and greedy accuracy (the current
policy's), and its ``metrics.jsonl``; ``DIR/kK_*`` holds more runs of staleness K (a grid of some methods run
beside the main one). Writes ``DIR/staleness.md`` (mean ± sd over seeds per head × k, the paired change from
k = 0, the clip fractions), ``DIR/runs.json`` (the runs it read) and ``DIR/staleness.png``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from klgrad.plotting import pyplot, save

METRICS = (("exact_kl", "final KL(π‖π_ref)"), ("greedy_accuracy", "greedy accuracy"))
"""final.json fields shown with their paired change from k = 0, with their labels."""
STEP_MEANS = (("clip/frac", "reward-head clip frac"), ("clip/kl_frac", "KL-head clip frac"), ("ratio/max", "max ratio"))
"""metrics.jsonl keys shown as their mean over a run's steps (then over seeds): how off-policy the batches were."""
ORDER = ("none", "k1_in_reward", "k2_as_loss", "k3_as_loss")
"""Heads in this order first, any other after them."""


def methods_of(grids: dict[int, list[dict]]) -> list[str]:
    """The heads of the grids, :data:`ORDER` first."""
    found = {r["method"] for runs in grids.values() for r in runs}
    return [m for m in ORDER if m in found] + sorted(found - set(ORDER))


def read_grids(root: Path) -> dict[int, list[dict]]:
    """{k: the finished runs of ``root/k{k}``}, k ascending: each run's ``final.json`` with the method and seed of
    its folder name (``METHOD-betaB-seedS``), so a grid still running shows what has finished."""
    grids: dict[int, list[dict]] = {}
    for final in sorted(root.glob("k*/runs/*/final.json")):
        k = int(final.parents[2].name[1:].split("_")[0])  # k4, or k4_k3 (a grid of some methods, run beside)
        method, _beta, seed = final.parent.name.rsplit("-", 2)
        steps = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
        means = {key: statistics.mean(r[key] for r in steps if r.get(key) is not None) for key, _ in STEP_MEANS}
        failures = sum(r.get("reward/failures") or 0 for r in steps)  # reward calls timed out or failed
        run = {**json.loads(final.read_text()), **means, "method": method, "seed": int(seed[4:]), "failures": failures}
        grids.setdefault(k, []).append(run)
    return dict(sorted(grids.items()))


def by_seed(runs: list[dict], method: str, metric: str) -> dict[int, float]:
    """{seed: the metric} of one method's runs."""
    return {r["seed"]: r[metric] for r in runs if r["method"] == method and r.get(metric) is not None}


def mean_sd(values: list[float]) -> str:
    """'mean ± sd' (sd over seeds, n − 1), or 'mean' for one value, or '—'."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def paired_change(now: dict[int, float], base: dict[int, float]) -> str:
    """Mean of now − base over the seeds both hold, and in how many seeds it is positive: '+0.012 (3/3 up)'."""
    seeds = sorted(now.keys() & base.keys())
    if not seeds:
        return "—"
    d = [now[s] - base[s] for s in seeds]
    return f"{statistics.mean(d):+.3f} ({sum(x > 0 for x in d)}/{len(d)} up)"


def table(grids: dict[int, list[dict]]) -> str:
    """The markdown table: head × k, each metric's mean ± sd over seeds and its paired change from k = 0."""
    ks = list(grids)
    methods = methods_of(grids)
    head = ["head", "k", *(label for _, label in METRICS), *(f"Δ {label} vs k=0 (paired)" for _, label in METRICS)]
    head += [f"{label} (mean over steps)" for _, label in STEP_MEANS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        for k in ks:
            cells = [m, str(k)]
            cells += [mean_sd(list(by_seed(grids[k], m, key).values())) for key, _ in METRICS]
            cells += [
                "—" if k == ks[0] else paired_change(by_seed(grids[k], m, key), by_seed(grids[ks[0]], m, key))
                for key, _ in METRICS
            ]
            step_means = [list(by_seed(grids[k], m, key).values()) or [math.nan] for key, _ in STEP_MEANS]
            cells += [f"{statistics.mean(v):.3f}" for v in step_means]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(grids: dict[int, list[dict]], path: Path) -> None:
    """One panel per metric: x = staleness k, a line per head through its seed means, seeds as dots."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(11, 4.2))
    ks = list(grids)
    methods = methods_of(grids)
    colors = {"none": "gray", "k1_in_reward": "#1f77b4", "k2_as_loss": "#b5b500", "k3_as_loss": "firebrick"}
    for ax, (key, label) in zip(axes, METRICS, strict=True):
        for i, m in enumerate(methods):
            color = colors.get(m, f"C{i}")
            x_off = (i - (len(methods) - 1) / 2) * 0.06
            means = []
            for k in ks:
                vals = list(by_seed(grids[k], m, key).values())
                ax.scatter([k + x_off] * len(vals), vals, color=color, s=12, alpha=0.5)
                means.append(statistics.mean(vals) if vals else float("nan"))
            ax.plot([k + x_off for k in ks], means, "-o", color=color, label=m, lw=1.8, ms=5)
        ax.set_xticks(ks)
        ax.set_xlabel("rollout.staleness k (samples from the policy k updates back)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_title("final exact KL to the reference (held-out)")
    axes[1].set_title("final greedy accuracy (held-out)")
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny_add, sequence level, β = 0.5: stale rollouts (mean over seeds, dots = seeds)", fontsize=11)
    fig.tight_layout()
    save(fig, path, dpi=120)


def main(root: str) -> None:
    out = Path(root)
    grids = read_grids(out)
    seeds = sorted({r["seed"] for runs in grids.values() for r in runs})
    text = (
        f"# Stale rollouts on tiny_add (sequence level, β = 0.5; seeds {seeds}, paired across k)\n\n"
        "Final values of the current policy (exact KL to the reference and greedy accuracy on the held-out "
        "prompts), mean ± sd over seeds; Δ: mean paired change from k = 0 (same seed: same prompts and uniforms).\n\n"
        + table(grids)
        + f"\n{sum(len(runs) for runs in grids.values())} runs; training-batch reward failures (a reward call that "
        f"failed or timed out gets 0): {sum(r['failures'] for runs in grids.values() for r in runs)} in all.\n"
    )
    (out / "staleness.md").write_text(text)
    records = [{"staleness": k, **r} for k, runs in grids.items() for r in runs]  # the table's data (runs/ is ignored)
    (out / "runs.json").write_text(json.dumps(records, indent=1) + "\n")
    figure(grids, out / "staleness.png")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "experiments/tiny_add_staleness")
