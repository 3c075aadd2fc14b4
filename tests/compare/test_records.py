"""klgrad.compare.records: every committed grid.json and summary.json loads into its typed record and is written
back as the same JSON (summaries byte for byte), a key the records do not know is refused (or, in grid.json, kept
as it is), and a decided claim's JSON keeps its order for either role."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klgrad.compare.records import GridRecord, Registration, RunRow, Summary, TestResult, load_summary

ROOT = Path(__file__).resolve().parents[2]
SUMMARIES = sorted((ROOT / "experiments").glob("*/summary.json"))
GRIDS = sorted((ROOT / "experiments").glob("*/grid.json"))


def test_the_committed_grids_are_found():
    assert len(SUMMARIES) >= 9
    assert len(GRIDS) >= 4
    assert {p.parent.name for p in SUMMARIES} >= {"tiny_add_compare", "tiny_add_sequence", "smollm2_sharpen_converged"}


@pytest.mark.parametrize("path", SUMMARIES, ids=lambda p: p.parent.name)
def test_a_committed_summary_round_trips_byte_for_byte(path):
    summary = load_summary(path)
    assert isinstance(summary, Summary)
    assert json.dumps(summary.to_json(), indent=1) == path.read_text()  # write_json's form
    assert summary.runs
    assert all(isinstance(r, RunRow) for r in summary.runs)
    assert all(isinstance(p, TestResult) for p in summary.predictions)


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.parent.name)
def test_a_committed_grid_record_round_trips(path):
    raw = json.loads(path.read_text())
    record = GridRecord.from_json(raw)
    assert record.to_json() == raw
    assert record.extra == {}  # every key known
    assert record.temperature == raw["resolved_config"]["rollout"]["temperature"]
    assert record.runs()[0] == (raw["methods"][0], raw["betas"][0], 0)
    assert len(record.runs()) == len(raw["methods"]) * len(raw["betas"]) * raw["seeds"]


def test_the_sharpening_grids_amendment_and_primary_read_as_typed_views():
    record = GridRecord.from_json(json.loads((ROOT / "experiments/smollm2_sharpen_converged/grid.json").read_text()))
    assert (record.registered_seeds, record.allowed_seeds) == (16, 56)
    assert record.claim.text == "k3_as_loss<k2_as_loss:batch_kl_k1"
    assert record.criterion.gap == 0.08
    assert "before_decay" not in record.convergence  # as written at its revision: no default of this one added


def test_unknown_keys_are_refused_in_a_summary_and_kept_in_a_grid_record():
    data = json.loads(SUMMARIES[0].read_text())
    with pytest.raises(ValueError, match=r"unknown keys \['surprise'\]"):
        Summary.from_json({**data, "surprise": 1})
    with pytest.raises(ValueError, match="a decided claim: unknown keys"):
        TestResult.from_json({**data["predictions"][0], "p_new": 0.5})
    raw = json.loads(GRIDS[0].read_text())
    record = GridRecord.from_json({**raw, "future_field": [1]})
    assert record.extra == {"future_field": [1]}
    assert record.to_json() == {**raw, "future_field": [1]}


def test_a_primary_starts_with_its_statement_a_secondary_prediction_with_its_claim():
    common = dict(claim="k2 ends below k3 on kl", metric="exact_kl", a="k2", b="k3", kind="less", verdict="supported")
    tested = dict(test="paired t-test", n_pairs=2, p_value=0.1, p_adjusted=0.1, alpha=0.05)
    secondary = TestResult(**common, **tested, family="secondary")
    assert list(secondary.to_json()) == ["claim", "metric", "a", "b", "kind", "test", "n_pairs", "p_value",
                                         "p_adjusted", "alpha", "verdict", "family"]  # fmt: skip
    primary = TestResult(**common, **tested, text="k2<k3:kl", family="primary (tested alone)")
    assert list(primary.to_json()) == ["a", "b", "kind", "metric", "text", "claim", "family", "test", "n_pairs",
                                       "p_value", "p_adjusted", "alpha", "verdict"]  # fmt: skip
    untested = TestResult(**{**common, "verdict": "not tested"}, text="k2<k3:kl", family="primary (tested alone)")
    assert list(untested.to_json()) == ["a", "b", "kind", "metric", "text", "claim", "family", "verdict"]
    assert not untested.tested
    assert primary.tested


def test_a_rows_objective_metrics_are_read_inside_objective():
    row = RunRow.from_json({"method": "k2", "beta": 0.5, "seed": 1, "exact_kl": 0.2, "objective": {"J": 0.4}})
    assert (row.value("exact_kl"), row.value("J"), row.value("kl_to_optimum"), row.value("missing")) == (
        0.2,
        0.4,
        None,
        None,
    )
    assert row.to_json() == {"method": "k2", "beta": 0.5, "seed": 1, "exact_kl": 0.2, "objective": {"J": 0.4}}


def test_a_registration_loads_as_one():
    reg = Registration("2026-01-01", "abc", None, {"criterion": "c", "met": None, "steps": 2, "parameters": {}})
    assert list(reg.to_json()) == ["status", "registered_at", "revision", "primary", "convergence", "runs"]
    assert Registration.from_json(reg.to_json()) == reg


def test_the_keys_of_the_exact_sign_flip_bracket_and_the_90_percent_tost_keep_their_place():
    """Records written by the statistics that give the sign-flip p an exact bracket and decide a TOST on its 90%
    interval (p_sign_flip_bracket, sign_flip_method, ci_tost, ci_tost_level, adjustment) load and are written back
    in their order."""
    record = {
        "claim": "k1 ≈ none", "metric": "exact_kl", "a": "k1", "b": "none", "kind": "equivalent",
        "test": "paired TOST", "margin": 0.1, "n_pairs": 3, "differences": [0.1, 0.0, -0.1], "mean_difference": 0.0,
        "ci95": [-0.2, 0.2], "ci_tost": [-0.1, 0.1], "ci_tost_level": 0.9, "p_value": 0.2, "p_difference": 1.0,
        "p_sign_flip": 1.0, "p_sign_flip_bracket": [1.0, 1.0], "sign_flip_method": "enumerated", "n_negative": 1,
        "welch": {"test": "Welch TOST", "p_value": 0.3, "verdict": "not resolved", "adjusted": False},
        "p_adjusted": 0.2, "p_difference_adjusted": 1.0, "adjustment": "Holm step-down", "alpha": 0.05,
        "verdict": "not resolved", "family": "secondary",
    }  # fmt: skip
    assert json.dumps(TestResult.from_json(record).to_json()) == json.dumps(record)
