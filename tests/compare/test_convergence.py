"""The convergence record's per-seed movements and its projection of the seeds the standard-error bound needs
(the criterion's conditions themselves are tested in tests/compare/test_grid_mechanics.py)."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from klgrad.compare.convergence import ConvergenceCriterion, converged, seeds_for_resolution, window_halves


def _runs(seeds: int, n: int, noise: float, rng_seed: int = 7) -> list[list[tuple[int, float]]]:
    rng = random.Random(rng_seed)
    return [[(t, 0.3 + rng.gauss(0, noise)) for t in range(1, n + 1)] for _ in range(seeds)]


def _cosine(n: int) -> list[tuple[int, float]]:
    return [(t, 1e-4 * 0.5 * (1 + math.cos(math.pi * (t - 1) / n))) for t in range(1, n + 1)]


def test_seeds_for_resolution_closed_form():
    assert seeds_for_resolution(0.04, 8, 0.02) == 32  # se twice the bound: four times the seeds
    assert seeds_for_resolution(0.02, 8, 0.02) == 8  # at the bound: the seeds there are
    assert seeds_for_resolution(0.0278105271266662, 8, 0.02) == 16  # ⌈8·1.3905²⌉ = ⌈15.47⌉
    assert seeds_for_resolution(0.001, 8, 0.02) == 2  # never fewer than a standard error needs
    assert seeds_for_resolution(None, 8, 0.02) is None
    assert seeds_for_resolution(0.03, 8, None) is None  # no gap stated, no bound
    assert seeds_for_resolution(0.03, 1, 0.02) is None


@given(
    sd=st.floats(1e-6, 1e3),
    n=st.integers(2, 500),
    bound=st.floats(1e-6, 1e3),
)
def test_the_projection_is_the_fewest_seeds_whose_se_meets_the_bound(sd, n, bound):
    """With the spread held at sd, n' seeds give se = sd/√n' ≤ bound and (above the floor of 2) n' − 1 seeds do
    not: the projection is neither short nor generous. The slack 1e-9 relative is the guard in the ceiling."""
    need = seeds_for_resolution(sd / math.sqrt(n), n, bound)
    assert need is not None
    assert need >= 2
    assert sd / math.sqrt(need) <= bound * (1 + 1e-9)
    if need > 2:
        assert sd / math.sqrt(need - 1) > bound * (1 - 1e-9)


def test_converged_records_every_seeds_movement_for_both_tests():
    n, seeds = 60, 6
    runs, lrs = _runs(seeds, n, noise=0.05), [_cosine(n)] * seeds
    out = converged(runs, lrs, ConvergenceCriterion(gap=0.08))
    halves = [window_halves(s, 0.25) for s in runs]
    assert out["deltas"] == [b - a for a, b in halves]
    assert math.isclose(out["moved"], sum(out["deltas"]) / seeds, rel_tol=1e-12)
    assert out["seeds_needed"] == seeds_for_resolution(out["se"], seeds, 0.02)
    early = out["before_decay"]
    cut = [[(t, x) for t, x in s if t <= 31] for s in runs]  # lr(t) ∝ 1 + cos(π(t − 1)/60) ≥ half its peak to t = 31
    assert early["deltas"] == [b - a for a, b in (window_halves(s, 0.25) for s in cut)]
    assert math.isclose(early["moved"], sum(early["deltas"]) / seeds, rel_tol=1e-12)
    assert early["seeds_needed"] == seeds_for_resolution(early["se"], seeds, 0.02)
    # the projection is consistent with condition 3: fewer seeds needed than present iff the se meets the bound
    for v in (out, early):
        assert (v["seeds_needed"] <= seeds) == (v["se"] <= 0.02)
    assert converged(runs, lrs, ConvergenceCriterion(gap=None))["seeds_needed"] is None
