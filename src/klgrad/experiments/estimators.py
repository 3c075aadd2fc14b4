r"""The paper's appendix I: statistical (in)stability of the k3 *value* estimator.

Setting (paper, appendix I). Samples x ~ q (the sampling distribution, the policy π); p is the reference
π_ref; r(x) = δ(x) = p(x)/q(x). The value estimators of KL(q‖p) are

    k1 = -log r,   k2 = ½ (log r)²,   k3 = (r - 1) - log r.

In klgrad's notation (:func:`klgrad.kl.kl_estimate`) u = logp - ref_logp with logp = log q(x) and
ref_logp = log p(x), so u = -log r and k1 = u, k2 = ½u², k3 = e^{-u} - 1 + u: the same three numbers. Every
estimate below is computed by ``kl_estimate`` itself (float64), so these experiments test the library.

Closed forms used as ground truth (derived in the docstrings below, checked by quadrature in the tests):

- Gaussians q = N(μq, σq²), p = N(μp, σp²): KL(q‖p) = log(σp/σq) + (σq² + (μq-μp)²)/(2σp²) - ½.
  With x = μq + σq z, z ~ N(0, 1): log r = c0 + a z² + b z, where c0 = log(σq/σp) - d²/(2σp²),
  a = ½ - σq²/(2σp²), b = -dσq/σp², d = μq - μp. Then E_q[r^t] = e^{t c0} (1 - 2ta)^{-½} e^{t²b²/(2(1 - 2ta))}
  when 1 - 2ta > 0, else ∞. Var_q[k3] is finite iff E_q[r²] is, iff 1 - 4a > 0, iff 2σq² > σp²
  (E_q[(log r)²] is always finite for Gaussians). This is the paper's condition σq² > σp²/2.
- Uniforms q = U[0, 1], p = U[0, 2]: r ≡ ½ on supp(q), so k1 ≡ log 2 = KL(q‖p) and k3 ≡ log 2 - ½ (biased:
  E_q[r] = ½ ≠ 1 because supp(p) ⊄ supp(q)).
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributions import Normal, Uniform, kl_divergence

from klgrad.kl import EXP_CAP, kl_estimate

ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

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


# ----------------------------------------------------------------------------------------------------------
# small shared helpers (plotting, JSON)


def _pyplot():
    """matplotlib.pyplot, switching to the Agg backend only if pyplot was not imported yet."""
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _jsonable(obj: Any) -> Any:
    """Recursively turn numpy/torch scalars into Python ones and non-finite floats into "inf"/"-inf"/"nan"."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.bool_ | bool):
        return bool(obj)
    if isinstance(obj, np.integer | int):
        return int(obj)
    if isinstance(obj, np.floating | float):
        x = float(obj)
        if math.isfinite(x):
            return x
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return obj


def _write_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")


def _g3(x: float | str) -> str:
    """Three significant figures; "∞" for infinite (also for the JSON string "inf")."""
    return _fmt(x) if isinstance(x, str) or not math.isfinite(x) else f"{x:.3g}"


def _fmt(x: float, nd: int = 4) -> str:
    if isinstance(x, str):
        return {"inf": "∞", "-inf": "-∞"}.get(x, x)
    if not math.isfinite(x):
        return "∞" if x > 0 else ("-∞" if x < 0 else "nan")
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.{max(nd - 1, 1)}e}"
    return f"{x:.{nd}f}"


# ----------------------------------------------------------------------------------------------------------
# closed forms (Gaussian)


