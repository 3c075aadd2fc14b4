"""`klgrad reproduce k3-uniform-bias` (klgrad.reproduce.k3_uniform_bias), run small."""

from __future__ import annotations

import json
import math

import pytest

from klgrad.reproduce.k3_uniform_bias import run_k3_uniform_bias, verdict_k3_uniform_bias
from klgrad.reproduce.uniform_theory import uniform_estimator_values
from tests.helpers.png_check import assert_drawn, figure_pixels

pytestmark = pytest.mark.numerics
LOG2 = math.log(2.0)


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
    assert res["theory"] == uniform_estimator_values(1.0, 2.0)
    assert json.loads((tmp_path / "k3_uniform_bias.json").read_text()) == res
    verdict = (tmp_path / "verdict.md").read_text()
    assert verdict == verdict_k3_uniform_bias(res)
    assert f"| E[k3] | {m['k3']:.10f} | log 2 − ½ = 0.1931471806 | log 2 − 0.5 |" in verdict
    assert f"| E[k1] | {m['k1']:.10f} | log 2 = 0.6931471806 | D_KL = log 2 |" in verdict
    assert "k3 bias = -0.500000 = E_q[r] − 1" in verdict
    assert_drawn(tmp_path / "k3_uniform_bias.png", figure_pixels((6.4, 4.4), 110))


def test_verdict_follows_its_inputs(tmp_path):
    res = run_k3_uniform_bias(tmp_path, n_samples=10, n_runs=1, seed=0)
    res["measured_mean"]["k3"] = 0.25
    res["max_within_run_range"]["k2"] = 3e-5
    v = verdict_k3_uniform_bias(res)
    assert "yet E[k3] = 0.2500 (paper: log 2 − 0.5)" in v
    assert "k2 3.0e-05" in v  # fmt_num with 2 decimals: scientific below 1e-3
