"""The hand-written reference pages stay true to the code: docs/metrics.md names every key the trainer writes
(and no key it does not), docs/api.md every name ``klgrad`` exports, and their example and links work."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import klgrad

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
KEY = re.compile(r"[a-z_]+/[A-Za-z0-9_]+")


def trainer_keys() -> set[str]:
    """Metric keys in the trainer package (src/klgrad/trainer/): every "namespace/name" string, the keys of the
    per-step record literal ``record = {...}`` (which holds the un-namespaced ones: step, entropy, beta, ...) and
    ``time/<phase>`` for every ``clock.mark("<phase>")`` of the loop."""
    trees = [
        ast.parse(f.read_text(encoding="utf-8")) for f in sorted((ROOT / "src" / "klgrad" / "trainer").glob("*.py"))
    ]
    nodes = [n for tree in trees for n in ast.walk(tree)]
    keys = {
        n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str) and KEY.fullmatch(n.value)
    }
    records = [
        n.value
        for n in nodes
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "record" for t in n.targets)
        and isinstance(n.value, ast.Dict)
    ]
    assert len(records) == 1, "expected one per-step record literal `record = {...}` in the trainer package"
    keys |= {k.value for k in records[0].keys if isinstance(k, ast.Constant)}
    keys |= {
        f"time/{n.args[0].value}"
        for n in nodes
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "mark" and n.args
    }
    return keys


def documented_keys(text: str) -> set[str]:
    """The keys in the first column of docs/metrics.md's tables (a cell may name several)."""
    keys: set[str] = set()
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[1].strip().startswith("`"):
            keys |= set(re.findall(r"`([^`]+)`", cells[1]))
    return keys


def test_trainer_keys_are_found_in_the_trainer_package():
    keys = trainer_keys()
    assert {
        "time/rollout",
        "time/update",
        "step",
        "reward/mean",
        "kl/k1",
        "entropy",
        "eval/J",
        "mismatch/capped_frac",
    } <= keys


def test_every_key_the_trainer_writes_is_documented():
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    missing = sorted(k for k in trainer_keys() if f"`{k}`" not in text)
    assert not missing, f"docs/metrics.md does not describe {missing}"


def test_every_documented_key_is_written_by_the_trainer():
    documented = documented_keys((DOCS / "metrics.md").read_text(encoding="utf-8"))
    assert "kl/k1" in documented
    stale = sorted(k for k in documented if "<" not in k and k not in trainer_keys())
    assert not stale, f"docs/metrics.md describes keys the trainer no longer writes: {stale}"


def test_every_exported_name_is_in_the_api_page():
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [name for name in klgrad.__all__ if not re.search(rf"`{re.escape(name)}[`(]", text)]
    assert not missing, f"docs/api.md does not describe {missing}"


def test_api_page_example_runs():
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(code, "docs/api.md", "exec"), namespace)
    assert namespace["loss"].dim() == 0
    assert namespace["logp"].grad is not None
    assert namespace["adv"].shape == (4,)


@pytest.mark.parametrize("name", ["metrics.md", "api.md"])
def test_relative_links_resolve(name):
    page = DOCS / name
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
        if "://" not in link:
            assert (page.parent / link).exists(), f"{name}: broken link {link}"
