"""``klgrad compare report`` on the committed grids: regenerated from their runs, each summary is the committed one.

- grids whose summary this revision wrote (the SmolLM2 grids ``smollm2_sharpen_k1_none`` and
  ``smollm2_sharpen_converged``): summary.json and summary.md byte for byte, from the runs' final.json and
  metrics.jsonl;
- grids from before grid.json (``tiny_add_compare``, ``tiny_add_sequence``, ``tiny_discovery_compare`` and the
  two SmolLM2 comparisons of §11): summary.json is kept (its rows are the runs; their folders are gone) and
  summary.md is re-rendered with every number of the committed one; deciding their rows again gives the same
  table exactly and the same verdicts, the p-values within a few ulp (named below);
- the framework grids, summarised before two later corrections of the convergence record and the sign-flip
  test's name: the same numbers, with exactly those corrections.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from klgrad.cli import main
from klgrad.compare.hypotheses import summarize
from klgrad.compare.report import report

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
LEGACY = ("tiny_add_compare", "tiny_add_sequence", "tiny_discovery_compare", "smollm2_discover_compare",
          "smollm2_sharpen_compare")  # fmt: skip
CURRENT = ("smollm2_sharpen_k1_none", "smollm2_sharpen_converged")
CORRECTED = ("frameworks_tiny_dryrun", "smollm2_frameworks")


def copy_grid(name: str, to: Path) -> Path:
    """The files a summary is made from (grid.json, summary.json, summary.md, each run's final.json and
    metrics.jsonl), without the figures and the runs' other files."""
    src, dest = EXPERIMENTS / name, to / name
    dest.mkdir()
    for f in ("grid.json", "summary.json", "summary.md"):
        if (src / f).is_file():
            shutil.copy2(src / f, dest / f)
    for run in sorted((src / "runs").glob("*")) if (src / "runs").is_dir() else ():
        (dest / "runs" / run.name).mkdir(parents=True)
        for f in ("final.json", "metrics.jsonl"):
            if (run / f).is_file():
                shutil.copy2(run / f, dest / "runs" / run.name / f)
    return dest


@pytest.mark.parametrize("name", CURRENT)
def test_a_grid_summarised_by_this_revision_regenerates_byte_for_byte(name, tmp_path):
    out = copy_grid(name, tmp_path)
    (out / "summary.json").unlink()
    (out / "summary.md").unlink()
    assert main(["compare", "report", str(out), "--no-figures"]) == 0
    old = json.loads((EXPERIMENTS / name / "summary.json").read_text())
    new = json.loads((out / "summary.json").read_text())
    # Summarised before the exact sign-flip bracket and the 90% TOST with disjoint Holm (CHANGELOG, "Numbers"):
    # those keys are new, and the sign-flip and adjusted p's are the corrected ones; every other number is equal.
    corrected = ("p_sign_flip", "p_adjusted", "p_difference_adjusted", "sign_flip", "ci_tost", "adjustment")
    mine = {k: v for k, v in _numbers(new).items() if not any(c in k for c in corrected)}
    theirs = {k: v for k, v in _numbers(old).items() if not any(c in k for c in corrected)}
    assert mine == theirs
    verdicts = [p["verdict"] for p in [*old.get("predictions", []), old.get("primary") or {}] if "verdict" in p]
    assert [p["verdict"] for p in [*new.get("predictions", []), new.get("primary") or {}] if "verdict" in p] == verdicts


NUMBER = re.compile(r"[-+]?\d+\.\d+")


@pytest.mark.parametrize("name", LEGACY)
def test_a_grid_from_before_grid_json_keeps_its_summary_and_renders_every_number_it_had(name, tmp_path):
    out = copy_grid(name, tmp_path)
    report(out, figures=False)
    committed = (EXPERIMENTS / name / "summary.md").read_text()
    assert (out / "summary.json").read_bytes() == (EXPERIMENTS / name / "summary.json").read_bytes()
    md = (out / "summary.md").read_text()
    for line in committed.splitlines():
        if line.startswith("| ") and "---" not in line:  # a table row: its numbers in the same order
            key = line.split(" | ")[0]
            mine = next(m for m in md.splitlines() if m.split(" | ")[0] == key)
            assert NUMBER.findall(mine) == NUMBER.findall(line) or set(NUMBER.findall(line)) <= set(
                NUMBER.findall(mine)
            ), line


