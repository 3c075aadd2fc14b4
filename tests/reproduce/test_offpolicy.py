"""klgrad.reproduce.offpolicy: the verdict from a known table (the training itself: reproduce/test_targets.py)."""

from __future__ import annotations

from klgrad.reproduce.offpolicy import VARIANTS, offpolicy_verdict


def test_verdict_table_from_known_means():
    tail = {
        "no IS (bug)": {"kl/k1": 0.35212, "reward/mean": 0.53149, "clip/kl_frac": 0.0},
        "IS": {"kl/k1": 0.5664, "reward/mean": 0.57351, "clip/kl_frac": 0.0},
        "IS + clip 0.2": {"kl/k1": 0.45949, "reward/mean": 0.625, "clip/kl_frac": 0.1234},
    }
    v = offpolicy_verdict(tail, steps=40, seed=3)
    lines = v.splitlines()
    assert lines[0].startswith("# Off-policy KL correction")
    assert "40 steps, seed 3" in v
    rows = lines[lines.index("|---|---|---|---|") + 1 :][:3]
    assert rows == [
        "| no IS (bug) | 0.3521 | 0.5315 | 0.000 |",
        "| IS | 0.5664 | 0.5735 | 0.000 |",
        "| IS + clip 0.2 | 0.4595 | 0.6250 | 0.123 |",
    ]
    assert v.endswith("as unresolved.\n")


def test_variants_are_the_three_treatments():
    assert VARIANTS["no IS (bug)"] == {"kl.is_correction": False}
    assert VARIANTS["IS"]["kl.clip_eps"] is None
    assert VARIANTS["IS + clip 0.2"] == {"kl.is_correction": True, "kl.clip_eps": 0.2}
