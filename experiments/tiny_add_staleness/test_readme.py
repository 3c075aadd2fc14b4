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
    text = (readme.HERE / "README.md").read_text()
    copy = tmp_path / "README.md"
    copy.write_text(text.replace("| −0.041 (0/3) |", "| −0.042 (0/3) |", 1))
    assert len(readme.check(readme=copy)) == 1
