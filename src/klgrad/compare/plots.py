"""The figures of a grid: ``comparison.png`` (the paper's panels of the training batches and a row of held-out
evaluations, mean over seeds per method) and ``frontier.png`` (final KL to the reference against final accuracy,
one point per run). ``convergence.png`` is :mod:`klgrad.compare.convergence_plot`'s."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from klgrad.compare.design import run_name
from klgrad.compare.hypotheses import kl_metric
from klgrad.compare.records import RunRow
from klgrad.compare.runs import read_jsonl
from klgrad.plotting import pyplot, save
from klgrad.rewards import accuracy_reward_name

COLORS = {
    "none": "#555555",
    "k1_as_loss": "#9e9e9e",
    "k2_as_loss": "#808000",
    "k3_as_loss": "firebrick",
    "k1_in_reward": "royalblue",
}
KL_AXIS_LABELS = {"exact_kl": "exact", "stepwise_kl": "sampled, stepwise", "sampled_k1": "sampled k1"}
"""Short forms of :data:`klgrad.compare.render.KL_LABELS` for a figure's axis (the long ones do not fit its width)."""


PANELS = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "accuracy"),
    ("loss/kl", "KL loss"),
    ("kl/logp_gap", "log-prob diff mean(l − r)"),
    ("response/length", "response length"),
    ("entropy", "entropy"),
    ("reward/std_in_group", "reward std within groups"),
    ("loss/policy", "policy loss"),
    ("kl/k1", "sequence KL (k1)"),
)


EVAL_PANELS = (
    ("eval/kl_to_optimum", "held-out KL(π‖π*) to the optimum of J_β (exact)"),
    ("eval/exact_kl", "held-out KL(π‖π_ref) (exact)"),
    ("eval/greedy_accuracy", "held-out greedy accuracy"),
)
"""Panels of the held-out evaluations (every ``train.eval_every`` steps), drawn as points joined by lines."""


SAMPLED_KL_PANEL = ("eval/kl_k1", "held-out KL(π‖π_ref) (sampled k1)")
"""The held-out KL panel of runs that logged no exact KL (a real model's vocabulary is not enumerable)."""


def held_out_kl_panel(records: Iterable[dict]) -> tuple[str, str]:
    """The held-out KL(π‖π_ref) panel: the exact KL when any of ``records`` logged it, else the evaluation's
    sampled k1 (:data:`SAMPLED_KL_PANEL`)."""
    exact = EVAL_PANELS[1]
    return exact if any(r.get(exact[0]) is not None for r in records) else SAMPLED_KL_PANEL


def _run_records(out_dir: Path, method: str, beta: float, seeds: list[int]) -> list[list[dict]]:
    return [read_jsonl(out_dir / "runs" / run_name(method, beta, s) / "metrics.jsonl") for s in seeds]


