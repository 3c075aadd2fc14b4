r"""The figure and the verdict of `klgrad reproduce k3-gaussian`, drawn from its result dict alone.

:func:`plot_k3_gaussian` draws three panels: (a) the estimators' batch means, (b) k3's sample variance against
the sample size n per σq, (c) that variance against σq with the threshold σq = σp/√2.
:func:`verdict_k3_gaussian` writes the markdown: the true KL, the estimators over many runs, the paper's four
runs beside ours, the variance condition and the verdict. Both read the JSON-ready dict of
:func:`klgrad.reproduce.k3_gaussian.run_k3_gaussian` (non-finite numbers as the strings "inf"/"nan").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from klgrad.fmt import fmt_num
from klgrad.plotting import pyplot, save
from klgrad.reproduce.estimator_sampling import ESTIMATORS
from klgrad.reproduce.gaussian_theory import gaussian_estimator_moments


def _g3(x: float | str) -> str:
    """Three significant figures; "∞" for infinite (also for the JSON string "inf")."""
    return fmt_num(x, 3, significant=True)


# ----------------------------------------------------------------------------------------------------------
# figure


def plot_k3_gaussian(path: Path, res: dict[str, Any], means: dict[str, np.ndarray]) -> None:
    """Write the three-panel PNG; ``means``: per estimator the (n_runs,) batch means of part A."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.4))
    _panel_batch_means(axes[0], res, means)
    _panel_variance_vs_n(axes[1], res, plt)
    _panel_variance_vs_sigma(axes[2], res)
    fig.tight_layout()
    save(fig, path, dpi=110)


def _panel_batch_means(ax: Any, res: dict[str, Any], means: dict[str, np.ndarray]) -> None:
    """(a) per estimator: the batch means, their mean ± std, our 4 paper-size runs and the paper's 4."""
    truth, summ = res["truth"], res["runs_summary"]
    kl = truth["kl_q_p_closed_form"]
    rng = np.random.default_rng(0)
    hi = 0.0
    for i, k in enumerate(ESTIMATORS):
        m = means[k]
        lab = f"batch means ({res['setup']['n_runs']} runs × {res['setup']['n_samples']:,})"
        ax.scatter(i + rng.uniform(-0.12, 0.12, m.size), m, s=6, color="0.6", alpha=0.5, label=lab if i == 0 else None)
        mu, sd = summ[k]["mean_of_batch_means"], summ[k]["std_of_batch_means"]
        ax.errorbar(
            i - 0.25, mu, yerr=sd, fmt="o", color="k", capsize=4, label="mean ± std across runs" if i == 0 else None
        )
        ours = [r[k]["mean"] for r in res["four_runs"]]
        paper = [r[k]["mean"] for r in res["paper_four_runs"]]
        ax.scatter(
            [i + 0.25] * 4,
            ours,
            marker="^",
            color="tab:blue",
            s=28,
            zorder=3,
            label=f"4 runs × {res['setup']['paper_n_samples']:,} (ours)" if i == 0 else None,
        )
        ax.scatter(
            [i + 0.32] * 4,
            paper,
            marker="x",
            color="tab:red",
            s=28,
            zorder=3,
            label="4 runs (paper)" if i == 0 else None,
        )
        hi = max(hi, float(np.quantile(m, 0.98)), mu + sd, *ours)
    ax.axhline(kl, color="tab:green", lw=1.5, label=f"true KL(q‖p) = {kl:.4f}")
    ek2 = truth["expected"]["k2"]
    ax.hlines(ek2, 0.6, 1.4, color="tab:purple", ls="--", lw=1.5, label=f"E[k2] (closed form) = {ek2:.4f}")
    n_out = int((means["k3"] > hi * 1.15).sum())
    ax.set_ylim(0.4, hi * 1.15)
    if n_out:
        ax.text(2, hi * 1.12, f"{n_out} k3 run(s) above", ha="center", va="top", fontsize=8)
    ax.set_xticks(range(3), ESTIMATORS)
    ax.set_ylabel("estimate of KL(q‖p)")
    ax.set_title("(a) q = N(0.1, 0.2²) samples, p = N(0, 1)")
    ax.legend(fontsize=7.5, loc="upper left")


