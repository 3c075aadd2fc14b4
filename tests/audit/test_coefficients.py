"""Tests for klgrad.audit.coefficients (the paper's Figure 1): closed forms, shared curves, files.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

from klgrad.audit.coefficients import (
    DEFAULT_HEADS,
    coefficient_curves,
    curve_styles,
    plot_coefficient_curves,
    write_coefficient_figure,
)

pytestmark = pytest.mark.numerics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOG_REF = math.log(0.25)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(b))


@pytest.fixture(scope="module")
def curves() -> dict:
    return coefficient_curves()


def test_grid_and_metadata(curves):
    x = curves["log_pi"]
    assert len(x) == 401
    assert x[0] == -5.0
    assert x[-1] == 0.0
    assert all(b > a for a, b in itertools.pairwise(x))
    assert curves["pi_ref"] == 0.25
    assert curves["log_pi_ref"] == LOG_REF
    assert tuple(curves["curves"]) == DEFAULT_HEADS
    assert all(len(v) == 401 for v in curves["curves"].values())


def test_curves_match_closed_forms_everywhere(curves):
    # k1/k2: log π - log 0.25; k3: 1 - 0.25/π; MSE: π - 0.25; k1 as loss: 1 (π = e^{log π})
    c = curves["curves"]
    for i, lp in enumerate(curves["log_pi"]):
        assert close(c["k1_in_reward"][i], lp - LOG_REF), (i, lp)
        assert close(c["k3_as_loss"][i], 1.0 - 0.25 / math.exp(lp)), (i, lp)
        assert close(c["mse_in_reward"][i], math.exp(lp) - 0.25), (i, lp)
        assert c["k1_as_loss"][i] == 1.0


def test_curves_hand_values(curves):
    c, x = curves["curves"], curves["log_pi"]
    i_end, i_start = x.index(0.0), x.index(-5.0)
    # log π = 0 (π = 1): k1 = log 4 ≈ 1.386; k3 = 1 - 0.25 = 0.75; MSE = 1 - 0.25 = 0.75
    assert close(c["k1_in_reward"][i_end], math.log(4.0))
    assert close(c["k3_as_loss"][i_end], 0.75)
    assert close(c["mse_in_reward"][i_end], 0.75)
    # log π = -5: k1 = -5 + log 4 ≈ -3.614; k3 = 1 - 0.25 e^5 ≈ -36.1 (off the plotted range); MSE ≈ -0.2433
    assert close(c["k1_in_reward"][i_start], -5.0 + math.log(4.0))
    assert close(c["k3_as_loss"][i_start], 1.0 - 0.25 * math.exp(5.0))
    assert close(c["mse_in_reward"][i_start], math.exp(-5.0) - 0.25)


def test_k1_in_reward_and_k2_as_loss_curves_identical(curves):
    assert curves["curves"]["k1_in_reward"] == curves["curves"]["k2_as_loss"]


def test_k3_crosses_zero_at_log_pi_ref(curves):
    x, k3 = curves["log_pi"], curves["curves"]["k3_as_loss"]
    crossings = [i for i in range(len(x) - 1) if k3[i] < 0.0 <= k3[i + 1]]
    assert len(crossings) == 1
    (i,) = crossings
    assert x[i] < LOG_REF < x[i + 1]
    # linear interpolation of the root; k3 is smooth, so it lands within (step)² of log π_ref
    root = x[i] - k3[i] * (x[i + 1] - x[i]) / (k3[i + 1] - k3[i])
    assert abs(root - LOG_REF) < (x[1] - x[0]) ** 2
    assert all(v < 0 for v, lp in zip(k3, x, strict=True) if lp < LOG_REF)
    assert all(v > 0 for v, lp in zip(k3, x, strict=True) if lp > LOG_REF)
    # at exactly log π = log π_ref every head but k1 as loss is 0
    at = coefficient_curves(lo=LOG_REF, hi=0.0, n=2)
    assert at["log_pi"][0] == LOG_REF
    for h in ("k1_in_reward", "k2_as_loss", "k3_as_loss", "mse_in_reward"):
        assert at["curves"][h][0] == 0.0, h


def test_other_pi_ref_range_and_heads():
    out = coefficient_curves(pi_ref=0.5, lo=-2.0, hi=-1.0, n=5, heads=("k3_in_reward", "none"))
    assert out["log_pi"] == [-2.0, -1.75, -1.5, -1.25, -1.0]
    for lp, v in zip(out["log_pi"], out["curves"]["k3_in_reward"], strict=True):
        assert close(v, 1.0 - 0.5 / math.exp(lp))
    assert out["curves"]["none"] == [0.0] * 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pi_ref": 0.0}, "pi_ref"),
        ({"pi_ref": 1.5}, "pi_ref"),
        ({"lo": 0.0, "hi": -1.0}, "lo < hi"),
        ({"lo": float("-inf")}, "lo < hi"),
        ({"n": 1}, "n must"),
        ({"heads": ("k4",)}, "k4"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        coefficient_curves(**kwargs)


def test_k1_and_k2_share_one_legend_entry(curves):
    styles = curve_styles(curves)
    assert [s.heads for s in styles] == [
        ("k1_in_reward", "k2_as_loss"),
        ("k3_as_loss",),
        ("mse_in_reward",),
        ("k1_as_loss",),
    ]
    k12, k3, mse, k1l = styles
    assert (k12.color, k12.linestyle) == ("olive", "-")
    assert "principled" in k12.label
    assert k12.linewidth > k3.linewidth
    assert (k3.color, k3.linestyle) == ("firebrick", "--")
    assert "biased first-order" in k3.label
    assert (mse.color, mse.linestyle) == ("royalblue", "-.")
    assert (k1l.color, k1l.linestyle) == ("gray", ":")
    assert "zero expected gradient" in k1l.label
    # the k3 pair shares a line too when both are asked for
    both = curve_styles(coefficient_curves(heads=("k3_as_loss", "k3_in_reward")))
    assert [s.heads for s in both] == [("k3_as_loss", "k3_in_reward")]


def test_write_coefficient_figure(tmp_path):
    out_dir = tmp_path / "new" / "fig1"
    result = write_coefficient_figure(out_dir)
    data = json.loads((out_dir / "coefficients.json").read_text())
    assert data == result
    assert data == coefficient_curves()
    png = (out_dir / "coefficients.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    assert len(png) > 10_000
    assert sorted(p.name for p in out_dir.iterdir()) == ["coefficients.json", "coefficients.png"]


def test_plot_subset_of_heads(tmp_path):
    path = tmp_path / "k3_only.png"
    plot_coefficient_curves(coefficient_curves(heads=("k3_as_loss",), n=51), path)
    assert path.read_bytes()[:8] == PNG_MAGIC
