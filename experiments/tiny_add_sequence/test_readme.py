"""readme.py: this study's README quotes the numbers its committed files hold, and a changed one is caught."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("readme", Path(__file__).resolve().parent / "readme.py")
readme = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme)


def test_the_readme_quotes_the_committed_files():
    assert readme.check() == []


def test_a_changed_number_is_caught(tmp_path):
    v = readme.values()
    row = v["row0"]
    changed = row.replace(" | ", " | 9", 1)
    copy = tmp_path / "README.md"
    copy.write_text((readme.HERE / "README.md").read_text().replace(row, changed))
    assert readme.check(readme=copy, v=v) == [f"README.md: not once:\n{row}"]
