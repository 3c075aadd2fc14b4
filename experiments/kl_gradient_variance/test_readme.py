"""The study's README states what results.json holds: every ratio of its table, and the unbiased rows' zero bias."""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = json.loads((HERE / "results.json").read_text(encoding="utf-8"))
README = (HERE / "README.md").read_text(encoding="utf-8")
PARTS = {"on-policy": "on_policy", "stale θ_{t−4}": "off_policy_stale", "perturbed": "off_policy_perturbed"}
NAMES = {
    "k2_as_loss@sequence (baseline)": "k2_as_loss@sequence",
    "k1@ttg, sequence ratio (baseline)": "k1_in_reward@token_to_go/sequence",
    "k1@ttg, token ratio": "k1_in_reward@token_to_go/token",
    "k1@ttg, per_decision": "k1_in_reward@token_to_go/per_decision",
    "k1@ttg, per_decision cap 2": "k1_in_reward@token_to_go/per_decision_cap2",
    "analytic_kl@ttg (prefix ratios)": "analytic_kl@token_to_go (prefix ratios)",
}


def _table_rows():
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in PARTS:
            yield PARTS[cells[0]], NAMES.get(cells[1], cells[1]), cells


def test_every_table_ratio_is_the_results():
    rows = list(_table_rows())
    assert len(rows) == 14
    for part, name, cells in rows:
        row = RESULTS[part]["rows"][name]
        assert cells[3] == f"{row['var_per_sample']:.3f}", (part, name)
        assert cells[5] == f"{row['mse_exact_batch']:.4f}", (part, name)
        if "baseline" in cells[1]:
            assert cells[6] == "1"
            continue
        r, lo, hi = row["mse_ratio_to_baseline"]
        assert cells[6] == f"{r:.3f} [{lo:.3f}, {hi:.3f}]", (part, name)
        if cells[2] == "0":
            assert row["rel_bias"] < 1e-12  # an unbiased estimator: float64 rounding only


def test_headline_ratios_are_in_the_results():
    on = RESULTS["on_policy"]["rows"]["analytic_kl@token_to_go"]["mse_ratio_to_baseline"]
    assert f"**0.082× k2_as_loss@sequence**\n  [95% CI {on[1]:.3f}, {on[2]:.3f}]" in README or re.search(
        rf"{on[0]:.3f}× k2_as_loss@sequence\*\*\s+\[95% CI {on[1]:.3f}, {on[2]:.3f}\]", README
    )
    ratios = [
        row["on_policy:analytic_kl@token_to_go"] / row["on_policy:k2_as_loss@sequence"]
        for row in RESULTS["exact_other_problems"].values()
    ]
    assert f"{min(ratios):.3f}–{max(ratios):.3f}× k2@sequence" in README
