"""The paper's appendix I (k3 value estimator) and J (group normalisation) reproductions.

Closed forms are checked by hand-worked values and by quadrature; the experiment functions are run small and
their numbers checked against those closed forms; the files they write are checked for content.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import integrate

from klgrad.experiments.estimators import (
    PAPER_TRUE_KL,
    gaussian_estimator_moments,
    gaussian_kl,
    gaussian_ratio_moment,
    k3_variance_is_finite,
    run_k3_gaussian,
    run_k3_uniform_bias,
    sample_gaussian_estimators,
)
from klgrad.experiments.group_norm import PAPER_REWARDS, grpo_advantages, run_group_norm_amplification

pytestmark = pytest.mark.numerics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOG2 = math.log(2.0)


def _normal_pdf(x: float, mu: float, sigma: float) -> float:
    return math.exp(-0.5 * ((x - mu) / sigma) ** 2) / (sigma * math.sqrt(2.0 * math.pi))


def _check_files(out, names: list[str], result: dict, must_mention: list[str]) -> str:
    for name in names:
        assert (out / name).is_file(), name
    png = next(n for n in names if n.endswith(".png"))
    assert (out / png).read_bytes()[:8] == PNG_MAGIC
    js = next(n for n in names if n.endswith(".json"))
    assert json.loads((out / js).read_text()) == json.loads(json.dumps(result))
    verdict = (out / "verdict.md").read_text()
    for s in must_mention:
        assert s in verdict, s
    return verdict


# ----------------------------------------------------------------------------------------------------------
# Gaussian closed forms


def test_gaussian_kl_is_the_papers_true_kl_in_the_q_to_p_direction():
    # KL(q||p), q = N(0.1, 0.2^2) the sampler, p = N(0, 1): log(1/0.2) + (0.04 + 0.01)/2 - 1/2 = log 5 - 0.475
    kl = gaussian_kl(0.1, 0.2, 0.0, 1.0)
    assert kl == pytest.approx(math.log(5.0) - 0.475, abs=1e-15)
    assert abs(kl - PAPER_TRUE_KL) < 1e-4  # paper: "True KL Divergence: 1.1344"
    q, p = torch.distributions.Normal(0.1, 0.2), torch.distributions.Normal(0.0, 1.0)
    assert kl == pytest.approx(float(torch.distributions.kl_divergence(q, p)), rel=1e-6)
    # the other direction is not what the paper means: KL(p||q) = log 0.2 + (1 + 0.01)/0.08 - 1/2
    assert gaussian_kl(0.0, 1.0, 0.1, 0.2) == pytest.approx(math.log(0.2) + 1.01 / 0.08 - 0.5, abs=1e-12)
    assert abs(gaussian_kl(0.0, 1.0, 0.1, 0.2) - PAPER_TRUE_KL) > 9.0


def test_estimator_moments_hand_worked():
    # log r = c0 + a z^2 + b z with a = 1/2 - 0.04/2 = 0.48, b = -0.1*0.2 = -0.02:
    # Var[log r] = 2a^2 + b^2 = 0.4612, E[k2] = (Var + KL^2)/2, E[k1] = E[k3] = KL.
    m = gaussian_estimator_moments(0.1, 0.2, 0.0, 1.0)
    kl = gaussian_kl(0.1, 0.2, 0.0, 1.0)
    e = m["estimators"]
    assert e["k1"]["mean"] == pytest.approx(kl, abs=1e-12)
    assert e["k1"]["var"] == pytest.approx(0.4612, abs=1e-12)
    assert e["k2"]["mean"] == pytest.approx(0.5 * (0.4612 + kl * kl), abs=1e-12)
    assert e["k2"]["mean"] < kl  # k2 is biased low here
    assert e["k3"]["mean"] == pytest.approx(kl, abs=1e-15)
    assert e["k3"]["var"] == math.inf
    assert m["E_r2"] == math.inf
    assert m["E_r"] == pytest.approx(1.0, abs=1e-12)


def _log_normal_pdf(x: float, mu: float, sigma: float) -> float:
    return -0.5 * ((x - mu) / sigma) ** 2 - math.log(sigma * math.sqrt(2.0 * math.pi))


@pytest.mark.parametrize(("mu_q", "sigma_q"), [(0.1, 0.8), (0.1, 1.2), (-0.5, 2.0), (0.3, 0.72)])
def test_ratio_moments_and_k3_variance_against_quadrature(mu_q, sigma_q):
    mu_p, sigma_p = 0.0, 1.0
    lq = lambda x: _log_normal_pdf(x, mu_q, sigma_q)  # noqa: E731
    lp = lambda x: _log_normal_pdf(x, mu_p, sigma_p)  # noqa: E731
    quad = lambda f: integrate.quad(f, -math.inf, math.inf, epsabs=0.0, epsrel=1e-11, limit=500)[0]  # noqa: E731
    e_r = quad(lambda x: math.exp(lp(x)))
    e_r2 = quad(lambda x: math.exp(2 * lp(x) - lq(x)))  # ∫ p^2/q
    assert gaussian_ratio_moment(1.0, mu_q, sigma_q, mu_p, sigma_p) == pytest.approx(e_r, rel=1e-9)
    assert gaussian_ratio_moment(2.0, mu_q, sigma_q, mu_p, sigma_p) == pytest.approx(e_r2, rel=1e-8)
    kl = gaussian_kl(mu_q, sigma_q, mu_p, sigma_p)

    def k3_dev_sq(x: float) -> float:  # (k3 - KL)^2 q with k3 = r - 1 - log r, in log space where r is huge
        log_r = lp(x) - lq(x)
        if log_r < 30.0:
            return (math.exp(log_r) - 1.0 - log_r - kl) ** 2 * math.exp(lq(x))
        log_dev = log_r + math.log1p(-(1.0 + log_r + kl) * math.exp(-log_r))  # log(r - 1 - log r - KL)
        return math.exp(2.0 * log_dev + lq(x))

    var = quad(k3_dev_sq)
    moments = gaussian_estimator_moments(mu_q, sigma_q, mu_p, sigma_p)["estimators"]
    assert moments["k3"]["var"] == pytest.approx(var, rel=1e-7)
    assert moments["k1"]["var"] == pytest.approx(quad(lambda x: (lq(x) - lp(x) - kl) ** 2 * math.exp(lq(x))), rel=1e-9)


@pytest.mark.parametrize("sigma_q", [0.2, 0.6, 0.7, 0.7071])
def test_ratio_second_moment_diverges_below_threshold(sigma_q):
    # p^2/q = e^{c x^2 + linear} up to a constant, c = 1/(2 sigma_q^2) - 1 > 0 when 2 sigma_q^2 < sigma_p^2:
    # ∫_{-L}^{L} p^2/q grows without bound. L is chosen so that c L^2 = 30.
    c = 1.0 / (2 * sigma_q**2) - 1.0
    L = math.sqrt(30.0 / c)

    def partial(a: float) -> float:
        f = lambda x: math.exp(2 * _log_normal_pdf(x, 0.0, 1.0) - _log_normal_pdf(x, 0.1, sigma_q))  # noqa: E731
        return integrate.quad(f, -a, a, points=[0.0], limit=500)[0]

    assert partial(L) > 1e6 * partial(L / 2)
    assert gaussian_ratio_moment(2.0, 0.1, sigma_q, 0.0, 1.0) == math.inf
    assert not k3_variance_is_finite(sigma_q, 1.0)


@pytest.mark.parametrize("sigma_p", [0.5, 1.0, 3.0])
def test_k3_variance_is_finite_on_both_sides_of_threshold(sigma_p):
    thr = sigma_p / math.sqrt(2.0)  # 2 sigma_q^2 = sigma_p^2
    for mu_q in (0.0, 0.1, -0.7):
        assert k3_variance_is_finite(thr * (1 + 1e-6), sigma_p)
        assert not k3_variance_is_finite(thr * (1 - 1e-6), sigma_p)
        for f in (0.1, 0.5, 0.99, 1.01, 2.0, 10.0):
            finite = math.isfinite(gaussian_ratio_moment(2.0, mu_q, thr * f, 0.0, sigma_p))
            assert k3_variance_is_finite(thr * f, sigma_p) == finite == (f > 1)
    assert not k3_variance_is_finite(0.2, 1.0)  # the paper's example: 0.04 < 0.5
    with pytest.raises(ValueError, match="sigmas must be > 0"):
        k3_variance_is_finite(0.0, 1.0)


# ----------------------------------------------------------------------------------------------------------
# sampling through kl_estimate


def test_kl_estimate_mapping_matches_paper_formulas():
    s = sample_gaussian_estimators(0.1, 0.2, 0.0, 1.0, 5_000, seed=3)
    r, log_r = s["r"], s["log_r"]
    torch.testing.assert_close(s["k1"], -log_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(s["k2"], 0.5 * log_r**2, rtol=0, atol=1e-12)
    torch.testing.assert_close(s["k3"], r - 1 - log_r, rtol=1e-12, atol=1e-12)
    # chunking does not change anything
    s2 = sample_gaussian_estimators(0.1, 0.2, 0.0, 1.0, 5_000, seed=3, chunk=777)
    for k in ("k1", "k2", "k3", "r"):
        assert torch.equal(s[k], s2[k])


def test_k3_unbiased_when_its_variance_is_finite():
    # sigma_q = 0.9: E_q[r^4] finite too (sigma_q^2 > 3/4 sigma_p^2), so the CLT standard error is valid.
    kl = gaussian_kl(0.1, 0.9, 0.0, 1.0)
    n = 200_000
    s = sample_gaussian_estimators(0.1, 0.9, 0.0, 1.0, n, seed=11)
    for k in ("k1", "k3"):
        se = float(s[k].std()) / math.sqrt(n)
        assert abs(float(s[k].mean()) - kl) < 4 * se, k
    assert abs(float(s["r"].mean()) - 1.0) < 4 * float(s["r"].std()) / math.sqrt(n)


@pytest.fixture(scope="module")
def k3_gauss(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3_gaussian")
    res = run_k3_gaussian(
        out,
        n_samples=20_000,
        n_runs=24,
        seed=0,
        sigmas=(0.3, 0.5, 1.2),
        sweep_ns=(1_000, 100_000),
        sweep_repeats=3,
        paper_n_samples=5_000,
    )
    return out, res


def test_run_k3_gaussian_numbers(k3_gauss):
    _, res = k3_gauss
    t, s = res["truth"], res["runs_summary"]
    kl = gaussian_kl(0.1, 0.2, 0.0, 1.0)
    assert t["kl_q_p_closed_form"] == pytest.approx(kl, abs=1e-15)
    assert t["paper_matches"] is True
    # k1: unbiased, z-score vs the closed form within 4 standard errors; per-sample std matches sqrt(0.4612)
    assert abs(s["k1"]["mean_of_batch_means"] - kl) < 4 * s["k1"]["se_of_mean"]
    assert s["k1"]["per_sample_std_median"] == pytest.approx(math.sqrt(0.4612), rel=0.03)
    # k2: biased low, on its own closed-form expectation
    ek2 = t["expected"]["k2"]
    assert abs(s["k2"]["mean_of_batch_means"] - ek2) < 4 * s["k2"]["se_of_mean"]
    assert s["k2"]["mean_of_batch_means"] < kl - 100 * s["k2"]["se_of_mean"]
    # k3: infinite variance: the typical batch mean is below the truth, and per-sample stds are erratic
    assert s["k3"]["median_batch_mean"] < kl
    assert s["k3"]["frac_runs_below_kl"] > 0.5
    assert s["k3"]["per_sample_std_max"] > 3 * s["k3"]["per_sample_std_min"]
    assert s["k3"]["per_sample_std_min"] > 2 * s["k1"]["per_sample_std_max"]
    assert len(res["four_runs"]) == 4
    # sweep: theory labels and the finite case on its closed form
    rows = {r["sigma_q"]: r for r in res["variance_condition"]["sweep"]}
    assert rows[0.3]["finite_theory"] is False
    assert rows[0.3]["var_k3_theory"] == "inf"
    assert rows[1.2]["finite_theory"] is True
    assert abs(rows[1.2]["rel_err_last_vs_theory"]) < 0.1
    assert rows[0.3]["growth_median_last_over_first"] > rows[1.2]["growth_median_last_over_first"]


def test_run_k3_gaussian_files(k3_gauss):
    out, res = k3_gauss
    v = _check_files(
        out, ["k3_gaussian.json", "k3_gaussian.png", "verdict.md"], res, ["1.1344", "0.8136", "26.7379", "σp²/2"]
    )
    assert f"{res['runs_summary']['k1']['mean_of_batch_means']:.4f}" in v


# ----------------------------------------------------------------------------------------------------------
# uniform supports


def test_run_k3_uniform_bias(tmp_path):
    res = run_k3_uniform_bias(tmp_path, n_samples=20_000, n_runs=3, seed=1)
    m = res["measured_mean"]
    # r = p/q = 1/2 on [0, 1]: k3 = 1/2 - 1 + log 2 exactly, k1 = log 2, E_q[r] = 1/2
    assert m["k3"] == pytest.approx(LOG2 - 0.5, abs=1e-9)
    assert m["k1"] == pytest.approx(LOG2, abs=1e-12)
    assert m["k2"] == pytest.approx(0.5 * LOG2**2, abs=1e-12)
    assert res["measured_E_q_r"] == pytest.approx(0.5, abs=1e-12)
    assert res["bias"]["k3"] == pytest.approx(-0.5, abs=1e-9)
    assert all(v < 1e-12 for v in res["max_within_run_range"].values())
    _check_files(tmp_path, res["files"], res, ["log 2 − 0.5", "0.1931", "0.6931", "paper: 0.5"])


# ----------------------------------------------------------------------------------------------------------
# group normalisation


def test_group_norm_paper_example():
    r = np.array(PAPER_REWARDS)
    adv = np.array(grpo_advantages(PAPER_REWARDS))
    # float64 (grpo_advantages): rewards 1 ± 1e-5 keep their spread to u/1e-5 ≈ 1e-11 relative, so A = ±√3/2
    # to ~1e-11; 1e-6 (and rel 1e-6 below) is far above that and far below any wrong normalisation
    np.testing.assert_allclose(adv, [-math.sqrt(3) / 2, math.sqrt(3) / 2] * 2, atol=1e-6)
    # std_min = 0.1 > std = 1.1547e-5: A = (r - mean)/0.1 exactly, i.e. ±1e-4
    adv01 = np.array(grpo_advantages(PAPER_REWARDS, std_min=0.1))
    np.testing.assert_allclose(adv01, (r - r.mean()) / 0.1, rtol=1e-12, atol=0)
    np.testing.assert_allclose(adv01, [-1e-4, 1e-4, -1e-4, 1e-4], rtol=1e-6)


def test_run_group_norm_amplification(tmp_path):
    spreads = (1e-8, 1e-5, 1e-3, 0.05, 0.5, 1.0)
    res = run_group_norm_amplification(tmp_path, std_mins=(None, 0.1), spreads=spreads)
    by = {s["std_min"]: s for s in res["sweep"]}
    assert all(abs(x["max_abs_adv"] - math.sqrt(3) / 2) < 1e-6 for x in by[None]["rows"])
    for x in by[0.1]["rows"]:
        d = x["spread"]
        expect = d / 0.1 if d < 0.1 * math.sqrt(3) / 2 else math.sqrt(3) / 2
        assert x["max_abs_adv"] == pytest.approx(expect, rel=1e-6)
    ex = {e["std_min"]: e for e in res["paper_example"]["by_std_min"]}
    assert ex[0.1]["max_abs"] == pytest.approx(1e-4, rel=1e-6)
    _check_files(tmp_path, res["files"], res, ["0.8660", "0.99999", "1e-08"])
