"""Every `klgrad reproduce` target run through the CLI: the written numbers equal what the theory or the runs'
own records say, the verdicts are the functions of those numbers, and the figures are drawn at their size."""

from __future__ import annotations

import functools
import json
import math
import re

import pytest

import klgrad.reproduce.k3_gaussian
from klgrad.audit.run import headline
from klgrad.cli import main
from klgrad.reproduce.group_norm_rl import group_norm_rl_verdict
from klgrad.reproduce.k3_gaussian_report import verdict_k3_gaussian
from klgrad.reproduce.offpolicy import offpolicy_verdict
from klgrad.trainer import read_jsonl
from tests.helpers.png_check import assert_drawn, figure_pixels

pytestmark = pytest.mark.slow
LOG2 = math.log(2.0)


def _reproduce(tmp_path, name: str, *extra: str):
    out = tmp_path / name
    assert main(["reproduce", name, "--out", str(out), *extra]) == 0
    return out


def test_coefficients(tmp_path):
    out = _reproduce(tmp_path, "coefficients")
    c = json.loads((out / "coefficients.json").read_text())
    pi_ref = c["pi_ref"]
    assert pi_ref == 0.25
    for i, lp in enumerate(c["log_pi"]):  # the paper's closed forms, c(log π), to float64 round-off
        assert c["curves"]["k2_as_loss"][i] == pytest.approx(lp - math.log(pi_ref), abs=1e-12)
        assert c["curves"]["k3_as_loss"][i] == pytest.approx(1 - pi_ref / math.exp(lp), rel=1e-12, abs=1e-12)
        assert c["curves"]["mse_in_reward"][i] == pytest.approx(math.exp(lp) - pi_ref, abs=1e-12)
    assert f"log π ∈ [{c['lo']}, {c['hi']}]" in (out / "verdict.md").read_text()
    assert_drawn(out / "coefficients.png", figure_pixels((9.0, 5.5), 150))


def test_k3_uniform_bias(tmp_path):
    out = _reproduce(tmp_path, "k3-uniform-bias")
    res = json.loads((out / "k3_uniform_bias.json").read_text())
    assert res["setup"]["n_samples"] == 1_000_000  # the CLI runs the defaults
    assert res["measured_mean"]["k3"] == pytest.approx(LOG2 - 0.5, abs=1e-12)  # every sample is log 2 - 1/2
    assert res["measured_mean"]["k1"] == pytest.approx(LOG2, abs=1e-12)
    assert res["measured_E_q_r"] == pytest.approx(0.5, abs=1e-15)
    verdict = (out / "verdict.md").read_text()
    assert f"| E[k3] | {res['measured_mean']['k3']:.10f} | log 2 − ½ = {LOG2 - 0.5:.10f} |" in verdict
    assert_drawn(out / "k3_uniform_bias.png", figure_pixels((6.4, 4.4), 110))


def test_k3_gaussian_dispatch(tmp_path, monkeypatch):
    # the full-size target takes minutes: the CLI's import path is pointed at a small run of the same function
    small = functools.partial(
        klgrad.reproduce.k3_gaussian.run_k3_gaussian,
        n_samples=2_000,
        n_runs=4,
        sigmas=(0.5, 1.2),
        sweep_ns=(100, 1_000),
        sweep_repeats=2,
        paper_n_samples=1_000,
    )
    monkeypatch.setattr(klgrad.reproduce.k3_gaussian, "run_k3_gaussian", small)
    out = _reproduce(tmp_path, "k3-gaussian")
    res = json.loads((out / "k3_gaussian.json").read_text())
    assert res["setup"]["n_runs"] == 4
    assert res["truth"]["kl_q_p_closed_form"] == pytest.approx(math.log(5.0) - 0.475, abs=1e-15)
    assert (out / "verdict.md").read_text() == verdict_k3_gaussian(res)
    assert_drawn(out / "k3_gaussian.png", figure_pixels((17, 6.4), 110))