def _panel_variance_vs_n(ax: Any, res: dict[str, Any], plt: Any) -> None:
    """(b) per σq: the median sample Var[k3] against n; red dashed where Var[k3] = ∞, dotted the closed form."""
    vc = res["variance_condition"]
    sweep = vc["sweep"]
    fin = [s for s in sweep if s["finite_theory"]]
    inf = [s for s in sweep if not s["finite_theory"]]
    cmap_f, cmap_i = plt.get_cmap("Blues"), plt.get_cmap("Reds")
    for group, cmap, ls in ((inf, cmap_i, "--"), (fin, cmap_f, "-")):
        for idx, s in enumerate(group):
            c = cmap(0.4 + 0.6 * (idx + 1) / max(len(group), 1))
            ns = [v["n"] for v in s["var_by_n"]]
            med = [v["median"] for v in s["var_by_n"]]
            tag = "∞" if not s["finite_theory"] else f"{s['var_k3_theory']:.3g}"
            ax.plot(ns, med, ls=ls, marker="o", ms=3, color=c, label=f"σq={s['sigma_q']:g} (Var={tag})")
            if s["finite_theory"]:
                ax.hlines(s["var_k3_theory"], ns[0], ns[-1], color=c, ls=":", lw=0.9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sample size n")
    ax.set_ylabel(f"sample Var[k3] (median of {vc['sweep_repeats']} repeats)")
    ax.set_title(
        f"(b) Var[k3] vs n (μq = {vc['sweep_mu_q']:g}); red dashed: 2σq² ≤ σp²;\nblue: finite, dotted = closed form",
        fontsize=10.5,
    )
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))


def _panel_variance_vs_sigma(ax: Any, res: dict[str, Any]) -> None:
    """(c) the sample Var[k3] at the smallest and largest n against σq, the closed form and the threshold."""
    vc = res["variance_condition"]
    sweep = vc["sweep"]
    sq = np.array([s["sigma_q"] for s in sweep])
    last = np.array([s["var_by_n"][-1]["median"] for s in sweep])
    first = np.array([s["var_by_n"][0]["median"] for s in sweep])
    ax.plot(sq, last, "o-", color="k", ms=4, label=f"sample Var[k3], n = {vc['sweep_ns'][-1]:,} (median)")
    ax.plot(sq, first, "s:", color="0.5", ms=3, label=f"sample Var[k3], n = {vc['sweep_ns'][0]:,} (median)")
    grid = np.linspace(min(sq.min(), vc["sigma_q_threshold"]) * 0.98, sq.max(), 400)
    th = [gaussian_estimator_moments(vc["sweep_mu_q"], g, 0.0, 1.0)["estimators"]["k3"]["var"] for g in grid]
    ax.plot(grid, th, color="tab:green", lw=1.5, label="closed-form Var[k3] (→ ∞ at threshold)")
    ax.axvline(
        vc["sigma_q_threshold"], color="tab:red", ls="--", label=f"threshold σq = σp/√2 = {vc['sigma_q_threshold']:.4f}"
    )
    ax.axvspan(sq.min() * 0.95, vc["sigma_q_threshold"], color="tab:red", alpha=0.07)
    ax.set_yscale("log")
    ax.set_ylim(min(last.min(), first.min()) * 0.5, max(last.max(), first.max()) * 3)
    ax.set_xlabel("σq (sampler std), p = N(0, 1)")
    ax.set_ylabel("Var[k3]")
    ax.set_title("(c) infinite variance for σq² ≤ σp²/2 (shaded)")
    ax.legend(fontsize=7.5, loc="upper right")


# ----------------------------------------------------------------------------------------------------------
# verdict


def verdict_k3_gaussian(res: dict[str, Any]) -> str:
    """The verdict markdown of ``res`` (a :func:`~klgrad.reproduce.k3_gaussian.run_k3_gaussian` result)."""
    lines = _truth_section(res) + _runs_section(res) + _four_runs_section(res)
    lines += _variance_section(res) + _conclusion_section(res)
    return "\n".join(lines)


def _truth_section(res: dict[str, Any]) -> list[str]:
    t, st = res["truth"], res["setup"]
    kl = t["kl_q_p_closed_form"]
    return [
        "# k3 value estimator on Gaussians (paper appendix I)",
        "",
        f"Setup: x ~ q = N({st['q_sampler']['mu']}, {st['q_sampler']['sigma']}²), p = N({st['p_reference']['mu']}, "
        f"{st['p_reference']['sigma']}²), r = p(x)/q(x); estimates from `klgrad.kl.kl_estimate` (float64), "
        f"{st['n_runs']} runs × {st['n_samples']:,} samples, seed {st['seed']}.",
        "",
        "## True KL",
        f"- closed form KL(q‖p) = {kl:.6f} (torch.distributions: {t['kl_q_p_torch']:.6f}); "
        f"the reverse KL(p‖q) = {t['kl_p_q_closed_form']:.4f}.",
        f"- paper: true KL = {t['paper_true_kl']}. "
        + (
            "Matches KL(q‖p) with q the sampler (the direction the estimators target)."
            if t["paper_matches"]
            else "Does NOT match either direction."
        ),
        f"- closed-form expectations: E[k1] = E[k3] = {t['expected']['k1']:.4f}, "
        f"E[k2] = {t['expected']['k2']:.4f} (k2 biased {'low' if t['expected']['k2'] < kl else 'high'}); "
        f"E_q[r] = {t['E_q_r']:.6f}; E_q[r²] = {fmt_num(t['E_q_r2'])}.",
        "",
    ]


