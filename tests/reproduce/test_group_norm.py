"""`klgrad reproduce group-norm`, first half (klgrad.reproduce.group_norm): GRPO's amplification, no training."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from klgrad.reproduce.group_norm import PAPER_REWARDS, grpo_advantages, run_group_norm_amplification
from tests.helpers.png_check import assert_drawn, figure_pixels

pytestmark = pytest.mark.numerics


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
    assert by[0.1]["crossover_spread"] == pytest.approx(0.1 * math.sqrt(3) / 2, rel=1e-15)
    assert json.loads((tmp_path / "group_norm.json").read_text()) == json.loads(json.dumps(res))
    verdict = (tmp_path / "verdict.md").read_text()
    assert "| 0.1 | -0.0001, +0.0001, -0.0001, +0.0001 |" in verdict  # the paper's rewards with std_min = 0.1
    assert "| none | 0.866025 | 0.866025 | — |" in verdict  # no floor: √3/2 at the smallest and largest spread
    assert "from 1e-08 to 1e+00" in verdict
    assert_drawn(tmp_path / "group_norm.png", figure_pixels((13, 5.4), 110))
