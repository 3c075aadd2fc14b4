"""Generated docs: docs/math.md equals what ``python -m klgrad.docs`` writes from the code, and every head,
level, form, ratio level and aggregation the code knows is described there."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from klgrad import docs
from klgrad.choices import FORMS, LEVELS
from klgrad.kl import KL_HEADS, Target

ROOT = Path(__file__).parents[1]


def test_docs_math_is_up_to_date():
    committed = (ROOT / "docs" / "math.md").read_text(encoding="utf-8")
    assert committed == docs.math_markdown(), "docs/math.md is stale: run `python -m klgrad.docs`"


def test_docs_frameworks_carries_the_numbers_of_a_fresh_audit_run():
    from klgrad.audit.frameworks_doc import frameworks_markdown

    committed = (ROOT / "docs" / "frameworks.md").read_text(encoding="utf-8")
    assert committed == frameworks_markdown(), "docs/frameworks.md is stale: run `python -m klgrad.docs`"


def test_head_table_has_one_complete_row_per_registered_head():
    rows = docs.head_table().splitlines()[2:]
    assert [re.match(r"\| `([^`]+)`", r).group(1) for r in rows] == list(KL_HEADS)
    for h in KL_HEADS.values():
        assert h.coefficient_formula, h.name
        assert h.verdict, h.name
        assert (h.penalty_formula == "—") == (h.style != "as_loss"), h.name


def test_head_table_rows_read_as_the_heads_table():
    # the two rows whose verdicts the paper is about, cell by cell
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in docs.head_table().splitlines()}
    assert rows["`k2_as_loss`"] == ["as loss", "`½(l - r)²`", "`u`", "exact; per-sample identical to k1_in_reward"]
    assert rows["`k3_as_loss`"][:3] == ["as loss", "`exp(r - l) - 1 + (l - r)`", "`1 - exp(-u)`"]


def test_every_choice_in_the_code_is_described():
    assert set(docs.LEVEL_TEXT) == set(LEVELS)
    assert set(docs.FORM_TEXT) == set(FORMS)
    assert set(docs.TARGET_TEXT) == set(get_args(Target))
    text = docs.math_markdown()
    for h in KL_HEADS.values():
        for target in h.targets.values():
            assert target is None or f"`{target}`" in text


def test_a_choice_without_a_description_fails_loudly():
    with pytest.raises(KeyError, match="out of step"):
        docs._bullets({"a": "x"}, ("a", "b"))


def test_write_all_writes_both_generated_files(tmp_path):
    (tmp_path / "docs").mkdir()
    paths = docs.write_all(tmp_path)
    assert [p.name for p in paths] == ["math.md", "configuration.md", "frameworks.md"]
    assert paths[0].read_text(encoding="utf-8") == docs.math_markdown()
    assert paths[1].read_text(encoding="utf-8") == (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["index.md", "quickstart.md", "math.md", "vllm.md", "frameworks.md", "eval.md"])
def test_relative_links_resolve(name):
    page = ROOT / "docs" / name
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8"))
    optional = {"trl.md", "verl.md", "performance.md", "distributed.md"}  # written in parallel by others
    for link in links:
        if "://" in link or (link in optional and not (page.parent / link).exists()):
            continue
        assert (page.parent / link).exists(), f"{name}: broken link {link}"


def _prose(page: str) -> str:
    """A page's text outside its code blocks."""
    return re.sub(r"```.*?```", "", (ROOT / "docs" / page).read_text(encoding="utf-8"), flags=re.S)


def test_metrics_says_what_loss_kl_is_on_and_off_policy():
    """Off-policy ``loss/kl`` is ``kl/k1`` and can be negative (−0.0225 seen in TRL with num_iterations=2): the row
    says why, on- and off-policy, and the TRL page's metrics table points there."""
    (row,) = [line for line in _prose("metrics.md").splitlines() if line.startswith("| `loss/kl` |")]
    for words in ("On-policy", "Off-policy", "`kl/k2`", "`kl/k1`", "negative", "surrogate", "ρ = 1"):
        assert words in row, words
    (trl_row,) = [line for line in _prose("trl.md").splitlines() if line.startswith("| `loss/kl` |")]
    assert "metrics.md" in trl_row
    assert "negative" in trl_row


def test_trl_page_states_the_bos_prefix_in_prose():
    """The embedded model's prompts start with its BOS token: said in the text, not only in a code comment."""
    prose = _prose("trl.md")
    assert "**The BOS prefix.**" in prose
    assert "`tokenizer.bos_token`" in prose
    assert "tokenizer adds no BOS" in prose
