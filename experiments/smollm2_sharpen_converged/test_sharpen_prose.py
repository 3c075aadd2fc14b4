"""sharpen_prose.py: this study's README quotes the numbers its committed files hold (whatever its line wrapping), a
changed number is caught, and so is a fixed word (a verdict, a bound, an order) that the files no longer bear out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("sharpen_prose", Path(__file__).resolve().parent / "sharpen_prose.py")
prose = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prose)


@pytest.fixture(scope="module")
def committed() -> dict[str, str]:
    return prose.values()


def test_the_readme_quotes_the_committed_files(committed):
    assert prose.check(v=committed) == []


def test_a_stale_number_is_caught_however_the_line_wraps(committed, tmp_path):
    text = (prose.HERE / prose.README).read_text()
    quoted = "k2 below in 12 of 56, Holm p 2.4e-06"
    assert prose.flat(text).count(quoted) == 1
    copy = tmp_path / "README.md"
    copy.write_text(text.replace("Holm p 2.4e-06;", "Holm p 2.5e-06;"))
    problems = prose.check(readme=copy, v=committed)
    assert len(problems) == 1
    assert "2.4e-06" in problems[0]
    copy.write_text(text.replace("in held-out stepwise KL,\n  k2 below", "in held-out stepwise KL, k2\n  below"))
    assert prose.check(readme=copy, v=committed) == []


def test_a_fixed_word_the_files_no_longer_bear_out_is_caught(committed):
    changed = {**committed, "lg_opp_looks": "56"}  # the log-prob gap opposite at the last look only
    assert prose.check(v=changed) == ["lg_opp_looks = 56 (the README says 47, 56): edit it by hand"]


@pytest.mark.parametrize(
    ("p", "text"), [(4.08e-05, "4.1e-05"), (0.002173, "0.0022"), (0.01087, "0.011"), (0.3346, "0.33")]
)
def test_p_values_are_written_as_the_prose_writes_them(p, text):
    assert prose.pf(p) == text


def test_exact_p_values_and_their_brackets():
    assert prose.p3(1.3354e-06) == "1.34e-06"
    assert prose.p3(0.027574) == "0.0276"
    assert prose.bracket_end(1.335067e-06, up=False) == "1.3350e-06"
    assert prose.bracket_end(1.3358017e-06, up=True) == "1.3359e-06"  # outwards, so the bracket still holds p
    assert prose.bracket_end(0.0325609, up=False) == "0.032560"


def test_seed_ranges():
    assert prose.and_join(prose.ranges([*range(16, 44), 45, 50, 51, 52])) == "16–43, 45 and 50–52"
    assert prose.ranges([44, 46, 47]) == ["44", "46, 47"]


def test_a_stale_number_in_the_findings_page_is_caught(committed, tmp_path):
    page = prose.FINDINGS_PAGE.read_text()
    assert "exact sign-flip p 1.34e-06" in page
    copy = tmp_path / "findings.md"
    copy.write_text(page.replace("exact sign-flip p 1.34e-06", "exact sign-flip p 7.63e-06"))
    problems = prose.check(v=committed, findings=copy)
    assert len(problems) == 1
    assert problems[0].startswith("findings.md: missing:")
