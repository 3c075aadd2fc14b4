"""`klgrad reproduce fixed-points` from the CLI: the written result holds the theory's closed forms, and the
figure and the verdict are drawn from it. (Closed forms: exact/test_optima.py; the descent reaching them:
test_tabular_descent.py; the checks and the report from known inputs: test_fixed_points_checks/_report.)"""

from __future__ import annotations

import json
import time

import pytest
import torch

from klgrad.audit.tabular import token_logps
from klgrad.cli import main
from klgrad.exact.optima import forward_kl_optimum, reverse_kl_optimum
from klgrad.reproduce.fixed_points import FixedPointConfig, build_problem
from klgrad.reproduce.fixed_points_report import verdict_markdown
from tests.helpers.png_check import assert_drawn, figure_pixels

EPS = torch.finfo(torch.float64).eps
CFG = FixedPointConfig()


@pytest.fixture(scope="module")
def cli_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixed-points")
    t0 = time.perf_counter()
    assert main(["reproduce", "fixed-points", "--out", str(out)]) == 0
    print(f"\nklgrad reproduce fixed-points: {time.perf_counter() - t0:.1f} s")  # the issue asks for < 60 s
    return out


@pytest.fixture(scope="module")
def cli_result(cli_out) -> dict:
    return json.loads((cli_out / "fixed_points.json").read_text())


def test_cli_json_shape_and_the_theory_checks(cli_result):
    regimes = cli_result["regimes"]
    assert set(regimes) == {"sharpening", "discovery"}
    for reg in regimes.values():
        n = len(reg["responses"])
        assert len(reg["reference_prob"]) == len(reg["reward"]) == n
        assert reg["beta"] == CFG.beta
        assert set(reg["reward"]) == {0.0, 1.0}
        for key, m in reg["methods"].items():
            assert {"final_prob", "kl_to_optimum", "kl_to_reference", "steps"} <= set(m), key
            assert len(m["final_prob"]) == n
            # each π(y) carries (T + 2) roundings of relative size ε, the sum N more: (T + 2 + N) ε ≈ 8e-15
            assert abs(sum(m["final_prob"]) - 1.0) <= (CFG.length + 2 + n) * EPS
        # k1_as_loss (zero expected gradient) ends where none ends, after the same number of steps
        for key in ("k1_as_loss/sequence", "k1_as_loss/token"):
            assert reg["methods"][key]["steps"] == reg["methods"]["none/sequence"]["steps"]
            pairs = zip(reg["methods"][key]["final_prob"], reg["methods"]["none/sequence"]["final_prob"], strict=True)
            # the step-by-step bound of test_k1_as_loss_follows_none_step_by_step, η β N T ε per step, over
            # ≤ 30 steps: 30 · 0.5 · 31 · 4 · 2.2e-16 ≈ 4e-13
            assert max(abs(a - b) for a, b in pairs) <= 30 * CFG.step_size * CFG.beta * n * CFG.length * EPS
        # the head × level grid: none once, every other head at all three levels (token: decoupled form)
        assert len(reg["methods"]) == 1 + 6 * 3
        assert reg["methods"]["k1_in_reward/token"]["form"] == "decoupled"
        assert reg["methods"]["k1_in_reward/sequence"]["form"] == "combined"
    assert all(c["ok"] for c in cli_result["checks"]), [c for c in cli_result["checks"] if not c["ok"]]
    sharp, disc = regimes["sharpening"], regimes["discovery"]
    assert 0.6 <= sharp["rewarded_reference_mass"] <= 0.8
    assert 0.01 <= disc["rewarded_reference_mass"] <= 0.05
    # the regime map: forward KL (k3) ends closer to the reference when RL sharpens, reverse KL (k2) in discovery
    assert sharp["forward_kl_optimum"]["kl_to_reference"] < sharp["reverse_kl_optimum"]["kl_to_reference"]
    assert disc["forward_kl_optimum"]["kl_to_reference"] > disc["reverse_kl_optimum"]["kl_to_reference"]
    assert sharp["closer_to_reference"]["sequence"]["closer"] == "k3_as_loss"
    assert disc["closer_to_reference"]["sequence"]["closer"] == "k2_as_loss"


def test_cli_optima_are_the_closed_forms_of_the_cli_problem(cli_result):
    space, ref_logits, rewards = build_problem(CFG)
    ref_prob = token_logps(space, ref_logits).sum(-1).exp()
    for name, reg in cli_result["regimes"].items():
        assert reg["reward"] == rewards[name].tolist()
        assert reg["reference_prob"] == ref_prob.tolist()
        star = reverse_kl_optimum(ref_prob, rewards[name], CFG.beta)
        pf, lam = forward_kl_optimum(ref_prob, rewards[name], CFG.beta)
        assert reg["reverse_kl_optimum"]["prob"] == star.tolist()
        assert reg["forward_kl_optimum"]["prob"] == pf.tolist()
        assert reg["forward_kl_optimum"]["lambda"] == lam


def test_cli_figure_and_verdict(cli_out, cli_result):
    # 2 regimes × 7.4 in wide, 17 in tall, at 80 dpi
    assert_drawn(cli_out / "fixed_points.png", figure_pixels((2 * 7.4, 17), 80), min_ink=0.05)
    written = (cli_out / "verdict.md").read_text().splitlines()
    expected = verdict_markdown(cli_result).splitlines()
    # the runtime line is the only one that reads a clock (the JSON is written before the total is known)
    assert [x for x in written if not x.startswith("Runtime")] == [x for x in expected if not x.startswith("Runtime")]
    assert "- Every closed form is reached" in written[-12:] or any(
        x.startswith("- Every closed form") for x in written
    )
