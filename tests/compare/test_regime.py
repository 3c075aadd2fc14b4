"""klgrad regime: the sequence-level fixed points from grouped reward masses (klgrad.compare.regime)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.compare.regime import (
    binary_crossover,
    fixed_point_forward_kls,
    fixed_point_kls,
    most_influential,
    reward_masses,
    run_regime,
    summarize_regime,
)
from klgrad.config import load_config
from klgrad.exact.optima import forward_kl_optimum, kl_divergence, reverse_kl_optimum
from klgrad.trainer import load_data

# float64 bisection to the last bit and a handful of logs: far below the 4 decimals of the worked check
WORKED_TOL = 5e-5


@pytest.mark.parametrize(
    ("masses", "reverse", "forward"),
    [
        ([(1.0, 0.6), (0.0, 0.4)], 0.2589, 0.1517),  # sharpening: k3 holds closer
        ([(1.0, 0.02), (0.0, 0.98)], 0.1418, 1.3487),  # discovery: k2 holds closer, by ten times
    ],
)
def test_worked_check(masses, reverse, forward):
    got = fixed_point_kls(sorted(masses), beta=0.5)
    assert got[0] == pytest.approx(reverse, abs=WORKED_TOL)
    assert got[1] == pytest.approx(forward, abs=WORKED_TOL)


@pytest.mark.parametrize(
    ("masses", "reverse", "forward"),
    [
        # {1: 0.6, 0: 0.4}, β = 0.5: π* = (0.4, 0.6·e²)/(0.4 + 0.6·e²) = (0.0828, 0.9172); π_f = β·m/(λ − R) with
        # λ² − 1.5λ + 0.2 = 0, λ = 1.3521: (0.1479, 0.8521). KL(π_ref‖·) = Σ m·log(m/π).
        ([(1.0, 0.6), (0.0, 0.4)], 0.3756, 0.1875),
        ([(1.0, 0.02), (0.0, 0.98)], 0.0803, 0.6328),
    ],
)
def test_worked_check_forward_kl(masses, reverse, forward):
    """KL(π_ref‖π*), KL(π_ref‖π_f) of the worked check (module docstring), by hand above."""
    got = fixed_point_forward_kls(sorted(masses), beta=0.5)
    assert got[0] == pytest.approx(reverse, abs=WORKED_TOL)
    assert got[1] == pytest.approx(forward, abs=WORKED_TOL)
    assert fixed_point_forward_kls([(1.0, 1.0)], 0.5) == (0.0, 0.0)


@settings(max_examples=40, deadline=None)
@given(
    n_responses=st.integers(min_value=2, max_value=12),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    beta=st.floats(min_value=0.05, max_value=3.0),
)
def test_grouping_by_reward_value_is_exact(n_responses: int, seed: int, beta: float):
    """The KL of both optima over individual responses equals the KL computed from the masses grouped by reward:
    within a reward value both optima scale the reference by one common factor."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.softmax(torch.randn(n_responses, generator=g, dtype=torch.float64), 0)
    reward = torch.randint(0, 3, (n_responses,), generator=g).to(torch.float64) / 2  # values 0, 0.5, 1
    if reward.unique().numel() == 1:
        reward[0] = 1.0 - reward[0]
    full_reverse = kl_divergence(reverse_kl_optimum(ref, reward, beta), ref)
    full_forward = kl_divergence(forward_kl_optimum(ref, reward, beta)[0], ref)
    masses = sorted((float(v), float(ref[reward == v].sum())) for v in reward.unique())
    grouped = fixed_point_kls(masses, beta)
    grouped_fkl = fixed_point_forward_kls(masses, beta)
    full_fkl_reverse = kl_divergence(ref, reverse_kl_optimum(ref, reward, beta))
    full_fkl_forward = kl_divergence(ref, forward_kl_optimum(ref, reward, beta)[0])
    assert grouped_fkl[0] == pytest.approx(full_fkl_reverse, rel=1e-12, abs=1e-14)
    assert grouped_fkl[1] == pytest.approx(full_fkl_forward, rel=1e-9, abs=1e-12)
    # float64: n ≤ 12 terms, each a product of a few roundings; 1e-12 relative is ~4500 ulps of slack
    assert grouped[0] == pytest.approx(full_reverse, rel=1e-12, abs=1e-14)
    assert grouped[1] == pytest.approx(full_forward, rel=1e-9, abs=1e-12)  # λ by bisection: ~1e-16 in λ, amplified


