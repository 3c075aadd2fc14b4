"""klgrad.reproduce.fixed_points_report: the method table, the verdict and the figure from known inputs."""

from __future__ import annotations

import copy

import pytest

from klgrad.reproduce.fixed_points import FixedPointConfig, write_fixed_points
from klgrad.reproduce.fixed_points_report import method_table, verdict_markdown
from tests.helpers.png_check import assert_drawn, figure_pixels

SMALL = FixedPointConfig(vocab=2, length=2)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("fixed-points-small")
    return out, write_fixed_points(out, SMALL)


def test_method_table_formats_each_kl(small):
    _, result = small
    reg = copy.deepcopy(result["regimes"]["discovery"])
    m = reg["methods"]["k2_as_loss/sequence"]
    m.update(kl_to_optimum=3e-17, kl_to_forward_optimum=2.5e-7, kl_to_reference=0.123456, rewarded_mass=0.5)
    m.update(steps=2000, converged=False, grad_norm=3.2e-7, form="decoupled")
    row = next(r for r in method_table(reg).splitlines() if r.startswith("| k2_as_loss/sequence "))
    assert row == "| k2_as_loss/sequence | decoupled | 2000 (cap, ‖g‖ = 3e-07) | 0.5000 | < 1e-15 | 2.5e-07 | 0.1235 |"
    assert len(method_table(reg).splitlines()) == 2 + len(reg["methods"])


def test_verdict_follows_its_inputs(small):
    _, result = small
    v = verdict_markdown(result)
    assert "- Every closed form is reached" in v
    assert f"V = {SMALL.vocab} tokens (token 0 = EOS), T = {SMALL.length}" in v
    wrong = copy.deepcopy(result)
    wrong["checks"][1]["ok"] = False
    wrong["regimes"]["sharpening"]["closer_to_reference"]["sequence"]["closer"] = "k2_as_loss"
    v = verdict_markdown(wrong)
    assert "- **Some closed-form checks fail** (table above)." in v
    assert f"| {wrong['checks'][1]['regime']} | {wrong['checks'][1]['claim']} |" in v
    assert "| **no** |" in v
    assert "sharpening: sequence → k2_as_loss" in v


def test_figure_size_and_ink(small):
    out, result = small
    assert_drawn(out / "fixed_points.png", figure_pixels((7.4 * len(result["regimes"]), 17), 80), min_ink=0.05)
