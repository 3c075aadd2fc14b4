"""What ``klgrad audit --framework`` prints and the docs say about it: one name per gradient everywhere (the
audit's rows, docs/frameworks.md, the other pages, ``klgrad audit --help``), preset ids and gradient names printed
whole at any terminal width, and each framework's remedy as that framework's own flags or code, to paste."""

from __future__ import annotations

import ast
import io
import re
import warnings
from pathlib import Path

import pytest

from klgrad.audit import AUDIT_NAMES
from klgrad.audit.frameworks import framework_rows, gradient_name, print_framework_table, select
from klgrad.audit.presets import PRESETS
from klgrad.audit.remedies import REMEDIES
from klgrad.audit.run import AuditConfig, make_problem
from klgrad.cli import main
from klgrad.config import load_config, parse_override_args
from klgrad.kl import KL_HEADS
from tests.helpers.extras import needs_extras

DOCS = Path(__file__).parents[2] / "docs"
IDS = {p.id for p in PRESETS}
NAME = re.compile(r"\b([a-z0-9_]+)@(sequence|token_to_go|token)\b(?!/)")
"""``head@level`` under a token sum: the audit's way of naming a gradient (a method's ``head@β`` in ``klgrad
compare`` is not one; ``head@level/|y|``, under a per-sequence mean, is named by its own ties)."""


@pytest.fixture(scope="module")
def all_rows() -> list[dict]:
    return framework_rows(make_problem(AuditConfig()))


def on_policy_name(rows: list[dict], pid: str) -> str:
    """The audit's name of ``pid``'s on-policy gradient at its framework's default aggregation."""
    (hit,) = [r for r in rows if r["id"] == pid and r["regime"] == "on_policy" and r["framework_default_aggregation"]]
    return hit["equals"]


def test_one_name_per_gradient_in_the_audit(all_rows) -> None:
    """Heads with one target have one gradient, so one name: the TRL default's per-step reverse KL is
    k2_as_loss@token (local_rkl), as docs/trl.md's twin says, never k1_in_reward@token (before the change the audit
    named it so, and k1_in_reward is the name readers know as exact)."""
    names = {r["equals"] for r in all_rows}
    assert on_policy_name(all_rows, "trl/grpo-k3-bias-correction") == "k2_as_loss@token (local_rkl)"
    assert not any(n.startswith("k1_in_reward@") or "≈ k1_in_reward@" in n for n in names)
    for head, h in KL_HEADS.items():  # the rule the audit follows, for every head and level
        for level, target in h.targets.items():
            if target is not None:
                assert gradient_name(head, level).endswith(f"({target})")
    assert gradient_name("k1_in_reward", "token") == "k2_as_loss@token (local_rkl)"
    assert gradient_name("k1_in_reward", "token_to_go") == "k2_as_loss@sequence (rkl)"
    assert gradient_name("k1_as_loss", "sequence") == "none@sequence (zero)"


def test_docs_and_the_audit_agree_on_every_preset_s_gradient_name(all_rows) -> None:
    """docs/frameworks.md: every row's name is the audit's for its preset, aggregation and regime (a stale page
    fails here and in the fresh-run test). Every other page: a line naming a preset id and a gradient gives the
    audit's name for that preset; and every ``head@level`` anywhere in the docs is the gradient's one name."""
    by_key = {(r["id"], r["aggregation"], r["regime"].replace("_", "-")): r["equals"] for r in all_rows}
    page = (DOCS / "frameworks.md").read_text(encoding="utf-8")
    checked = set()
    for line in page.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) < 8 or not (m := re.fullmatch(r"\|? ?(?:★ )?`([^`]+)`", cells[0])) or m[1] not in IDS:
            continue
        key = (m[1], cells[3], cells[4])
        assert cells[7].strip("`").replace("\\|", "|") == by_key[key], key
        checked.add(m[1])
    assert checked == IDS  # every preset has a row
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for line in text.splitlines():
            ids = [i for i in re.findall(r"`([a-z0-9.-]+/[a-z0-9.-]+)`", line) if i in IDS]
            names = re.findall(r"`((?:≈ )?[a-z0-9_]+@[a-z_]+(?:/\\?\|y\\?\|)?(?: \([^`]*\))?)`", line)
            if path.name != "frameworks.md" and len(ids) == 1 and names:  # a table row or sentence about one preset
                assert names[0] == on_policy_name(all_rows, ids[0]), (path.name, line[:120])
        for head, level in NAME.findall(text):
            if head in KL_HEADS and KL_HEADS[head].targets.get(level) is not None:
                assert gradient_name(head, level).startswith(f"{head}@{level} "), (path.name, f"{head}@{level}")