def test_masses_and_single_value_prompts():
    assert reward_masses([1, 0, 1, 1]) == [(0.0, 0.25), (1.0, 0.75)]
    assert fixed_point_kls([(1.0, 1.0)], 0.5) == (0.0, 0.0)  # always right: nothing to move


def test_crossover_of_a_binary_reward():
    """At β = 0.5 the two optima are equally far from the reference near a success rate of 0.2; below it the
    forward optimum moves further (discovery), above it the reverse one does (sharpening)."""
    p = binary_crossover(0.5)
    assert 0.1 < p < 0.3
    below = fixed_point_kls([(0.0, 1 - p / 2), (1.0, p / 2)], 0.5)
    above = fixed_point_kls([(0.0, 1 - (p + 1) / 2), (1.0, (p + 1) / 2)], 0.5)
    assert below[1] > below[0]
    assert above[1] < above[0]
    gap = fixed_point_kls([(0.0, 1 - p), (1.0, p)], 0.5)
    assert gap[0] == pytest.approx(gap[1], rel=1e-6)


def test_summary_recomputes_from_its_masses_and_decides():
    sharpen = [[1.0] * 6 + [0.0] * 4 for _ in range(20)]  # 60% right everywhere
    result = summarize_regime(sharpen, 0.5, resamples=200)
    assert result["closer"] == "k3_as_loss"
    assert result["success_rate"] == pytest.approx(0.6)
    for p in result["prompts"]:
        assert (p["kl_reverse"], p["kl_forward"]) == fixed_point_kls([tuple(m) for m in p["masses"]], 0.5)
        masses = [tuple(m) for m in p["masses"]]
        assert (p["forward_kl_reverse"], p["forward_kl_forward"]) == fixed_point_forward_kls(masses, 0.5)
    assert result["predicted_kl"]["reverse"] == pytest.approx(0.2589, abs=WORKED_TOL)
    assert result["predicted_forward_kl"]["reverse"] == pytest.approx(0.3756, abs=WORKED_TOL)
    assert result["predicted_forward_kl"]["forward"] == pytest.approx(0.1875, abs=WORKED_TOL)
    for key in ("forward_kl_reverse", "forward_kl_forward"):
        lo, hi = result["interval_95"][key]
        assert lo <= hi
    lo, hi = result["interval_95"]["reverse"]
    assert lo <= result["predicted_kl"]["reverse"] <= hi
    discover = [[1.0] + [0.0] * 49 for _ in range(20)]  # 2% right
    assert summarize_regime(discover, 0.5, resamples=200)["closer"] == "k2_as_loss"
    never = summarize_regime([[0.0] * 8 for _ in range(3)], 0.5, resamples=50)
    assert never["prompts_never_rewarded"] == 3
    assert never["closer"] == "tie"  # nothing seen to move towards: both predict 0


def test_the_most_influential_prompt_is_the_one_that_carries_the_gap():
    """Twenty prompts at 60% (k3's fixed point closer) and one the reference gets right once in 256: that one's
    forward-KL fixed point is far away, it alone moves the set's gap, and leaving it out gives the others' gap."""
    sharpen = [[1.0] * 6 + [0.0] * 4 for _ in range(20)]
    rare = [[1.0] + [0.0] * 255]
    result = summarize_regime(sharpen + rare, 0.5, resamples=20)
    top = most_influential(result["prompts"])
    rev, fwd = fixed_point_kls([(0.0, 0.4), (1.0, 0.6)], 0.5)
    assert top["index"] == 20
    assert top["success_rate"] == 1 / 256
    assert top["mean_without"] == pytest.approx(fwd - rev, rel=1e-12)  # the 20 equal prompts' own gap
    gaps = [p["kl_forward"] - p["kl_reverse"] for p in result["prompts"]]
    assert top["mean_forward_minus_reverse"] == pytest.approx(sum(gaps) / 21, rel=1e-12)
    assert top["forward_minus_reverse"] > 1.0 > 0 > top["mean_without"]  # k3 closer without it, far on it
    assert most_influential(result["prompts"][:1]) is None


