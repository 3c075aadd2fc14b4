"""klgrad.integrations.trl_support: the TRL releases the integration runs on (1.10–1.16, each tested by
tools/trl_matrix.sh, docs/trl_matrix.md), and what the import says on the others. No TRL needed."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from klgrad.integrations.trl_support import NEWEST_TESTED, OLDEST, trl_problem

ROOT = Path(__file__).parents[2]
MINORS = [f"1.{m}" for m in range(OLDEST.minor, NEWEST_TESTED.minor + 1)]


@pytest.mark.parametrize("version", ["1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.2", "1.16.0", "1.17.0"])
def test_supported_releases_import(version: str) -> None:
    """1.10–1.14 and 1.16 run without Triton (the CPU case); before the change the integration needed 1.16."""
    assert trl_problem(version, has_triton=False) is None
    assert trl_problem(version, has_triton=True) is None


def test_older_and_triton_only_releases_say_which_trl_and_why() -> None:
    old = trl_problem("1.9.2", has_triton=True)
    assert old.startswith("klgrad.integrations.trl needs TRL >= 1.10 (tested 1.10–1.16")
    assert "private methods of GRPOTrainer" in old
    for version in ("1.15.0", "1.15.0rc1"):
        triton = trl_problem(version, has_triton=False)
        assert "cannot run on TRL" in triton
        assert "Triton kernel" in triton
        assert "Use TRL 1.10–1.14 or >= 1.16" in triton
    assert trl_problem("1.15.0", has_triton=True) is None  # a GPU machine's torch brings Triton


def test_the_extra_admits_every_tested_release() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["trl"] == [f"trl>={OLDEST}"]


def test_the_matrix_report_covers_every_minor_release() -> None:
    """docs/trl_matrix.md, written by tools/trl_matrix.sh: one row per minor release 1.10–1.16, each either passing
    the TRL tests or refused at import with trl_problem's reason (and TRL's own trainer failing there too)."""
    report = (ROOT / "docs" / "trl_matrix.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (1\.\d+)\.\d+ \| ([^|]+) \|", report, flags=re.M))
    assert sorted(rows, key=lambda v: int(v.split(".")[1])) == MINORS
    for minor, result in rows.items():
        if minor == "1.15":
            assert result.strip().startswith("refused at import"), result
        else:
            assert re.fullmatch(r"\d+ passed", result.strip()), (minor, result)
