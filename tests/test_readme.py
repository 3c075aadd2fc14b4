"""README.md's first table, "What your framework's KL does", cell by cell against the audit: each row's default
term is a preset that is its framework's default in the stated versions, its gradient is what the audit computes
for that preset on-policy (the named target and the rel. error as printed), and its remedy is a preset or head that
the audit finds exact, written with the framework's own flags or code of its remedy (klgrad.audit.remedies, what
`klgrad audit --framework` prints to paste)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from klgrad.audit.frameworks import fmt_error, framework_rows
from klgrad.audit.presets import PRESETS
from klgrad.audit.remedies import REMEDIES
from klgrad.audit.run import AuditConfig, make_problem

README = Path(__file__).resolve().parents[1] / "README.md"
TARGETS = {"local_fkl": "per-step **forward** KL", "local_rkl": "per-step reverse KL", "rkl": "exact reverse KL"}
"""The audit's target of a preset's gradient (the bracket of its ``equals``) -> the README's words for it."""
REMEDY_PRESETS = {"TRL": "trl/rloo-k1-reward", "verl": "verl/kl-reward-gae", "OpenRLHF": "openrlhf/k1-reward"}
"""The preset behind each framework's remedy cell (docs/frameworks.md's remedy table names the same)."""


def table() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## What your framework's KL does", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| framework")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


@pytest.fixture(scope="module")
def audit() -> dict[str, dict]:
    rows = framework_rows(make_problem(AuditConfig()))
    return {r["id"]: r for r in rows if r["regime"] == "on_policy" and r["framework_default_aggregation"]}


def test_the_table_is_on_the_first_screen_and_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150
    assert next(i for i, line in enumerate(lines) if line.startswith("| framework (version)")) < 40


def test_each_framework_row_is_what_the_audit_computes(audit):
    rows = [r for r in table() if not r[0].startswith("klgrad")]
    assert [r[0].split()[0] for r in rows] == ["TRL", "TRL", "verl", "OpenRLHF"]
    by_id = {p.id: p for p in PRESETS}
    for framework, term, gradient, remedy, caveat in rows:
        pid = re.match(r"`([^`]+)`", term).group(1)
        preset, row = by_id[pid], audit[pid]
        assert preset.default, f"{pid} is no framework's default"
        version = re.search(r"\((.+)\)", framework).group(1).replace("≥ ", ">=").replace("< ", "<")
        assert version in preset.default, (pid, version, preset.default)
        target = re.search(r"\((\w+)\)$", row["equals"]).group(1)
        assert gradient.startswith(TARGETS[target]), (pid, gradient, row["equals"])
        assert f"rel. error {fmt_error(row['err_rkl'])}" in gradient, (pid, gradient, row["err_rkl"])
        assert ("token mean" in caveat) == (preset.aggregation == "token_mean" and preset.style == "loss")
        fw = preset.framework
        flags = " ".join(" ".join(m.paste) for m in REMEDIES if m.framework == fw)
        remedy_id = REMEDY_PRESETS[framework.split()[0]]
        assert audit[remedy_id]["err_rkl"] < 1e-12, remedy_id
        assert remedy_id in {m.preset for m in REMEDIES if m.framework == fw}
        for flag in re.findall(r"`([^`]+)`", remedy):
            words = re.findall(r"[A-Za-z_][A-Za-z_.]*", flag)
            named = [w.split(".")[-1] for w in words if "_" in w or w.endswith("Trainer")]  # keys, flags, trainers
            assert all(n in flags or n in ("KLGradGRPOTrainer", "k2_as_loss", "sequence") for n in named), (fw, flag)


def test_klgrads_own_row_is_exact():
    from klgrad.audit.run import audit_rows
    from klgrad.kl import KL_HEADS

    (row,) = [r for r in table() if r[0] == "klgrad"]
    assert row[1] == "`k2_as_loss` at `sequence` level"
    assert row[2].startswith("exact reverse KL")
    rows = audit_rows(make_problem(AuditConfig()), {"k2_as_loss": KL_HEADS["k2_as_loss"]}, clip_eps=0.2)
    k2 = next(r for r in rows if r["level"] == "sequence" and r["regime"] == "on_policy")
    assert k2["err_rkl"] < 1e-12
