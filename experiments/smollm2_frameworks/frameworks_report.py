"""The frameworks' head-to-head on SmolLM2 (``frameworks_grid.sh`` here) in one table and one figure:

    python experiments/smollm2_frameworks/frameworks_report.py GRID_DIR [--out DIR]

Reads the grid's ``summary.json`` (every finished run's final numbers) and ``grid.json`` (each method's β', the
``kl.beta`` it trained at for the same nominal strength) and writes into ``--out`` (default: GRID_DIR):

- ``headtohead.md`` / ``headtohead.json``: one row per method, in the protocol's order (framework defaults, klgrad's
  exact head, no KL, the frameworks' remedies), with its role, β', and mean [95% t interval] over seeds of the
  held-out KL(π‖π_ref) (stepwise, the primary metric), the held-out forward KL(π_ref‖π), the training batches'
  reward (last 10 steps) and greedy accuracy; then each method's paired difference from ``k2_as_loss`` in KL and
  in reward (per seed, t interval, paired t p and exact sign-flip p, unadjusted: the grid's own tests are in
  summary.md): a method that holds the policy closer at the cost of reward reads as a stronger KL, not a better one;
- ``headtohead.png``: the same KL and reward, a dot per seed and the mean with its interval, the KL on a log axis
  (no KL ends ~7× further than any KL term).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from klgrad.compare.render import markdown_table
from klgrad.compare.stats import mean_ci, paired_by_seed
from klgrad.plotting import pyplot, save

_spec = importlib.util.spec_from_file_location("smollm2_frameworks_protocol", Path(__file__).parent / "protocol.py")
_protocol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protocol)
HEAD_TO_HEAD = _protocol.HEAD_TO_HEAD

COLUMNS = (
    ("stepwise_kl", "held-out KL(π‖π_ref)"),
    ("forward_kl", "held-out KL(π_ref‖π)"),
    ("reward_mean", "reward (last 10 steps)"),
    ("greedy_accuracy", "greedy accuracy"),
)
"""(final.json key, column title) of the table."""
BASELINE = "k2_as_loss"
PAIRED = (("stepwise_kl", "kl", "KL"), ("reward_mean", "reward", "reward"))
"""(final.json key, row key ``<name>_vs_k2_as_loss``, column title) of the paired differences from the baseline."""


def by_method(summary: dict) -> dict[str, dict[str, dict[int, float]]]:
    """``{method: {key: {seed: value}}}`` of the summary's runs (one β: the grid's nominal one)."""
    out: dict = {}
    for r in summary["runs"]:
        for key, _ in COLUMNS:
            if r.get(key) is not None:
                out.setdefault(r["method"], {}).setdefault(key, {})[r["seed"]] = r[key]
    return out


def interval(values: list[float]) -> dict:
    """Mean and 95% t interval (NaN bounds below 2 values)."""
    m, half = mean_ci(values)
    return {"mean": m, "ci": [m - half, m + half], "n": len(values)}


def report(grid: Path, out: Path) -> dict:
    summary = json.loads((grid / "summary.json").read_text())
    record = json.loads((grid / "grid.json").read_text())
    beta_of = {r["method"]: r["effective_beta"] for r in record.get("effective_betas", [])}
    data = by_method(summary)
    roles = dict(HEAD_TO_HEAD)
    methods = [m for m, _ in HEAD_TO_HEAD if m in data] + sorted(m for m in data if m not in roles)
    rows = {}
    for m in methods:
        rows[m] = {
            "role": roles.get(m, ""),
            "effective_beta": beta_of.get(m),
            **{key: interval(list(data[m].get(key, {}).values())) for key, _ in COLUMNS},
            "seeds": sorted(data[m].get("stepwise_kl", {})),
            **{
                f"{name}_vs_{BASELINE}": paired_by_seed(data[m].get(key, {}), data.get(BASELINE, {}).get(key, {}))
                if m != BASELINE
                else None
                for key, name, _ in PAIRED
            },
        }
    n = max((len(r["seeds"]) for r in rows.values()), default=0)
    tau = record["resolved_config"]["rollout"]["temperature"]
    lines = [
        f"{n} seeds; mean [95% t interval] over seeds; KLs at τ = {tau} on the held-out prompts. β' is the `kl.beta` "
        "each method trained at for the same nominal strength.",
        "",
    ]
    header = ("method", "role", "β'", *(t for _, t in COLUMNS), *(f"{t} − {BASELINE} (paired)" for _, _, t in PAIRED))
    table = []
    for m, r in rows.items():
        cells = [f"{r[k]['mean']:.3f} [{r[k]['ci'][0]:.3f}, {r[k]['ci'][1]:.3f}]" for k, _ in COLUMNS]
        for _, name, _ in PAIRED:
            v = r[f"{name}_vs_{BASELINE}"]
            cells.append(
                "—"
                if v is None
                else f"{v['mean']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}], t p {v['t_p']:.3g}, "
                f"sign-flip p {v['sign_flip_p']:.3g}"
            )
        beta = "—" if r["effective_beta"] is None else f"{r['effective_beta']:.4g}"
        table.append((f"`{m}`", r["role"], beta, *cells))
    lines += markdown_table(header, table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headtohead.md").write_text("\n".join(lines) + "\n")
    (out / "headtohead.json").write_text(json.dumps(rows, indent=1))
    figure(rows, data, methods, n, out / "headtohead.png")
    return rows


def figure(rows: dict, data: dict, methods: list[str], n: int, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(methods) + 1.6), sharey=True)
    for ax, key, title in ((axes[0], "stepwise_kl", "held-out KL(π‖π_ref), log scale"),
                           (axes[1], "reward_mean", "training reward, last 10 steps")):  # fmt: skip
        for i, m in enumerate(methods):
            y = len(methods) - 1 - i
            vals = list(data[m].get(key, {}).values())
            color = "#555555" if m == "none" else ("#808000" if m == BASELINE else "#1f77b4")
            ax.scatter(vals, [y] * len(vals), s=14, color=color, alpha=0.5)
            r = rows[m][key]
            if r["n"] >= 2:
                ax.errorbar([r["mean"]], [y], xerr=[[r["mean"] - r["ci"][0]], [r["ci"][1] - r["mean"]]], fmt="o",
                            color=color, capsize=3)  # fmt: skip
            else:
                ax.scatter([r["mean"]], [y], marker="o", color=color)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0) if axes[0].get_xlim()[0] <= t <= axes[0].get_xlim()[1]]
    axes[0].set_xticks(ticks, [f"{t:g}" for t in ticks])
    axes[0].xaxis.set_minor_formatter(plt.NullFormatter())  # the default minor labels overlap on a short decade
    labels = [f"{m}  (β' {rows[m]['effective_beta']:.3g})" if rows[m]["effective_beta"] else m for m in methods]
    axes[0].set_yticks(range(len(methods)), labels[::-1], fontsize=8)
    fig.suptitle(f"The frameworks' KLs on SmolLM2-135M at one nominal β: mean and 95% t interval of {n} seeds "
                 "(dots: seeds)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    save(fig, path, 150)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or args.grid
    rows = report(args.grid, out)
    print((out / "headtohead.md").read_text())
    print(f"wrote into {out}: headtohead.md, headtohead.json, headtohead.png ({len(rows)} methods)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
