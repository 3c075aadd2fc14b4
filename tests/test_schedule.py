"""klgrad.schedule: the learning-rate factor of train and sft against its closed forms."""

from __future__ import annotations

import math

import pytest

from klgrad.schedule import SCHEDULES, lr_factor


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warm_up_is_linear_from_one_step(schedule):
    assert [lr_factor(k, 100, 4, schedule) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("step", [0, 10, 37, 50, 99, 100])
def test_decays_after_warm_up(step):
    p = (step - 0) / 100
    assert lr_factor(step, 100, 0, "constant") == 1.0
    assert lr_factor(step, 100, 0, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * p)), abs=1e-15)
    assert lr_factor(step, 100, 0, "linear") == pytest.approx(1 - p, abs=1e-15)


def test_progress_counts_from_the_end_of_warm_up_and_stops_at_the_last_step():
    assert lr_factor(10, 110, 10, "cosine") == 1.0
    assert lr_factor(60, 110, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(110, 110, 10, "linear") == 0.0
    assert lr_factor(500, 110, 10, "linear") == 0.0  # past the end: held at the final value, never negative
