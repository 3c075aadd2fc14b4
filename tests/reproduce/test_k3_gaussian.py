"""`klgrad reproduce k3-gaussian` (klgrad.reproduce.k3_gaussian and its report), run small.

The numbers are checked against the closed forms (4 standard errors where a sample mean is compared), the
files against the returned result, the verdict against numbers fed in, the figure for its size and ink.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from klgrad.reproduce.gaussian_theory import gaussian_estimator_moments, gaussian_kl
from klgrad.reproduce.k3_gaussian import PAPER_RUNS, run_k3_gaussian
from klgrad.reproduce.k3_gaussian_report import verdict_k3_gaussian
from tests.helpers.png_check import assert_drawn, figure_pixels

pytestmark = pytest.mark.numerics


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
    assert json.loads((out / "k3_gaussian.json").read_text()) == json.loads(json.dumps(res))
    assert (out / "verdict.md").read_text() == verdict_k3_gaussian(res)
    assert_drawn(out / "k3_gaussian.png", figure_pixels((17, 6.4), 110))


def test_sweep_theory_is_the_closed_form(k3_gauss):
    _, res = k3_gauss
    for row in res["variance_condition"]["sweep"]:
        var = gaussian_estimator_moments(0.1, row["sigma_q"], 0.0, 1.0)["estimators"]["k3"]["var"]
        assert row["var_k3_theory"] == (var if math.isfinite(var) else "inf")
        assert row["two_sigma_q2_minus_sigma_p2"] == pytest.approx(2 * row["sigma_q"] ** 2 - 1.0, abs=1e-15)
    assert res["variance_condition"]["sigma_q_threshold"] == pytest.approx(1 / math.sqrt(2), abs=1e-16)


def test_verdict_quotes_the_result_and_the_paper(k3_gauss):
    _, res = k3_gauss
    v = verdict_k3_gaussian(res)
    kl = res["truth"]["kl_q_p_closed_form"]
    assert f"closed form KL(q‖p) = {kl:.6f}" in v
    assert "paper: true KL = 1.1344. Matches KL(q‖p)" in v
    assert "E_q[r²] = ∞." in v  # the JSON's "inf", printed
    assert f"{res['runs_summary']['k1']['mean_of_batch_means']:.4f}" in v
    for run in PAPER_RUNS:  # the paper's four printed runs, quoted
        assert f"{run['k3']['mean']:.4f} / {run['k3']['std']:.4f}" in v
    assert "| 0.3 | -0.820 | ∞ |" in v  # σq = 0.3: 2σq² - σp² = -0.82, Var[k3] = ∞
    assert v.count("\n## ") == 5


def test_verdict_follows_its_inputs(k3_gauss):
    _, res = k3_gauss
    res = copy.deepcopy(res)
    res["truth"]["paper_matches"] = False
    res["truth"]["expected"]["k2"] = res["truth"]["kl_q_p_closed_form"] + 0.5
    v = verdict_k3_gaussian(res)
    assert "Does NOT match either direction." in v
    assert "(k2 biased high)" in v
    res["variance_condition"]["sweep"] = [r for r in res["variance_condition"]["sweep"] if r["finite_theory"]]
    v = verdict_k3_gaussian(res)
    assert "infinite-variance side" not in v
    assert "finite-variance side" in v
