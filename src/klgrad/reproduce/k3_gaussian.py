r"""`klgrad reproduce k3-gaussian`: the paper's appendix I, the k3 *value* estimator on Gaussians.

q = N(0.1, 0.2²) samples, p = N(0, 1) is the reference. k3 is unbiased, but its variance is finite only when
2σq² > σp² (:mod:`klgrad.reproduce.gaussian_theory`), which the paper's σq = 0.2 violates: batch means are
typically below the true KL, with rare huge ones. Every estimate comes from :func:`klgrad.kl.kl_estimate`
(:mod:`klgrad.reproduce.estimator_sampling`); the figure and the verdict are drawn from the result dict
(:mod:`klgrad.reproduce.k3_gaussian_report`). Results: docs/reproduction.md, section "4. k3 as a value
estimator on Gaussians (appendix I)".
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch.distributions import Normal, kl_divergence

from klgrad.kl import EXP_CAP
from klgrad.reproduce.estimator_sampling import ESTIMATORS, derive_seed, sample_gaussian_estimators, torch_threads
from klgrad.reproduce.gaussian_theory import EstimatorMoments, gaussian_estimator_moments, k3_variance_is_finite
from klgrad.reproduce.k3_gaussian_report import plot_k3_gaussian, verdict_k3_gaussian
from klgrad.reproduce.results import jsonable, write_json

# What the paper prints (appendix I, listing "Actual Output 1-4"): quoted, never used as expectations.
PAPER_TRUE_KL = 1.1344
PAPER_N_SAMPLES = 10_000
_PAPER_TABLE = (  # (k1 mean, k1 std, k2 mean, k2 std, k3 mean, k3 std) per printed run
    (1.1272, 0.6912, 0.8742, 0.6006, 0.8136, 8.8244),
    (1.1336, 0.6611, 0.8611, 0.5210, 0.6817, 4.1082),
    (1.1348, 0.6709, 0.8689, 0.4968, 0.6595, 1.4925),
    (1.1256, 0.6962, 0.8758, 0.6263, 0.9772, 26.7379),
)
PAPER_RUNS: tuple[dict[str, dict[str, float]], ...] = tuple(
    {k: {"mean": row[2 * i], "std": row[2 * i + 1]} for i, k in enumerate(("k1", "k2", "k3"))} for row in _PAPER_TABLE
)
PAPER_MU_Q, PAPER_SIGMA_Q, PAPER_MU_P, PAPER_SIGMA_P = 0.1, 0.2, 0.0, 1.0


def run_k3_gaussian(
    out_dir: str | Path,
    *,
    n_samples: int = 100_000,
    n_runs: int = 200,
    seed: int = 0,
    sigmas: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9, 1.0, 1.2, 1.5),
    sweep_ns: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000),
    sweep_repeats: int = 10,
    sweep_mu_q: float = PAPER_MU_Q,
    paper_n_samples: int = PAPER_N_SAMPLES,
) -> dict[str, Any]:
    r"""Reproduce appendix I's Gaussian demonstration and the finite-variance condition of k3.

    Part A (the paper's listing): q = N(0.1, 0.2²) samples, p = N(0, 1). ``n_runs`` runs of ``n_samples``
    each: per estimator the mean and std across runs of the batch mean, the per-sample std, against the
    closed-form KL(q‖p) (and E[k2]). Also 4 runs of ``paper_n_samples`` (the listing's 10,000), side by side
    with the paper's 4 printed outputs.

    Part B (the threshold): for each σq in ``sigmas`` (μq = ``sweep_mu_q``, p = N(0, 1)) and each n in
    ``sweep_ns``, the sample variance of k3 in ``sweep_repeats`` independent samples of size n, against
    the closed-form Var[k3] (∞ when 2σq² ≤ σp²).

    Writes ``k3_gaussian.json``, ``k3_gaussian.png`` and ``verdict.md`` into ``out_dir``; returns the JSON dict.
    """
    with torch_threads(1):
        t0 = time.perf_counter()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        theory = gaussian_estimator_moments(PAPER_MU_Q, PAPER_SIGMA_Q, PAPER_MU_P, PAPER_SIGMA_P)
        truth = paper_truth(theory)
        means, stds, n_over_cap = _many_runs(n_runs, n_samples, seed)
        summary = runs_summary(means, stds, truth["expected"], theory["kl_qp"])
        four_runs = _paper_size_runs(paper_n_samples, seed)
        sweep = _variance_sweep(sigmas, sweep_ns, sweep_repeats, sweep_mu_q, seed)
        result: dict[str, Any] = {
            "experiment": "k3_gaussian",
            "paper_section": "Appendix I: On the Statistical Instability of the k3 Value Estimator",
            "setup": {
                "q_sampler": {"mu": PAPER_MU_Q, "sigma": PAPER_SIGMA_Q},
                "p_reference": {"mu": PAPER_MU_P, "sigma": PAPER_SIGMA_P},
                "estimators": "klgrad.kl.kl_estimate(logp=log q(x), ref_logp=log p(x), kind), float64",
                "n_samples": n_samples,
                "n_runs": n_runs,
                "paper_n_samples": paper_n_samples,
                "seed": seed,
                "samples_with_log_r_over_EXP_CAP": n_over_cap,
            },
            "truth": truth,
            "runs_summary": summary,
            "four_runs": four_runs,
            "paper_four_runs": list(PAPER_RUNS),
            "variance_condition": {
                "derived": "Var_q[k3] < inf  iff  E_q[r^2] = int p^2/q < inf  iff  2 sigma_q^2 > sigma_p^2",
                "paper": "finite iff sigma_q^2 > sigma_p^2 / 2",
                "paper_matches_derivation": True,
                "sigma_q_threshold": PAPER_SIGMA_P / math.sqrt(2.0),
                "sweep_mu_q": sweep_mu_q,
                "sweep_ns": list(sweep_ns),
                "sweep_repeats": sweep_repeats,
                "sweep": sweep,
            },
            "files": ["k3_gaussian.json", "k3_gaussian.png", "verdict.md"],
        }
        result["seconds"] = time.perf_counter() - t0
        result = jsonable(result)
        plot_k3_gaussian(out / "k3_gaussian.png", result, means)
        write_json(out / "k3_gaussian.json", result)
        (out / "verdict.md").write_text(verdict_k3_gaussian(result))
        return result


def paper_truth(theory: EstimatorMoments) -> dict[str, Any]:
    """The ground truth of the paper's setting from the closed forms, and whether the paper's "true KL" is it."""
    matches = abs(theory["kl_qp"] - PAPER_TRUE_KL) < 5e-5
    return {
        "kl_q_p_closed_form": theory["kl_qp"],
        "kl_q_p_torch": float(kl_divergence(Normal(PAPER_MU_Q, PAPER_SIGMA_Q), Normal(PAPER_MU_P, PAPER_SIGMA_P))),
        "kl_p_q_closed_form": theory["kl_pq"],
        "paper_true_kl": PAPER_TRUE_KL,
        "paper_matches": matches,
        "paper_direction": "KL(q||p), q = N(0.1, 0.2^2) the sampler, p = N(0, 1)"
        if matches
        else "neither direction matches",
        "expected": {k: theory["estimators"][k]["mean"] for k in ESTIMATORS},
        "per_sample_std": {k: theory["estimators"][k]["std"] for k in ESTIMATORS},
        "E_q_r": theory["E_r"],
        "E_q_r2": theory["E_r2"],
        "var_k3_finite": k3_variance_is_finite(PAPER_SIGMA_Q, PAPER_SIGMA_P),
    }


def _many_runs(n_runs: int, n_samples: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """Per estimator, the (n_runs,) batch means and per-sample stds; and how many samples had log r > EXP_CAP."""
    means = {k: np.empty(n_runs) for k in ESTIMATORS}
    stds = {k: np.empty(n_runs) for k in ESTIMATORS}
    n_over_cap = 0
    for i in range(n_runs):
        s = sample_gaussian_estimators(
            PAPER_MU_Q, PAPER_SIGMA_Q, PAPER_MU_P, PAPER_SIGMA_P, n_samples, derive_seed(seed, 1, i)
        )
        n_over_cap += int((s["log_r"] > EXP_CAP).sum())
        for k in ESTIMATORS:
            means[k][i] = float(s[k].mean())
            stds[k][i] = float(s[k].std())  # unbiased, like the paper's ``k.std()``
    return means, stds, n_over_cap


def runs_summary(
    means: dict[str, np.ndarray], stds: dict[str, np.ndarray], expected: dict[str, float], kl: float
) -> dict[str, dict[str, float]]:
    """Per estimator: the spread of the (n_runs,) batch means around ``expected``, and of the per-sample stds."""
    summary: dict[str, dict[str, float]] = {}
    for k in ESTIMATORS:
        m, sd = means[k], stds[k]
        n_runs = m.size
        se = float(m.std(ddof=1) / math.sqrt(n_runs)) if n_runs > 1 else math.nan
        summary[k] = {
            "mean_of_batch_means": float(m.mean()),
            "std_of_batch_means": float(m.std(ddof=1)) if n_runs > 1 else math.nan,
            "se_of_mean": se,
            "z_vs_expected": (float(m.mean()) - expected[k]) / se if se > 0 else math.nan,
            "median_batch_mean": float(np.median(m)),
            "min_batch_mean": float(m.min()),
            "max_batch_mean": float(m.max()),
            "frac_runs_below_kl": float((m < kl).mean()),
            "per_sample_std_median": float(np.median(sd)),
            "per_sample_std_min": float(sd.min()),
            "per_sample_std_max": float(sd.max()),
        }
    return summary


def _paper_size_runs(n_samples: int, seed: int) -> list[dict[str, dict[str, float]]]:
    """4 runs of the paper's listing size: per estimator the batch mean and per-sample std (as the paper prints)."""
    runs = []
    for i in range(4):
        s = sample_gaussian_estimators(
            PAPER_MU_Q, PAPER_SIGMA_Q, PAPER_MU_P, PAPER_SIGMA_P, n_samples, derive_seed(seed, 2, i)
        )
        runs.append({k: {"mean": float(s[k].mean()), "std": float(s[k].std())} for k in ESTIMATORS})
    return runs


def _variance_sweep(
    sigmas: tuple[float, ...], sweep_ns: tuple[int, ...], repeats: int, mu_q: float, seed: int
) -> list[dict[str, Any]]:
    """Per σq: the sample variance of k3 at each n (``repeats`` samples each) against the closed-form Var[k3]."""
    sigma_p = PAPER_SIGMA_P
    sweep: list[dict[str, Any]] = []
    for j, sq in enumerate(sigmas):
        var_by_n = []
        for ni, n in enumerate(sweep_ns):
            reps = []
            for rep in range(repeats):
                sd = derive_seed(seed, 3, j, ni, rep)
                k3 = sample_gaussian_estimators(mu_q, sq, PAPER_MU_P, sigma_p, n, sd, kinds=("k3",))["k3"]
                reps.append(float(k3.var()))
            var_by_n.append({"n": n, "sample_vars": reps, "median": float(np.median(reps))})
        meds = [v["median"] for v in var_by_n]
        var_th = gaussian_estimator_moments(mu_q, sq, PAPER_MU_P, sigma_p)["estimators"]["k3"]["var"]
        sweep.append(
            {
                "sigma_q": sq,
                "two_sigma_q2_minus_sigma_p2": 2 * sq * sq - sigma_p**2,
                "finite_theory": k3_variance_is_finite(sq, sigma_p),
                "var_k3_theory": var_th,
                "var_by_n": var_by_n,
                "growth_median_last_over_first": meds[-1] / meds[0],
                "rel_err_last_vs_theory": (meds[-1] - var_th) / var_th if math.isfinite(var_th) else math.nan,
            }
        )
    return sweep
