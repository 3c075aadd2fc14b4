"""sharpen_prose.py: the sharpening grid's prose (its README, README.md, docs/reproduction.md) quotes the
numbers its committed files hold, a changed number is caught, and ``update`` rewrites the quotes from one grid's
values to another's, appending the merge to the held-out test's history and refusing words that turn false."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sharpen_prose", Path(__file__).resolve().parent / "sharpen_prose.py")
prose = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prose)

GRID = ROOT / "experiments" / "smollm2_sharpen_converged"
FILES = ("summary.json", "noise.json", "prediction.json", "optimum_summary.json", "downstream.json", "primary.json")


def copy_docs(root: Path) -> Path:
    for rel in (prose.G, prose.R, prose.D):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    return root


def copy_grid(dst: Path) -> Path:
    """The files :func:`values` reads, nothing else (no weights, no completions)."""
    for name in FILES:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(GRID / name, dst / name)
    for run in (GRID / "runs").iterdir():
        (dst / "runs" / run.name).mkdir(parents=True)
        shutil.copy(run / "metrics.jsonl", dst / "runs" / run.name / "metrics.jsonl")
    return dst


def test_the_committed_prose_quotes_the_committed_grid():
    assert prose.check() == []


def test_a_stale_number_is_caught(tmp_path):
    root = copy_docs(tmp_path)
    v = prose.derived(prose.values(GRID))
    readme = root / prose.R
    quoted = f"({v['ho']} nats over {v['N']} seeds"
    assert readme.read_text().count(quoted) == 1
    readme.write_text(readme.read_text().replace(quoted, f"({v['ho']} nats over {int(v['N']) - 2} seeds"))
    problems = prose.check(root=root)
    assert len(problems) == 1
    assert problems[0].startswith(prose.R)


def test_update_rewrites_every_quote_and_appends_the_merge(tmp_path):
    root = copy_docs(tmp_path / "repo")
    new = copy_grid(tmp_path / "grid")
    s = json.loads((new / "summary.json").read_text())
    n = s["seeds"] + 2
    s["seeds"] = n
    ho = next(p for p in s["predictions"] if p["metric"] == "stepwise_kl")
    ho.update(mean_difference=0.0304, ci95=[0.0111, 0.0496], p_adjusted=0.00123, n_negative=9)
    (new / "summary.json").write_text(json.dumps(s))

    assert prose.update(GRID, root=root, grid=new) == []
    readme, grid_readme = (root / prose.R).read_text(), (root / prose.G).read_text()
    assert f"(+0.030 [+0.011, +0.050] nats over {n} seeds, Holm p 0.0012 in the secondary family" in readme
    old = prose.HISTORY.format_map(prose.derived(prose.values(GRID)))
    assert f"{old}; {n} seeds: +0.030 [+0.011, +0.050], Holm p 0.0012, opposite), and nothing corrects" in grid_readme
    assert f", {n - 2}, {n} seeds, not at 10 (0.055)" in (root / prose.D).read_text()
    assert prose.check(root=root, grid=new) == []
    assert prose.check(root=root) != []  # the copy no longer quotes the committed grid


def test_update_refuses_words_that_turn_false(tmp_path):
    root = copy_docs(tmp_path / "repo")
    new = copy_grid(tmp_path / "grid")
    s = json.loads((new / "summary.json").read_text())
    next(p for p in s["predictions"] if p["metric"] == "reward_std_in_group")["verdict"] = "not resolved"
    (new / "summary.json").write_text(json.dumps(s))
    problems = prose.update(GRID, root=root, grid=new)
    assert any("rs_verdict" in p for p in problems)


def test_update_writes_nothing_when_a_quote_is_missing(tmp_path):
    root = copy_docs(tmp_path)
    before = {rel: (root / rel).read_text() for rel in (prose.G, prose.R, prose.D)}
    (root / prose.D).write_text(before[prose.D].replace("At ", "By "))
    with pytest.raises(ValueError, match=prose.D):
        prose.update(GRID, root=root)
    assert (root / prose.R).read_text() == before[prose.R]


@pytest.mark.parametrize(
    ("p", "text"), [(4.08e-05, "4.1e-05"), (0.002173, "0.0022"), (0.01087, "0.011"), (0.3346, "0.33")]
)
def test_p_values_are_written_as_the_prose_writes_them(p, text):
    assert prose.pf(p) == text


def test_a_lower_bound_rounds_down():
    assert prose.pfloor(0.06975) == "0.069"  # "p ≥ 0.07" would be false
    assert prose.pfloor(0.5) == "0.50"


def test_seed_ranges():
    assert prose.and_join(prose.ranges([*range(16, 44), 45, 50, 51, 52])) == "16–43, 45 and 50–52"
    assert prose.ranges([44, 46, 47]) == ["44", "46, 47"]