def plot_grid(
    out_dir: Path,
    grid: Sequence[tuple[str, float, int]],
    methods: Sequence[str],
    betas: Sequence[float],
    scaled: bool = False,
) -> None:
    """The paper's panel layout (training batches: mean over seeds with a ±1 sd band, one colour per method,
    first β) and a row of held-out evaluations: distance to the optimum π*, to the reference, accuracy.

    ``scaled`` (a ``--beta-scale`` grid): each run logged its distance to the optimum of J_β' at its own β', so
    that panel says so (only the final KL(π‖π*) of the summary is at the grid's β)."""
    plt = pyplot()
    import numpy as np

    eval_panels = EVAL_PANELS
    if scaled:
        eval_panels = (
            ("eval/kl_to_optimum", "held-out KL(π‖π*) of J_β' at each run's own β' (not comparable across β')"),
            *EVAL_PANELS[1:],
        )

    b = betas[0]
    records = {m: _run_records(out_dir, m, b, [s for mm, bb, s in grid if mm == m and bb == b]) for m in methods}
    kl_panel = held_out_kl_panel(r for rs in records.values() for run in rs for r in run)
    eval_panels = (eval_panels[0], kl_panel, eval_panels[2])
    fig, axes = plt.subplots(4, 3, figsize=(14, 13))
    drawn: set[int] = set()  # panels that got data
    for m in methods:
        runs = records[m]
        if not runs:
            continue
        series = [[r for r in rs if "reward/mean" in r] for rs in runs]
        n = min(len(s) for s in series)
        steps = [r["step"] for r in series[0][:n]]
        logged = {k.removeprefix("reward/") for r in series[0][:1] for k in r}
        accuracy_key = "reward/" + (accuracy_reward_name(logged) or "accuracy")  # the task's accuracy reward
        for i, (ax, (key, label)) in enumerate(zip(axes.flat[:9], PANELS, strict=True)):
            key = accuracy_key if key == "reward/accuracy" else key
            if any(r.get(key) is not None for s in series for r in s[:n]):
                drawn.add(i)
            y = np.array([[r[key] if r.get(key) is not None else np.nan for r in s[:n]] for s in series])
            k = max(1, n // 25)  # light smoothing for readability (moving average over k steps)
            kernel = np.ones(k) / k
            mean = np.convolve(np.nanmean(y, 0), kernel, mode="valid")
            sd = np.convolve(np.nanstd(y, 0), kernel, mode="valid")
            xs = steps[k - 1 :]
            ax.plot(xs, mean, color=COLORS.get(m), lw=1.6, label=m)
            ax.fill_between(xs, mean - sd, mean + sd, color=COLORS.get(m), alpha=0.15)
            ax.set_title(label, fontsize=10)
            ax.grid(alpha=0.3)
        for ax, (key, label) in zip(axes.flat[9:], eval_panels, strict=True):
            evals = [{r["step"]: r[key] for r in rs if r.get(key) is not None} for rs in runs]
            common = sorted(set.intersection(*(set(e) for e in evals))) if evals else []
            if common:
                drawn.add(9 + eval_panels.index((key, label)))
                y = np.array([[e[t] for t in common] for e in evals])  # (seeds, evals)
                ax.errorbar(
                    common, y.mean(0), yerr=y.std(0), color=COLORS.get(m), marker="o", ms=4, lw=1.4, capsize=3, label=m
                )
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
    for i, ax in enumerate(axes.flat):
        if i not in drawn:  # e.g. the exact panels of a model whose vocabulary is too large to enumerate
            ax.cla()
            ax.set_title(ax.get_title() or (PANELS + eval_panels)[i][1], fontsize=10)
            ax.text(0.5, 0.5, "not measured in these runs", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in (axes.flat[0], axes.flat[9]):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"klgrad compare — mean over seeds ± 1 sd (β = {b:g}); training panels smoothed by a moving average; "
        "bottom row: held-out evaluations",
        fontsize=11,
    )
    fig.tight_layout()
    save(fig, out_dir / "comparison.png", dpi=110)


def plot_frontier(results: Sequence[RunRow], path: Path, methods: Sequence[str]) -> None:
    """Final KL to the reference vs final held-out greedy accuracy: one point per run."""
    plt = pyplot()

    key = kl_metric(results)
    markers = ["o", "s", "^", "D", "v", "P"]
    betas = sorted({r.beta for r in results})
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for m in methods:
        for j, b in enumerate(betas):
            rs = [r for r in results if r.method == m and r.beta == b]
            ax.scatter(
                [r.final[key] for r in rs],
                [r.final["greedy_accuracy"] for r in rs],
                color=COLORS.get(m),
                marker=markers[j % len(markers)],
                s=45,
                alpha=0.85,
                label=f"{m} β={b:g}" if len(betas) > 1 else m,
            )
    ref_acc = results[0].final.get("reference_greedy_accuracy") if results else None
    if ref_acc is not None:
        ax.axhline(ref_acc, color="black", ls=":", lw=1, label="reference")
    ax.set_xlabel(f"final KL(π‖π_ref) on held-out prompts ({KL_AXIS_LABELS[key]})")
    ax.set_ylabel("final held-out greedy accuracy")
    ax.set_title("Reward–KL frontier (one point per run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path, dpi=120)
