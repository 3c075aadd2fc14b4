"""klgrad.reproduce.fixed_points_checks: each check holds on a correct result and fails on a wrong one."""

from __future__ import annotations

import copy

import pytest

from klgrad.choices import LEVELS
from klgrad.reproduce.fixed_points import FixedPointConfig, run_fixed_points
from klgrad.reproduce.fixed_points_checks import CLOSED_FORM_KL_TOL, EXACT_FKL, EXACT_RKL, checks, closer_to_reference

SMALL = FixedPointConfig(vocab=2, length=2)


@pytest.fixture(scope="module")
def small_result() -> dict:
    return run_fixed_points(SMALL)


def _failing(result: dict) -> list[tuple[str, str]]:
    return [(c["regime"], c["claim"].split()[0]) for c in checks(result) if not c["ok"]]


def test_all_checks_hold_on_a_correct_run(small_result):
    rows = checks(small_result)
    assert len(rows) == 4 * len(small_result["regimes"])
    assert all(c["ok"] for c in rows), rows


@pytest.mark.parametrize(
    ("key", "field", "value", "claim"),
    [
        (EXACT_RKL[2], "kl_to_optimum", 10 * CLOSED_FORM_KL_TOL, "k1_in_reward,"),
        (EXACT_RKL[0], "converged", False, "k1_in_reward,"),
        (EXACT_FKL[1], "kl_to_forward_optimum", 10 * CLOSED_FORM_KL_TOL, "k3_as_loss,"),
        ("k1_as_loss/token", "steps", -1, "k1_as_loss"),
        ("mse_in_reward/sequence", "max_abs_diff_mse_optimum", 1e-5, "mse_in_reward"),
    ],
)
def test_one_wrong_number_fails_exactly_its_check(small_result, key, field, value, claim):
    wrong = copy.deepcopy(small_result)
    wrong["regimes"]["discovery"]["methods"][key][field] = value
    assert _failing(wrong) == [("discovery", claim)]


def test_k1_as_loss_ending_elsewhere_fails(small_result):
    wrong = copy.deepcopy(small_result)
    probs = wrong["regimes"]["sharpening"]["methods"]["k1_as_loss/sequence"]["final_prob"]
    probs[0], probs[1] = probs[0] + 1e-9, probs[1] - 1e-9  # still a distribution, 1e-9 away from none's
    assert _failing(wrong) == [("sharpening", "k1_as_loss")]
    row = next(c for c in checks(wrong) if c["regime"] == "sharpening" and c["claim"].startswith("k1_as_loss"))
    assert row["measured"].startswith("max |π − π_none| = 1.0e-09")


def test_closer_to_reference_by_hand():
    kls = {"sequence": (0.2, 0.1), "token_to_go": (0.1, 0.2), "token": (0.3, 0.3)}
    regime = {"methods": {}}
    for level, (k2, k3) in kls.items():
        regime["methods"][f"k2_as_loss/{level}"] = {"kl_to_reference": k2}
        regime["methods"][f"k3_as_loss/{level}"] = {"kl_to_reference": k3}
    out = closer_to_reference(regime)
    assert list(out) == list(LEVELS)
    assert out["sequence"] == {"k2_as_loss": 0.2, "k3_as_loss": 0.1, "closer": "k3_as_loss"}
    assert out["token_to_go"]["closer"] == "k2_as_loss"
    assert out["token"]["closer"] == "k3_as_loss"  # a tie is not "k2 is closer"
