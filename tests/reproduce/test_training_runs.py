"""klgrad.reproduce.training_runs: last-steps means and the curves figure, from known records."""

from __future__ import annotations

import pytest

from klgrad.reproduce.training_runs import last_steps_mean, plot_curves
from tests.helpers.png_check import assert_drawn, figure_pixels


def _records(values: list[float]) -> list[dict]:
    return [{"step": i + 1, "kl/k1": v, "reward/mean": 2 * v} for i, v in enumerate(values)]


def test_last_steps_mean_by_hand():
    curves = {"long": _records([100.0] * 5 + list(range(10))), "short": _records([1.0, 2.0, 6.0])}
    tail = last_steps_mean(curves, ("kl/k1", "reward/mean"))
    assert tail["long"] == {"kl/k1": 4.5, "reward/mean": 9.0}  # the mean of 0..9: the 5 earlier steps are left out
    assert tail["short"] == {"kl/k1": 3.0, "reward/mean": 6.0}  # fewer than 10 steps: all of them
    assert last_steps_mean(curves, ("kl/k1",), n=2)["short"] == {"kl/k1": 4.0}
    with pytest.raises(KeyError):
        last_steps_mean(curves, ("entropy",))


def test_plot_curves_size_and_ink(tmp_path):
    curves = {"a": _records([0.1, 0.3, 0.2, 0.5]), "b": _records([0.2, 0.1, 0.4, 0.3])}
    panels = (("kl/k1", "KL"), ("reward/mean", "reward"))
    plot_curves(curves, panels, tmp_path / "c.png", "two variants")
    assert_drawn(tmp_path / "c.png", figure_pixels((5 * len(panels), 4), 115))