def test_gradient_equivalence(tmp_path):
    out = _reproduce(tmp_path, "gradient-equivalence")
    audit = json.loads((out / "audit.json").read_text())
    on = {(r["head"], r["level"]): r for r in audit["rows"] if r["regime"] == "on_policy"}
    assert on[("k2_as_loss", "sequence")]["err_rkl"] < 1e-12  # exact: the reverse-KL gradient
    assert on[("k3_as_loss", "sequence")]["err_rkl"] > 0.1  # a different gradient: the forward KL's
    assert on[("k1_as_loss", "sequence")]["grad_norm"] < 1e-12  # zero in expectation
    h = headline(audit)
    verdict = (out / "verdict.md").read_text()
    assert f"sequence level: rel. error {h['k1_in_reward/sequence err_rkl']:.1e}" in verdict
    assert f"k3-as-loss, sequence: {h['k3_as_loss/sequence err_rkl']:.3f}" in verdict
    assert_drawn(out / "audit.png")  # tight bounding box: no fixed size


def _tail_from_runs(run_dirs: dict[str, str], out, keys) -> dict[str, dict[str, float]]:
    """The last-10-step means recomputed from each run's own metrics.jsonl."""
    tail = {}
    for label, d in run_dirs.items():
        rs = [r for r in read_jsonl(out / "runs" / d / "metrics.jsonl") if "reward/mean" in r]
        tail[label] = {k: sum(r[k] for r in rs[-10:]) / len(rs[-10:]) for k in keys}
    return tail


def test_offpolicy_with_two_steps(tmp_path):
    out = _reproduce(tmp_path, "offpolicy", "--steps", "2")
    res = json.loads((out / "offpolicy.json").read_text())
    dirs = {"no IS (bug)": "no", "IS": "is", "IS + clip 0.2": "is_clip"}
    assert res["last10_mean"] == _tail_from_runs(dirs, out, ("kl/k1", "reward/mean", "clip/kl_frac"))
    assert res["setup"]["algo.ppo_epochs"] == 4
    assert (out / "verdict.md").read_text() == offpolicy_verdict(res["last10_mean"], steps=2, seed=0)
    assert res["last10_mean"]["IS"]["clip/kl_frac"] == 0.0  # no clip configured: nothing clipped
    assert_drawn(out / "offpolicy.png", figure_pixels((15, 4), 115))


def test_group_norm_with_two_steps(tmp_path):
    out = _reproduce(tmp_path, "group-norm", "--steps", "2")
    amp = json.loads((out / "group_norm.json").read_text())
    unfloored = next(e for e in amp["paper_example"]["by_std_min"] if e["std_min"] is None)
    assert unfloored["max_abs"] == pytest.approx(math.sqrt(3) / 2, abs=1e-6)  # the paper's ±0.8660
    rl = json.loads((out / "rl" / "group_norm_rl.json").read_text())
    dirs = {
        "no KL, no std clip": "nokl_noclip",
        "no KL, std_min = 0.1": "nokl_stdmin",
        "k2 KL β=0.5, no std clip": "k2_noclip",
        "k2 KL β=0.5, std_min = 0.1": "k2_stdmin",
    }
    assert rl["last10_mean"] == _tail_from_runs(dirs, out / "rl", ("kl/k1", "entropy", "reward/mean"))
    rl_verdict = group_norm_rl_verdict(rl["last10_mean"], steps=2, seed=0)
    assert (out / "rl" / "verdict.md").read_text() == rl_verdict
    verdict = (out / "verdict.md").read_text()  # the amplification's verdict, then the RL runs'
    assert verdict.endswith("\n" + rl_verdict)
    assert re.search(r"without a floor the paper's rewards give ±0\.8660", verdict)
    assert_drawn(out / "group_norm.png", figure_pixels((13, 5.4), 110))
    assert_drawn(out / "rl" / "group_norm_rl.png", figure_pixels((15, 4), 115))