def _runs_section(res: dict[str, Any]) -> list[str]:
    t, s, st = res["truth"], res["runs_summary"], res["setup"]
    lines = [
        f"## Estimators over {st['n_runs']} runs of {st['n_samples']:,}",
        "| est. | theory mean | mean of batch means | std across runs | z vs theory | median batch mean "
        "| runs below KL | per-sample std (median, min–max) | theory per-sample std |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in ESTIMATORS:
        r = s[k]
        lines.append(
            f"| {k} | {t['expected'][k]:.4f} | {r['mean_of_batch_means']:.4f} | {fmt_num(r['std_of_batch_means'])} "
            f"| {r['z_vs_expected']:+.2f} | {r['median_batch_mean']:.4f} | {100 * r['frac_runs_below_kl']:.0f}% "
            f"| {fmt_num(r['per_sample_std_median'])} "
            f"({fmt_num(r['per_sample_std_min'])}–{fmt_num(r['per_sample_std_max'])}) "
            f"| {fmt_num(t['per_sample_std'][k])} |"
        )
    lines += [
        "",
        f"(k3's z-score and std across runs are not a valid error bar: Var[k3] = ∞ here, "
        f"{st['samples_with_log_r_over_EXP_CAP']} sample(s) had log r above kl_estimate's EXP_CAP.)",
        "",
    ]
    return lines


def _four_runs_section(res: dict[str, Any]) -> list[str]:
    paper_runs = res["paper_four_runs"]
    lines = [
        f"## Four runs of {res['setup']['paper_n_samples']:,} samples (the paper's listing size): ours vs paper",
        "| run | k1 mean / std | k2 mean / std | k3 mean / std | paper: k1 | paper: k2 | paper: k3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (o, p) in enumerate(zip(res["four_runs"], paper_runs, strict=True)):
        ours = " | ".join(f"{o[k]['mean']:.4f} / {o[k]['std']:.4f}" for k in ESTIMATORS)
        pap = " | ".join(f"{p[k]['mean']:.4f} / {p[k]['std']:.4f}" for k in ESTIMATORS)
        lines.append(f"| {i + 1} | {ours} | {pap} |")
    k3o = [o["k3"]["std"] for o in res["four_runs"]]
    k1o = [o["k1"]["std"] for o in res["four_runs"]]
    k3p = [p["k3"]["std"] for p in paper_runs]
    k1p = [p["k1"]["std"] for p in paper_runs]
    lines += [
        "",
        f"Ours: k3 per-sample std {min(k3o):.2f}–{max(k3o):.2f} vs k1 {min(k1o):.2f}–{max(k1o):.2f}; "
        f"paper: k3 {min(k3p):.2f}–{max(k3p):.2f}, k1 {min(k1p):.2f}–{max(k1p):.2f}.",
        "",
    ]
    return lines


def _variance_section(res: dict[str, Any]) -> list[str]:
    vc, st = res["variance_condition"], res["setup"]
    lines = [
        "## When is Var[k3] finite?",
        f"- derived: {vc['derived']} (E_q[(log r)²] is always finite for Gaussians; means do not matter; "
        "at equality ∫p²/q diverges).",
        f'- paper: "{vc["paper"]}" (and 2Σq - Σp ≻ 0 for multivariate Gaussians).',
        "- The paper's condition is correct: it is the same condition as the derived one, with q the sampler. "
        f"For σp = {st['p_reference']['sigma']:g} the threshold is σq = σp/√2 = {vc['sigma_q_threshold']:.4f}; "
        f"the paper's σq = {st['q_sampler']['sigma']:g} violates it (σq² = {st['q_sampler']['sigma'] ** 2:.4g} "
        f"≤ σp²/2 = {st['p_reference']['sigma'] ** 2 / 2:.4g}).",
        "",
        f"Sample Var[k3], median of {vc['sweep_repeats']} repeats, μq = {vc['sweep_mu_q']}:",
        "",
        "| σq | 2σq² - σp² | theory Var[k3] | "
        + " | ".join(f"n={n:.0e}" for n in vc["sweep_ns"])
        + " | growth last/first | rel. err. vs theory |",
        "|---|---|---|" + "---|" * len(vc["sweep_ns"]) + "---|---|",
    ]
    for row in vc["sweep"]:
        vals = " | ".join(_g3(v["median"]) for v in row["var_by_n"])
        rel = row["rel_err_last_vs_theory"]
        rel_s = f"{100 * rel:+.1f}%" if isinstance(rel, float) else "—"
        lines.append(
            f"| {row['sigma_q']:g} | {row['two_sigma_q2_minus_sigma_p2']:+.3f} | {_g3(row['var_k3_theory'])} "
            f"| {vals} | {row['growth_median_last_over_first']:.3g}× | {rel_s} |"
        )
    return [*lines, "", *_variance_findings(vc)]


def _variance_findings(vc: dict[str, Any]) -> list[str]:
    """The sweep read in words: growth with n on each side of the threshold, and right next to it."""
    inf_rows = [r for r in vc["sweep"] if not r["finite_theory"]]
    fin_rows = [r for r in vc["sweep"] if r["finite_theory"]]
    lines = []
    if inf_rows:
        g = [r["growth_median_last_over_first"] for r in inf_rows]
        lines.append(
            f"- infinite-variance side (σq ≤ {vc['sigma_q_threshold']:.4f}): the median sample variance grows "
            f"{min(g):.2f}×–{max(g):.2f}× from n={vc['sweep_ns'][0]:,} to n={vc['sweep_ns'][-1]:,}; "
            "it drifts upward with n instead of settling (not monotonically: one extreme draw can dominate a "
            "sample), most slowly right at the threshold, where the tail of r² is only barely too heavy."
        )
    if fin_rows:
        e = [abs(r["rel_err_last_vs_theory"]) for r in fin_rows]
        g = [r["growth_median_last_over_first"] for r in fin_rows]
        lines.append(
            f"- finite-variance side: growth {min(g):.2f}×–{max(g):.2f}×, and at n={vc['sweep_ns'][-1]:,} the "
            f"median sample variance is within {100 * max(e):.1f}% of the closed form (worst case closest to "
            "the threshold, where the fourth moment of r is infinite and convergence is slow)."
        )
    if inf_rows and fin_rows:
        a, b = inf_rows[-1], fin_rows[0]
        lines.append(
            f"- Next to the threshold (σq = {a['sigma_q']:g}: growth {a['growth_median_last_over_first']:.3g}×; "
            f"σq = {b['sigma_q']:g}: growth {b['growth_median_last_over_first']:.3g}×) samples of up to "
            f"n = {vc['sweep_ns'][-1]:,} only weakly separate the two sides; far from it the separation is stark."
        )
    return lines


def _conclusion_section(res: dict[str, Any]) -> list[str]:
    t, s = res["truth"], res["runs_summary"]
    kl = t["kl_q_p_closed_form"]
    k3, k1 = s["k3"], s["k1"]
    return [
        "",
        "## Verdict",
        f"- Reproduced: the true KL is {kl:.4f} (paper: {t['paper_true_kl']}); k1 is unbiased "
        f"(mean {k1['mean_of_batch_means']:.4f}, z = {k1['z_vs_expected']:+.2f}) with per-sample std "
        f"≈ {k1['per_sample_std_median']:.3f}; k2 is biased low (mean {s['k2']['mean_of_batch_means']:.4f} vs "
        f"E[k2] = {t['expected']['k2']:.4f}, z = {s['k2']['z_vs_expected']:+.2f}; below KL = {kl:.4f} in "
        f"{100 * s['k2']['frac_runs_below_kl']:.0f}% of runs), matching the closed form ½(Var[log r] + KL²).",
        f"- k3 is unbiased in theory but its variance is infinite: per-sample std ranges "
        f"{k3['per_sample_std_min']:.4g}–{k3['per_sample_std_max']:.4g} across runs, the median batch mean "
        f"is {k3['median_batch_mean']:.4f} ({100 * k3['frac_runs_below_kl']:.0f}% of runs below the true KL), "
        f"with rare runs far above (max {k3['max_batch_mean']:.4g}). This is the paper's claim: a sampling "
        "error, not a bias, but at these sample sizes it is typically negative.",
        "",
    ]