def test_the_help_names_gradients_as_the_audit_does(all_rows, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert " ".join(AUDIT_NAMES.split()) in help_text.replace("per- step", "per-step")
    for pid in ("trl/grpo-k3-bias-correction", "trl/rloo-k1-reward", "trl/grpo-k3"):
        assert on_policy_name(all_rows, pid) in AUDIT_NAMES, pid
    assert on_policy_name(all_rows, "verl/kl-loss-k1") in AUDIT_NAMES  # none@sequence (zero)
    for head, level in NAME.findall(AUDIT_NAMES):
        assert gradient_name(head, level).startswith(f"{head}@{level} ")


@pytest.mark.parametrize("width", [40, 80, 120, 160, 250])
def test_preset_ids_and_gradient_names_print_whole_at_any_width(all_rows, width: int) -> None:
    """Before the change the table cut ids at its column width (trl/grpo-k3-bias-corr… for two presets) and broke
    names over lines. Now each shown id and name is on one line, whole; nothing is cut (no ellipsis)."""
    from rich.console import Console

    buf = io.StringIO()
    print_framework_table(all_rows, Console(file=buf, width=width, color_system=None))
    out = buf.getvalue()
    lines = out.splitlines()
    assert "…" not in out
    shown = [r for r in all_rows if r["framework_default_aggregation"] or r["regime"] == "on_policy"]
    for r in shown:
        assert any(re.search(rf"(^|[ ★│]){re.escape(r['id'])}($|[ │])", line) for line in lines), (width, r["id"])
        assert any(r["equals"] in line for line in lines), (width, r["equals"])


@pytest.mark.parametrize("remedy", REMEDIES, ids=lambda r: r.framework)
def test_each_remedy_is_the_framework_s_own_flags_or_code(remedy) -> None:
    """No Markdown (before the change TRL's ended in ``([trl.md](trl.md))``); each line a ``#`` comment or a line
    of the framework's syntax."""
    assert remedy.paste
    assert all(line.strip() for line in remedy.paste)
    assert not any("](" in line or "`" in line for line in remedy.paste)
    assert remedy.code or remedy.claim in ("none", "local_rkl")  # no exact flags: the comment says what is nearest
    for line in remedy.code:
        if remedy.syntax == "Python":
            ast.parse(line)
        elif remedy.syntax == "Hydra overrides":
            assert all(re.fullmatch(r"[a-z_][\w.]*=\S+", word) for word in line.split()), line
        elif remedy.syntax in ("command-line flags", "klgrad train flags"):
            assert line.startswith("--"), line
        else:
            assert remedy.syntax == "YAML", remedy
            assert re.fullmatch(r" *[a-z_]+:( \S+)?", line), line
    if remedy.syntax == "klgrad train flags":
        assert load_config(None, parse_override_args(remedy.code[0].split())).kl.head == "k2_as_loss"


@needs_extras("trl")  # the audit of TRL reads the installed TRL's version
@pytest.mark.parametrize("framework", ["trl", "verl"])
def test_the_audit_prints_the_remedy_to_paste(framework: str, tmp_path, capsys) -> None:
    """The block under the tables is the remedy's lines, whole however long (no wrapping into the terminal's
    width), after a header that names the syntax and the audited claim."""
    (remedy,) = [r for r in REMEDIES if r.framework == framework]
    assert main(["audit", "--framework", framework, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    block = out[out.index(f"The exact reverse-KL gradient in {framework} ({remedy.syntax}); audited: ") :]
    lines = block.split("\nwrote ")[0].rstrip("\n").splitlines()
    assert lines[1:] == ["    " + line for line in remedy.paste]
    assert "rel. err vs ∇RKL, on-policy <1e-12" in lines[0]


@needs_extras("trl")
def test_trl_s_remedy_builds_with_the_real_trl() -> None:
    """The pasted TRL lines are real: ``RLOOConfig(beta=0.05, num_iterations=1)`` builds TRL's config, the
    ``KLGradTRLConfig(...)`` of the GRPO line builds klgrad's."""
    from trl import RLOOConfig

    from klgrad.integrations.trl import KLGradTRLConfig

    def call(line: str, name: str) -> dict:
        """The keyword arguments of the call to ``name`` in ``line``, literal values."""
        (node,) = [n for n in ast.walk(ast.parse(line)) if isinstance(n, ast.Call) and n.func.id == name]
        return {k.arg: ast.literal_eval(k.value) for k in node.keywords}

    (remedy,) = [r for r in REMEDIES if r.framework == "trl"]
    rloo, _imports, grpo = remedy.code
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL's own default names transformers' deprecated flag
        config = RLOOConfig(**call(rloo, "RLOOConfig"), use_cpu=True, bf16=False, report_to="none")  # + this CPU
    assert (config.beta, config.num_iterations) == (0.05, 1)
    cfg = KLGradTRLConfig(**call(grpo, "KLGradTRLConfig"))
    assert (cfg.head, cfg.level) == ("k2_as_loss", "sequence")
    assert select("trl", "1.16.0")  # the remedy's preset holds for the installed release