@pytest.mark.parametrize("name", LEGACY)
def test_deciding_a_legacy_grids_rows_again_gives_its_table_and_verdicts(name):
    """The table (means and t intervals) is exact. The p-values moved in the last digits when the paired t
    statistic was continued to zero spread (d2be190, computed another way; ≤ 1e-14 relative), and the sign-flip
    p's test name lost "exact" when it became a Monte Carlo p beyond 20 seeds (acec305)."""
    s = json.loads((EXPERIMENTS / name / "summary.json").read_text())
    methods = list(dict.fromkeys(r["method"] for r in s["runs"]))
    margin = next((p["margin"] for p in s["predictions"] if "margin" in p), 0.1)
    again = summarize(s["runs"], methods, s["betas"], s["level"], s["steps"], s["seeds"], margin,
                      temperature=s["temperature"]).to_json()  # fmt: skip
    assert again["table"] == s["table"]
    assert again["kl_metric"] == s["kl_metric"]
    flips = RULE_FLIPS.get(name, set())  # the verdicts the corrected TOST/Holm rule moves (docs/findings.md)
    for new, old in zip(again["predictions"], s["predictions"], strict=True):
        assert new["differences"] == old["differences"]
        assert new["test"] == old["test"].replace("exact sign-flip p", "sign-flip p")
        assert new["verdict"] == ("supported" if old["claim"] in flips else old["verdict"]), old["claim"]
        for key in ("p_value", "p_sign_flip"):
            assert new[key] == pytest.approx(old[key], rel=1e-14, abs=0), key


RULE_FLIPS = {
    "tiny_add_compare": {"k1_in_reward ends closer to π* than none"},
    "tiny_discovery_compare": {"k2_as_loss keeps KL below k3_as_loss", "k2_as_loss ends closer to π* than k3_as_loss"},
}
"""Claims whose verdict the 90% TOST with disjoint Holm moves from "not resolved" to "supported" (just under 0.05)."""


def _numbers(x, path=""):
    """Every number in a JSON value, by its path."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _numbers(val, f"{path}/{key}").items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in _numbers(val, f"{path}[{i}]").items()}
    return {path: x} if isinstance(x, int | float) and not isinstance(x, bool) else {}


@pytest.mark.parametrize("name", CORRECTED)
def test_a_framework_grid_regenerates_its_numbers_with_two_named_corrections(name, tmp_path):
    """Summarised before the convergence record gained condition 5 (stopped before the decay: ``before_decay``,
    ``deltas``, ``seeds_needed``, ``seeds`` per method, and the criterion's sentence) and before the sign-flip
    test's name lost "exact"; every number they had is unchanged except convergence's ``met``."""
    out = copy_grid(name, tmp_path)
    report(out, figures=False)
    old = json.loads((EXPERIMENTS / name / "summary.json").read_text())
    new = json.loads((out / "summary.json").read_text())
    assert list(new) == list(old)
    corrected = ("p_sign_flip", "p_adjusted", "p_difference_adjusted", "sign_flip", "ci_tost", "adjustment")

    def kept(x):  # every number but those of the sign-flip/TOST correction (CHANGELOG, "Numbers")
        return {k: v for k, v in _numbers(x).items() if not any(c in k for c in corrected)}

    for key in old:
        if key != "convergence":
            assert kept(new[key]) == kept(old[key]) if key != "runs" else new[key] == old[key], key
    mine = _numbers(new["convergence"])
    for path, value in _numbers(old["convergence"]).items():
        if not path.endswith("/met"):
            assert mine[path] == value, path
    for p in [*new["predictions"], new["primary"]]:
        assert "exact sign-flip" not in p["test"]