def gaussian_kl(mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> float:
    r"""KL(N(μq, σq²) ‖ N(μp, σp²)) = log(σp/σq) + (σq² + (μq - μp)²)/(2σp²) - ½, in nats."""
    return math.log(sigma_p / sigma_q) + (sigma_q**2 + (mu_q - mu_p) ** 2) / (2.0 * sigma_p**2) - 0.5


def _log_ratio_quadratic(mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> tuple[float, float, float]:
    """(c0, a, b) with log(p/q)(μq + σq z) = c0 + a z² + b z exactly (see module docstring)."""
    d = mu_q - mu_p
    c0 = math.log(sigma_q / sigma_p) - d * d / (2.0 * sigma_p**2)
    a = 0.5 - sigma_q**2 / (2.0 * sigma_p**2)
    b = -d * sigma_q / sigma_p**2
    return c0, a, b


def gaussian_ratio_moment(t: float, mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> float:
    r"""E_{x~q}[r(x)^t] with r = p/q, t > 0: e^{t c0} (1 - 2ta)^{-½} e^{t² b² / (2(1 - 2ta))}, or ∞.

    E[e^{t(a z² + b z)}] for z ~ N(0, 1) is a Gaussian integral that converges iff 1 - 2ta > 0. t = 1 gives
    ∫p = 1 for every pair of Gaussians; t = 2 gives ∫ p²/q = 1 + χ²(p‖q), finite iff 2σq² > σp².
    """
    c0, a, b = _log_ratio_quadratic(mu_q, sigma_q, mu_p, sigma_p)
    s = 1.0 - 2.0 * t * a
    if s <= 0.0:
        return math.inf
    try:
        return math.exp(t * c0 + t * t * b * b / (2.0 * s)) / math.sqrt(s)
    except OverflowError:  # finite, but beyond float range (far-apart means, right above the threshold)
        return math.inf


def k3_variance_is_finite(sigma_q: float, sigma_p: float) -> bool:
    r"""Whether Var_{x~q}[k3] < ∞ for q = N(·, σq²) the sampler and p = N(·, σp²) the reference.

    Var[k3] < ∞ iff E_q[r²] = ∫ p²/q < ∞ (E_q[(log r)²] is a Gaussian moment of a quadratic, always finite).
    p²/q ∝ exp(-x²/σp² + x²/(2σq²) + linear), integrable iff 1/σp² > 1/(2σq²), i.e. 2σq² > σp²: the paper's
    "σq² > σp²/2". The means do not matter; at equality the integrand is exp(linear) and diverges.
    """
    if not (sigma_q > 0 and sigma_p > 0):
        raise ValueError(f"sigmas must be > 0, got sigma_q={sigma_q}, sigma_p={sigma_p}")
    return 2.0 * sigma_q**2 > sigma_p**2


def gaussian_estimator_moments(mu_q: float, sigma_q: float, mu_p: float, sigma_p: float) -> dict[str, Any]:
    r"""Exact mean and per-sample variance of k1, k2, k3 under x ~ q (Gaussians).

    With Y = log r = c0 + a z² + b z: E[Y] = c0 + a = -KL(q‖p), Var[Y] = 2a² + b². k1 = -Y and k2 = Y²/2 are
    polynomials in z, so their moments are exact by Gauss-Hermite quadrature (40 nodes, exact to degree 79).
    k3 = r - 1 - Y: E[k3] = E[r] - 1 + KL(q‖p) = KL(q‖p) and, using E_q[r Y] = E_p[log(p/q)] = KL(p‖q),
    Var[k3] = (E[r²] - 1) - 2 (KL(p‖q) + KL(q‖p)) + 2a² + b², which is ∞ iff E[r²] = ∞.
    """
    c0, a, b = _log_ratio_quadratic(mu_q, sigma_q, mu_p, sigma_p)
    kl_qp = gaussian_kl(mu_q, sigma_q, mu_p, sigma_p)
    kl_pq = gaussian_kl(mu_p, sigma_p, mu_q, sigma_q)
    z, w = np.polynomial.hermite_e.hermegauss(40)
    w = w / w.sum()  # probabilists' Hermite: weights of N(0, 1)
    y = c0 + a * z * z + b * z
    moments: dict[str, Any] = {}
    for name, k in (("k1", -y), ("k2", 0.5 * y * y)):
        m = float(w @ k)
        moments[name] = {"mean": m, "var": float(w @ (k - m) ** 2)}
    m2 = gaussian_ratio_moment(2.0, mu_q, sigma_q, mu_p, sigma_p)
    # E[k3²] = E[(r-1)²] - 2E[(r-1)Y] + E[Y²] with E[r] = 1, E[rY] = E_p[Y] = KL(p‖q), E[Y] = -KL(q‖p)
    e_k3_sq = (m2 - 1.0) - 2.0 * (kl_pq + kl_qp) + (2 * a * a + b * b + kl_qp**2)
    var_k3 = math.inf if math.isinf(m2) else e_k3_sq - kl_qp**2
    moments["k3"] = {"mean": kl_qp, "var": var_k3}
    for v in moments.values():
        v["std"] = math.sqrt(v["var"]) if math.isfinite(v["var"]) else math.inf
    return {
        "kl_qp": kl_qp,
        "kl_pq": kl_pq,
        "E_r": gaussian_ratio_moment(1.0, mu_q, sigma_q, mu_p, sigma_p),
        "E_r2": m2,
        "estimators": moments,
    }


# ----------------------------------------------------------------------------------------------------------
# sampling through the library


def sample_gaussian_estimators(
    mu_q: float,
    sigma_q: float,
    mu_p: float,
    sigma_p: float,
    n: int,
    seed: int,
    kinds: tuple[str, ...] = ESTIMATORS,
    chunk: int = 100_000,
) -> dict[str, torch.Tensor]:
    """Draw x ~ q = N(μq, σq²) (float64) and return ``kl_estimate``'s estimators and the ratio r = p/q.

    Returns a dict of (n,) float64 tensors: one per name in ``kinds`` plus ``log_r`` and ``r``. Work is done
    in chunks of ``chunk`` samples (cache-friendly; the result does not depend on ``chunk``).
    """
    g = torch.Generator().manual_seed(int(seed))
    x = mu_q + sigma_q * torch.randn(n, generator=g, dtype=torch.float64)  # (n,)
    f64 = torch.float64
    q = Normal(torch.tensor(mu_q, dtype=f64), torch.tensor(sigma_q, dtype=f64), validate_args=False)
    p = Normal(torch.tensor(mu_p, dtype=f64), torch.tensor(sigma_p, dtype=f64), validate_args=False)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (*kinds, "log_r")}
    for xc in x.split(chunk):
        logp, ref_logp = q.log_prob(xc), p.log_prob(xc)  # (c,), (c,): klgrad's logp is the sampler's density
        for k in kinds:
            parts[k].append(kl_estimate(logp, ref_logp, k))  # (c,)
        parts["log_r"].append(ref_logp - logp)  # (c,)
    out = {k: torch.cat(v) for k, v in parts.items()}  # (n,) each
    out["r"] = torch.exp(out["log_r"])  # (n,)
    return out


def _seed(seed: int, *parts: int) -> int:
    """A distinct, reproducible 62-bit seed per (seed, parts) (a polynomial hash, cheap and stable)."""
    h = 1469598103934665603
    for v in (seed, *parts):
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 62)
    return h


@contextmanager
def _torch_threads(n: int):
    """Run a block with ``torch.set_num_threads(n)``, restoring the previous value afterwards.

    Elementwise float64 work on 1e5-sized chunks is memory-bound; on small shared machines extra intra-op
    threads only add contention (measured 45 ns/sample on 1 thread vs ~3 µs/sample on 2 busy cores).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------------------
# experiment 1: Gaussian k1/k2/k3 and the variance threshold


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
    with _torch_threads(1):
        return _run_k3_gaussian(
            out_dir, n_samples, n_runs, seed, sigmas, sweep_ns, sweep_repeats, sweep_mu_q, paper_n_samples
        )


def _run_k3_gaussian(
    out_dir: str | Path,
    n_samples: int,
    n_runs: int,
    seed: int,
    sigmas: tuple[float, ...],
    sweep_ns: tuple[int, ...],
    sweep_repeats: int,
    sweep_mu_q: float,
    paper_n_samples: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mu_q, sigma_q, mu_p, sigma_p = PAPER_MU_Q, PAPER_SIGMA_Q, PAPER_MU_P, PAPER_SIGMA_P

    # --- ground truth
    theory = gaussian_estimator_moments(mu_q, sigma_q, mu_p, sigma_p)
    q_dist, p_dist = Normal(mu_q, sigma_q), Normal(mu_p, sigma_p)
    truth = {
        "kl_q_p_closed_form": theory["kl_qp"],
        "kl_q_p_torch": float(kl_divergence(q_dist, p_dist)),
        "kl_p_q_closed_form": theory["kl_pq"],
        "paper_true_kl": PAPER_TRUE_KL,
        "paper_matches": abs(theory["kl_qp"] - PAPER_TRUE_KL) < 5e-5,
        "paper_direction": "KL(q||p), q = N(0.1, 0.2^2) the sampler, p = N(0, 1)"
        if abs(theory["kl_qp"] - PAPER_TRUE_KL) < 5e-5
        else "neither direction matches",
        "expected": {k: theory["estimators"][k]["mean"] for k in ESTIMATORS},
        "per_sample_std": {k: theory["estimators"][k]["std"] for k in ESTIMATORS},
        "E_q_r": theory["E_r"],
        "E_q_r2": theory["E_r2"],
        "var_k3_finite": k3_variance_is_finite(sigma_q, sigma_p),
    }

    # --- part A: many runs
    means = {k: np.empty(n_runs) for k in ESTIMATORS}
    stds = {k: np.empty(n_runs) for k in ESTIMATORS}
    n_over_cap = 0
    for i in range(n_runs):
        s = sample_gaussian_estimators(mu_q, sigma_q, mu_p, sigma_p, n_samples, _seed(seed, 1, i))
        n_over_cap += int((s["log_r"] > EXP_CAP).sum())
        for k in ESTIMATORS:
            means[k][i] = float(s[k].mean())
            stds[k][i] = float(s[k].std())  # unbiased, like the paper's ``k.std()``
    kl = theory["kl_qp"]
    summary: dict[str, Any] = {}
    for k in ESTIMATORS:
        m, sd = means[k], stds[k]
        se = float(m.std(ddof=1) / math.sqrt(n_runs)) if n_runs > 1 else math.nan
        summary[k] = {
            "mean_of_batch_means": float(m.mean()),
            "std_of_batch_means": float(m.std(ddof=1)) if n_runs > 1 else math.nan,
            "se_of_mean": se,
            "z_vs_expected": (float(m.mean()) - truth["expected"][k]) / se if se > 0 else math.nan,
            "median_batch_mean": float(np.median(m)),
            "min_batch_mean": float(m.min()),
            "max_batch_mean": float(m.max()),
            "frac_runs_below_kl": float((m < kl).mean()),
            "per_sample_std_median": float(np.median(sd)),
            "per_sample_std_min": float(sd.min()),
            "per_sample_std_max": float(sd.max()),
        }
    four_runs = []
    for i in range(4):
        s = sample_gaussian_estimators(mu_q, sigma_q, mu_p, sigma_p, paper_n_samples, _seed(seed, 2, i))
        four_runs.append({k: {"mean": float(s[k].mean()), "std": float(s[k].std())} for k in ESTIMATORS})

    # --- part B: variance of k3 vs n per sigma_q
    sweep: list[dict[str, Any]] = []
    for j, sq in enumerate(sigmas):
        th = gaussian_estimator_moments(sweep_mu_q, sq, mu_p, sigma_p)
        var_by_n = []
        for ni, n in enumerate(sweep_ns):
            reps = []
            for rep in range(sweep_repeats):
                sd = _seed(seed, 3, j, ni, rep)
                k3 = sample_gaussian_estimators(sweep_mu_q, sq, mu_p, sigma_p, n, sd, kinds=("k3",))["k3"]
                reps.append(float(k3.var()))
            var_by_n.append({"n": n, "sample_vars": reps, "median": float(np.median(reps))})
        meds = [v["median"] for v in var_by_n]
        var_th = th["estimators"]["k3"]["var"]
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

    threshold = sigma_p / math.sqrt(2.0)
    result: dict[str, Any] = {
        "experiment": "k3_gaussian",
        "paper_section": "Appendix I: On the Statistical Instability of the k3 Value Estimator",
        "setup": {
            "q_sampler": {"mu": mu_q, "sigma": sigma_q},
            "p_reference": {"mu": mu_p, "sigma": sigma_p},
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
            "sigma_q_threshold": threshold,
            "sweep_mu_q": sweep_mu_q,
            "sweep_ns": list(sweep_ns),
            "sweep_repeats": sweep_repeats,
            "sweep": sweep,
        },
        "files": ["k3_gaussian.json", "k3_gaussian.png", "verdict.md"],
    }
    result["seconds"] = time.perf_counter() - t0
    result = _jsonable(result)
    _plot_k3_gaussian(out / "k3_gaussian.png", result, means)
    _write_json(out / "k3_gaussian.json", result)
    (out / "verdict.md").write_text(_verdict_k3_gaussian(result))
    return result


def _plot_k3_gaussian(path: Path, res: dict[str, Any], means: dict[str, np.ndarray]) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.4))
    truth, summ = res["truth"], res["runs_summary"]
    kl = truth["kl_q_p_closed_form"]

    # (a) estimator means
    ax = axes[0]
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

    # (b) sample variance of k3 vs n
    ax = axes[1]
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

    # (c) variance at the largest n vs sigma_q, with the threshold
    ax = axes[2]
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

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdict_k3_gaussian(res: dict[str, Any]) -> str:
    t, s, vc = res["truth"], res["runs_summary"], res["variance_condition"]
    st = res["setup"]
    kl = t["kl_q_p_closed_form"]
    lines = [
        "# k3 value estimator on Gaussians (paper appendix I)",
        "",
        f"Setup: x ~ q = N({st['q_sampler']['mu']}, {st['q_sampler']['sigma']}²), p = N({st['p_reference']['mu']}, "
        f"{st['p_reference']['sigma']}²), r = p(x)/q(x); estimates from `klgrad.kl.kl_estimate` (float64), "
        f"{st['n_runs']} runs × {st['n_samples']:,} samples, seed {st['seed']}.",
        "",
        "## True KL",
        f"- closed form KL(q‖p) = {kl:.6f} (torch.distributions: {t['kl_q_p_torch']:.6f}); "
        f"the reverse KL(p‖q) = {t['kl_p_q_closed_form']:.4f}.",
        f"- paper: true KL = {PAPER_TRUE_KL}. "
        + (
            "Matches KL(q‖p) with q the sampler (the direction the estimators target)."
            if t["paper_matches"]
            else "Does NOT match either direction."
        ),
        f"- closed-form expectations: E[k1] = E[k3] = {t['expected']['k1']:.4f}, "
        f"E[k2] = {t['expected']['k2']:.4f} (k2 biased {'low' if t['expected']['k2'] < kl else 'high'}); "
        f"E_q[r] = {t['E_q_r']:.6f}; E_q[r²] = {_fmt(t['E_q_r2'])}.",
        "",
        f"## Estimators over {st['n_runs']} runs of {st['n_samples']:,}",
        "| est. | theory mean | mean of batch means | std across runs | z vs theory | median batch mean "
        "| runs below KL | per-sample std (median, min–max) | theory per-sample std |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in ESTIMATORS:
        r = s[k]
        lines.append(
            f"| {k} | {t['expected'][k]:.4f} | {r['mean_of_batch_means']:.4f} | {_fmt(r['std_of_batch_means'])} "
            f"| {r['z_vs_expected']:+.2f} | {r['median_batch_mean']:.4f} | {100 * r['frac_runs_below_kl']:.0f}% "
            f"| {_fmt(r['per_sample_std_median'])} ({_fmt(r['per_sample_std_min'])}–{_fmt(r['per_sample_std_max'])}) "
            f"| {_fmt(t['per_sample_std'][k])} |"
        )
    lines += [
        "",
        f"(k3's z-score and std across runs are not a valid error bar: Var[k3] = ∞ here, "
        f"{st['samples_with_log_r_over_EXP_CAP']} sample(s) had log r above kl_estimate's EXP_CAP.)",
        "",
        f"## Four runs of {st['paper_n_samples']:,} samples (the paper's listing size): ours vs paper",
        "| run | k1 mean / std | k2 mean / std | k3 mean / std | paper: k1 | paper: k2 | paper: k3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (o, p) in enumerate(zip(res["four_runs"], res["paper_four_runs"], strict=True)):
        ours = " | ".join(f"{o[k]['mean']:.4f} / {o[k]['std']:.4f}" for k in ESTIMATORS)
        pap = " | ".join(f"{p[k]['mean']:.4f} / {p[k]['std']:.4f}" for k in ESTIMATORS)
        lines.append(f"| {i + 1} | {ours} | {pap} |")
    k3o = [o["k3"]["std"] for o in res["four_runs"]]
    k1o = [o["k1"]["std"] for o in res["four_runs"]]
    lines += [
        "",
        f"Ours: k3 per-sample std {min(k3o):.2f}–{max(k3o):.2f} vs k1 {min(k1o):.2f}–{max(k1o):.2f}; "
        f"paper: k3 {min(p['k3']['std'] for p in PAPER_RUNS):.2f}–{max(p['k3']['std'] for p in PAPER_RUNS):.2f}, "
        f"k1 {min(p['k1']['std'] for p in PAPER_RUNS):.2f}–{max(p['k1']['std'] for p in PAPER_RUNS):.2f}.",
        "",
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
    inf_rows = [r for r in vc["sweep"] if not r["finite_theory"]]
    fin_rows = [r for r in vc["sweep"] if r["finite_theory"]]
    lines.append("")
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
    k3, k1 = s["k3"], s["k1"]
    lines += [
        "",
        "## Verdict",
        f"- Reproduced: the true KL is {kl:.4f} (paper: {PAPER_TRUE_KL}); k1 is unbiased "
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
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# experiment 2: uniform supports, the unbiasedness precondition


def run_k3_uniform_bias(
    out_dir: str | Path, *, n_samples: int = 1_000_000, n_runs: int = 50, seed: int = 0
) -> dict[str, Any]:
    r"""Reproduce appendix I's uniform example: q = U[0, 1] samples, p = U[0, 2].

    r = p/q = ½ on [0, 1], so KL(q‖p) = log 2 and k1 ≡ log 2 (unbiased), k3 ≡ ½ - 1 + log 2 = log 2 - ½
    (biased by E_q[r] - 1 = -½, because supp(p) = [0, 2] ⊄ supp(q) = [0, 1]). Estimates from
    ``kl_estimate`` on float64 samples; ``n_runs`` runs of ``n_samples``.

    Writes ``k3_uniform_bias.json``, ``k3_uniform_bias.png`` and ``verdict.md``; returns the JSON dict.
    """
    with _torch_threads(1):
        return _run_k3_uniform_bias(out_dir, n_samples, n_runs, seed)


def _run_k3_uniform_bias(out_dir: str | Path, n_samples: int, n_runs: int, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    f64 = torch.float64
    q = Uniform(torch.tensor(0.0, dtype=f64), torch.tensor(1.0, dtype=f64), validate_args=False)
    p = Uniform(torch.tensor(0.0, dtype=f64), torch.tensor(2.0, dtype=f64), validate_args=False)
    means = {k: np.empty(n_runs) for k in (*ESTIMATORS, "r")}
    spreads = {k: 0.0 for k in ESTIMATORS}
    for i in range(n_runs):
        g = torch.Generator().manual_seed(_seed(seed, 4, i))
        x = torch.rand(n_samples, generator=g, dtype=f64)  # (n,) ~ U[0, 1)
        logp, ref_logp = q.log_prob(x), p.log_prob(x)  # (n,), (n,)
        for k in ESTIMATORS:
            e = kl_estimate(logp, ref_logp, k)  # (n,)
            means[k][i] = float(e.mean())
            spreads[k] = max(spreads[k], float(e.max() - e.min()))
        means["r"][i] = float(torch.exp(ref_logp - logp).mean())
    kl = math.log(2.0)
    theory = {"k1": kl, "k2": 0.5 * kl * kl, "k3": kl - 0.5, "E_q_r": 0.5}
    measured = {k: float(means[k].mean()) for k in ESTIMATORS}
    result: dict[str, Any] = {
        "experiment": "k3_uniform_bias",
        "paper_section": "Appendix I.1: The Strict Precondition for Unbiasedness",
        "setup": {
            "q_sampler": "U[0, 1]",
            "p_reference": "U[0, 2]",
            "n_samples": n_samples,
            "n_runs": n_runs,
            "seed": seed,
            "estimators": "klgrad.kl.kl_estimate(log q(x), log p(x), kind), float64",
        },
        "true_kl": kl,
        "theory": theory,
        "measured_mean": measured,
        "measured_E_q_r": float(means["r"].mean()),
        "max_within_run_range": spreads,
        "max_abs_dev_across_runs": {k: float(np.abs(means[k] - theory[k]).max()) for k in ESTIMATORS},
        "bias": {k: measured[k] - kl for k in ESTIMATORS},
        "identity_check": {
            "E_k3_equals_E_r_minus_1_plus_KL": measured["k3"] - (float(means["r"].mean()) - 1.0 + kl),
        },
        "paper": {"KL": "log 2", "E_q_r": 0.5, "E_k3": "log 2 - 0.5"},
        "files": ["k3_uniform_bias.json", "k3_uniform_bias.png", "verdict.md"],
    }
    result["seconds"] = time.perf_counter() - t0
    result = _jsonable(result)

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    xs = np.arange(3)
    bars = ax.bar(xs, [measured[k] for k in ESTIMATORS], color=["tab:blue", "tab:purple", "tab:orange"], width=0.6)
    for b, k in zip(bars, ESTIMATORS, strict=True):
        ax.text(
            b.get_x() + b.get_width() / 2,
            b.get_height() + 0.01,
            f"{measured[k]:.4f}",
            ha="center",
            fontsize=9,
        )
    ax.axhline(kl, color="tab:green", lw=1.5, label=f"true KL(q‖p) = log 2 = {kl:.4f}")
    ax.axhline(kl - 0.5, color="tab:red", ls=":", lw=1.2, label=f"log 2 − ½ = {kl - 0.5:.4f} (paper's E[k3])")
    ax.set_xticks(xs, ESTIMATORS)
    ax.set_ylim(0, kl * 1.25)
    ax.set_ylabel(f"mean over {n_runs} runs × {n_samples:,}")
    ax.set_title(f"q = U[0,1] samples, p = U[0,2]: E_q[r] = {result['measured_E_q_r']:.4f} ≠ 1")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "k3_uniform_bias.png", dpi=110)
    plt.close(fig)

    _write_json(out / "k3_uniform_bias.json", result)
    lines = [
        "# k3 is biased when supp(p) ⊄ supp(q) (paper appendix I.1)",
        "",
        f"Setup: x ~ q = U[0, 1], p = U[0, 2], r = p/q; `klgrad.kl.kl_estimate` on float64 samples, "
        f"{n_runs} runs × {n_samples:,}.",
        "",
        "| quantity | measured | theory | paper |",
        "|---|---|---|---|",
        f"| E[k1] | {measured['k1']:.10f} | log 2 = {kl:.10f} | D_KL = log 2 |",
        f"| E[k2] | {measured['k2']:.10f} | ½(log 2)² = {theory['k2']:.10f} | — |",
        f"| E[k3] | {measured['k3']:.10f} | log 2 − ½ = {kl - 0.5:.10f} | log 2 − 0.5 |",
        f"| E_q[r] | {result['measured_E_q_r']:.10f} | ½ | 0.5 |",
        "",
        "- Every estimator is constant on supp(q) (largest within-run range: "
        + ", ".join(f"{k} {_fmt(spreads[k], 2)}" for k in ESTIMATORS)
        + "), so the means are exact, not statistical.",
        f"- k3 bias = {result['bias']['k3']:+.6f} = E_q[r] − 1, confirming E[k3] = (E_q[r] − 1) + KL "
        f"(identity residual {_fmt(result['identity_check']['E_k3_equals_E_r_minus_1_plus_KL'], 2)}).",
        "",
        "## Verdict",
        f"Reproduced: KL(q‖p) is finite (log 2 = {kl:.4f}) yet E[k3] = {measured['k3']:.4f} (paper: log 2 − 0.5); "
        f"k1 = {measured['k1']:.4f} is unbiased. The precondition E_q[r] = 1 fails (measured "
        f"{result['measured_E_q_r']:.4f}, paper: 0.5) because p puts mass on (1, 2] where q never samples.",
        "",
    ]
    (out / "verdict.md").write_text("\n".join(lines))
    return result