def test_the_committed_held_out_tie_is_carried_by_one_prompt():
    """experiments/regime/smollm2_sharpen_beta0.5_heldout_k256: a tie over 22 held-out prompts; without "2 + 7" (the
    reference right once in 256) k3's fixed points are 0.086 below π*, as on the training prompts."""
    path = Path(__file__).resolve().parents[2] / "experiments" / "regime" / "smollm2_sharpen_beta0.5_heldout_k256"
    result = json.loads((path / "regime.json").read_text())
    top = most_influential(result["prompts"])
    assert result["closer"] == "tie"
    assert top["id"] == "chat_addition-2+7"
    assert top["mean_without"] == pytest.approx(-0.0855, abs=5e-4)  # 0.2441 − 0.3296, rounded as written


def test_refuses_bad_beta():
    with pytest.raises(ValueError, match="beta must be > 0"):
        summarize_regime([[1.0, 0.0]], 0.0)


@pytest.mark.slow
def test_regime_on_the_embedded_reference(tmp_path: Path):
    """On the shipped tiny addition reference (65% held-out greedy accuracy): the file has the documented shape,
    its numbers recompute from its own masses, and the figure is written."""
    cfg = load_config("configs/tiny_add.yaml")
    result = run_regime(cfg, tmp_path, beta=None, samples=16, prompts=16, seed=0)
    saved = json.loads((tmp_path / "regime.json").read_text())
    assert saved == json.loads(json.dumps(result))
    for key in (
        "beta",
        "n_prompts",
        "samples_per_prompt",
        "success_rate",
        "predicted_kl",
        "predicted_forward_kl",
        "closer",
        "prompts",
    ):
        assert key in saved
    assert saved["beta"] == cfg.kl.beta
    assert (saved["n_prompts"], saved["samples_per_prompt"]) == (16, 16)
    assert 0 < saved["success_rate"] < 1
    for p in saved["prompts"]:
        assert math.isclose(sum(m for _, m in p["masses"]), 1.0, rel_tol=1e-12)
        assert (p["kl_reverse"], p["kl_forward"]) == fixed_point_kls([tuple(m) for m in p["masses"]], cfg.kl.beta)
    assert (tmp_path / "regime.png").stat().st_size > 10_000
    train_ids = [e.id for e in load_data(cfg)[0][:16]]
    assert [p["id"] for p in saved["prompts"]] == train_ids
    assert saved["split"] == "train"


def test_regime_on_the_held_out_prompts_follows_their_order(tmp_path: Path):
    """--split heldout samples the held-out prompts klgrad compare measures its final KL on, in that order."""
    cfg = load_config("configs/tiny_add.yaml")
    result = run_regime(cfg, tmp_path, beta=None, samples=2, prompts=3, seed=0, split="heldout")
    assert [p["id"] for p in result["prompts"]] == [e.id for e in load_data(cfg)[1][:3]]
    assert result["split"] == "heldout"
    with pytest.raises(ValueError, match="--split"):
        run_regime(cfg, tmp_path, beta=None, samples=2, prompts=3, seed=0, split="test")


COMMITTED = sorted((Path(__file__).resolve().parents[2] / "experiments" / "regime").glob("*/regime.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_results_recompute_from_their_own_masses(path: Path):
    """Every per-prompt KL of a committed regime.json is the fixed points of its own masses, the set's predicted
    KL their mean, and each prompt's masses a distribution (same float64 code: rounding only, 1e-12)."""
    result = json.loads(path.read_text())
    assert len(result["prompts"]) == result["n_prompts"]
    for p in result["prompts"]:
        masses = [tuple(m) for m in p["masses"]]
        assert sum(m for _, m in masses) == pytest.approx(1.0, abs=1e-12)
        rev, fwd = fixed_point_kls(masses, result["beta"])
        assert p["kl_reverse"] == pytest.approx(rev, rel=1e-12, abs=1e-12)
        assert p["kl_forward"] == pytest.approx(fwd, rel=1e-12, abs=1e-12)
    n = result["n_prompts"]
    assert result["predicted_kl"]["reverse"] == pytest.approx(sum(p["kl_reverse"] for p in result["prompts"]) / n)
    assert result["predicted_kl"]["forward"] == pytest.approx(sum(p["kl_forward"] for p in result["prompts"]) / n)


def test_the_committed_regime_results_are_there():
    assert {p.parent.name for p in COMMITTED} >= {"tiny_add", "tiny_discovery", "smollm2_sharpen", "smollm2_discover"}
