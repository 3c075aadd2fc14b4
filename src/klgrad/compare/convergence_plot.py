"""The convergence criterion as a figure: the logged metric over the run, and each test's per-seed movements
against the two bounds it must meet (:mod:`klgrad.compare.convergence` for the criterion)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from klgrad.compare.convergence import (
    ConvergenceCriterion,
    MethodRuns,
    Series,
    cut_before_decay,
    still_and_resolved,
    window_spans,
)
from klgrad.plotting import pyplot, save

TESTS = (("end of the run", None), ("cut before the decay", "before_decay"))


def seed_mean_band(series: Sequence[Series]) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean, se) over the runs at every step all of them logged: the per-step mean over seeds and its
    standard error sd/√n (0 with one run)."""
    common = sorted(set.intersection(*(set(t for t, _ in s) for s in series))) if series else []
    values = [dict(s) for s in series]
    means, ses = [], []
    for t in common:
        xs = [v[t] for v in values]
        m = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        means.append(m)
        ses.append(sd / math.sqrt(len(xs)))
    return common, means, ses


def plot_convergence(
    data: Mapping[str, MethodRuns],
    record: Mapping,
    crit: ConvergenceCriterion,
    path: str | os.PathLike[str],
    colors: Mapping[str, str] | None = None,
) -> None:
    """Left: each method's seed-mean ``crit.metric`` per step (± 1 SE band), the learning rate on a second
    axis, and the windows the tests compare (last quarter of the run; last quarter of the run cut where the lr
    is last at least half its peak). Right: per method and test, every seed's movement δ_s (second half's mean
    minus the first's), their mean ± z·SE, and the box of half-width z·(se_fraction·gap) around the mean: a test
    passes when its bar crosses 0 (stopped moving) and fits inside the box (resolved). A method meets the
    criterion when both tests pass, its metric is logged densely and its lr decays (the summary's table).

    ``data``: method → its runs (the metric's and the lr's series); ``record``: ``summary.json``'s
    ``convergence``."""
    plt = pyplot()
    colors = colors or {}
    by = record.get("by_method") or {}
    methods = [m for m in data if m in by]
    bound = None if crit.gap is None else crit.se_fraction * crit.gap
    decays = True  # does the cut before the decay differ from the whole run (a decaying lr)?
    for m in methods:
        if data[m].series and data[m].lrs:
            cut = cut_before_decay(data[m].series[0], data[m].lrs[0])
            decays = bool(cut) and cut[-1][0] < data[m].series[0][-1][0]
            break
    tests = TESTS if crit.before_decay and decays else TESTS[:1]  # at a constant lr the two tests are one
    groups = len(methods) * len(tests)
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(10 + 1.1 * groups, 5), gridspec_kw={"width_ratios": [10, max(4, 1.1 * groups)]}
    )

    lr_ax = ax.twinx()
    spans = None
    for m in methods:
        series, lrs = data[m].series, data[m].lrs
        steps, mean, se = seed_mean_band(series)
        c = colors.get(m)
        ax.plot(steps, mean, color=c, lw=1.4, label=f"{m} ({len(series)} seeds)")
        lo = [a - b for a, b in zip(mean, se, strict=True)]
        hi = [a + b for a, b in zip(mean, se, strict=True)]
        ax.fill_between(steps, lo, hi, color=c, alpha=0.2)
        if spans is None and series and lrs:
            run, lr = series[0], lrs[0]
            lr_ax.plot([t for t, _ in lr], [x for _, x in lr], color="grey", lw=1, ls="--")
            lr_ax.set_ylim(0, 1.05 * max(x for _, x in lr))  # a constant lr is a line, not the axis' whole range
            cut = cut_before_decay(run, lr)
            spans = (window_spans(run[-1][0], crit.window), window_spans(cut[-1][0], crit.window) if cut else None)
    if spans is not None:
        for (a, b), alpha in zip(spans[0], (0.08, 0.16), strict=True):
            ax.axvspan(a, b, color="tab:blue", alpha=alpha, lw=0)
        if len(tests) == 2 and spans[1] is not None:
            for (a, b), alpha in zip(spans[1], (0.08, 0.16), strict=True):
                ax.axvspan(a, b, color="tab:orange", alpha=alpha, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{crit.metric}, mean over seeds ± 1 SE")
    lr_ax.set_ylabel("learning rate (dashed)", color="grey")
    ax.set_title(
        "shaded: the halves each test compares (blue: end of the run"
        + ("; orange: cut before the decay)" if len(tests) == 2 else ")"),
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(len(methods), 5))  # below

    x = 0
    ticks, labels = [], []
    for m in methods:
        for name, key in tests:
            v = by[m] if key is None else by[m].get(key)
            if v is None or v.get("deltas") is None:
                continue
            d, mv, se = v["deltas"], v["moved"], v["se"]
            c = colors.get(m)
            spread = [x + 0.25 * ((i + 0.5) / len(d) - 0.5) for i in range(len(d))]
            bx.scatter(spread, d, s=12, color=c, alpha=0.6, lw=0)
            if mv is not None and se is not None:
                if bound is not None:
                    h = crit.z * bound
                    bx.add_patch(plt.Rectangle((x + 0.18, mv - h), 0.24, 2 * h, color="grey", alpha=0.2, lw=0))
                bx.errorbar([x + 0.3], [mv], yerr=[crit.z * se], color=c, marker="o", ms=5, capsize=4, lw=1.6)
            need = v.get("seeds_needed")
            verdict = "passes" if all(still_and_resolved(mv, se, crit)) else "fails"
            ticks.append(x + 0.15)
            wrapped = name.replace(" the ", "\nthe ", 1)  # two short lines: neighbouring labels stay apart
            labels.append(f"{m}\n{wrapped}\n{verdict}" + ("" if need is None else f"\n~{need} seeds"))  # own line
            x += 1
    bx.axhline(0, color="black", lw=0.8)
    bx.set_xticks(ticks, labels, fontsize=7, rotation=30 if groups > 4 else 0, ha="right" if groups > 4 else "center")
    bx.set_ylabel(f"δ_s: change of {crit.metric} across the window")
    bx.set_title(
        f"dots: seeds; bar: mean ± {crit.z:g} SE"
        + ("" if bound is None else f"; box: ± {crit.z:g} × {bound:.3g} (the SE bound)"),
        fontsize=9,
    )
    bx.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"convergence: {verdict_text(record)} at {record.get('steps')} steps"
        + ("" if bound is None else " (~N seeds: the seeds the SE bound needs at the spread seen so far)"),
        fontsize=11,
    )
    fig.tight_layout()
    save(fig, path, dpi=110)


def verdict_text(record: dict) -> str:
    """The figure's verdict: met, not met, or, for a grid decided at an amended seed count not yet reached,
    "not decided (n of N seeds; the test passes/fails so far)"."""
    so_far = record.get("so_far")
    if record.get("met") is None and so_far:
        return (
            f"not decided ({so_far['seeds']} of {record['decided_at_seeds']} seeds; "
            f"the test {'passes' if so_far['met'] else 'fails'} so far)"
        )
    return "met" if record.get("met") else "not met"
