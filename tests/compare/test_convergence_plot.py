"""The convergence figure: its windows and bands in closed form, and the figure drawn for a decided and an
undecided record."""

from __future__ import annotations

import math

import pytest

from klgrad.compare.convergence import ConvergenceCriterion, MethodRuns, converged, window_spans
from klgrad.compare.convergence_plot import plot_convergence, seed_mean_band


def test_window_spans_are_the_halves_of_the_last_quarter():
    assert window_spans(60, 0.25) == ((45.0, 52.5), (52.5, 60.0))
    assert window_spans(31, 0.25) == ((23.25, 27.125), (27.125, 31.0))


def test_seed_mean_band_over_the_steps_every_run_logged():
    a = [(1, 1.0), (2, 2.0), (3, 3.0)]
    b = [(1, 3.0), (3, 5.0)]  # no step 2
    steps, mean, se = seed_mean_band([a, b])
    assert steps == [1, 3]
    assert mean == [2.0, 4.0]
    assert se == pytest.approx([math.sqrt(2) / math.sqrt(2)] * 2)  # sd of {x, x + 2} is √2
    assert seed_mean_band([a]) == ([1, 2, 3], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0])


def _record(series, lrs, crit, steps):
    by = {
        m: converged(s, lr, crit) for m, (s, lr) in {"k2_as_loss": (series, lrs), "k3_as_loss": (series, lrs)}.items()
    }
    return {"met": all(v["met"] for v in by.values()), "steps": steps, "by_method": by}


@pytest.mark.parametrize("steps", [60, 2])  # 2 steps: no point in a window half, so no movements to draw
def test_the_figure_is_drawn_for_a_decided_and_an_undecided_record(tmp_path, steps):
    crit = ConvergenceCriterion(gap=0.08)
    series = [[(t, 0.3 + 0.01 * ((t * (s + 3)) % 7)) for t in range(1, steps + 1)] for s in range(4)]
    lrs = [[(t, 1e-4 * 0.5 * (1 + math.cos(math.pi * (t - 1) / steps))) for t in range(1, steps + 1)]] * 4
    record = _record(series, lrs, crit, steps)
    assert (record["by_method"]["k2_as_loss"]["deltas"] is None) == (steps == 2)
    path = tmp_path / "convergence.png"
    runs = MethodRuns(series, lrs, list(range(4)))
    plot_convergence({"k2_as_loss": runs, "k3_as_loss": runs}, record, crit, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
