"""The audit end to end: CLI, files, numbers, user penalties, bad input.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from klgrad.audit.presets import PRESETS
from klgrad.audit.run import AUDIT_HEADS, AuditConfig, headline, load_penalty, run_audit
from klgrad.cli import main
from klgrad.kl import KL_HEADS

pytestmark = [pytest.mark.filterwarnings("ignore:k1_as_loss has zero expected gradient"), pytest.mark.numerics]

SMALL = ["--vocab", "3", "--length", "3"]


@pytest.fixture(scope="module")
def small_result():
    return run_audit(AuditConfig(vocab=3, length=3, sweep=(0.1, 1.0)))


def test_audit_numbers_show_the_papers_claims(small_result):
    h = headline(small_result)
    assert h["k1_in_reward/sequence err_rkl"] < 1e-12
    assert h["k2_as_loss/sequence err_rkl"] < 1e-12
    assert h["k2_as_loss/token_to_go err_rkl"] < 1e-12
    assert h["k2_as_loss/token err_rkl"] > 1e-2
    assert h["k3_as_loss/sequence err_rkl"] > 1e-2
    assert h["k1_as_loss/sequence grad_norm"] < 1e-12
    assert h["k2_as_loss/sequence off-policy is_seq err"] < 1e-12
    assert h["k2_as_loss/sequence off-policy no_is err"] > 1e-2
    for r in small_result["forms"]:
        assert r["err_combined"] < 1e-12, r
        assert r["err_decoupled"] < 1e-12, r
    rows = small_result["rows"]
    assert len(rows) == len(AUDIT_HEADS) * 3 * 5 == 9 * 3 * 5
    for r in rows:  # every documented on-policy target is hit
        if r["regime"] == "on_policy" and r["target"] is not None:
            assert r["err_target"] < 1e-10, r
    # the frameworks' section rides along: every preset at two aggregations, both regimes (π_old-reference
    # presets off-policy only)
    assert len(small_result["frameworks"]) == sum(2 * len(p.regimes) for p in PRESETS)


def test_sweep_shows_k3_bias_growing_with_distance(small_result):
    errs = small_result["sweep"]["err_rkl"]
    assert errs["k3_as_loss"][0] < errs["k3_as_loss"][1]
    assert max(errs["k2_as_loss"]) < 1e-12


def test_cli_audit_writes_files_and_audits_a_user_penalty(tmp_path, monkeypatch, capsys):
    mod = tmp_path / "my_penalties.py"
    mod.write_text(
        textwrap.dedent('''
        def quartic(logp, ref_logp):
            """psi = (l - r)^4 / 4, coefficient (l - r)^3"""
            return (logp - ref_logp) ** 4 / 4
    ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "audit"
    assert main(["audit", "--out", str(out), *SMALL, "--penalty", "my_penalties:quartic"]) == 0
    data = json.loads((out / "audit.json").read_text())
    heads = {r["head"] for r in data["rows"]}
    assert "custom:my_penalties:quartic" in heads
    for name in ("audit.png", "coefficients.png", "coefficients.json"):
        blob = (out / name).read_bytes()
        assert len(blob) > 1000
    assert (out / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "On-policy expected gradient" in printed
    assert "Headline" in printed
    assert all(math.isfinite(r["err_rkl"]) for r in data["rows"])


def test_audit_takes_a_klhead_as_kl_head_does_and_audits_that_very_head(tmp_path, monkeypatch):
    """``--penalty MODULE:NAME`` loads what ``kl.head: MODULE:NAME`` trains (a KLHead as it is, not only a penalty
    function): a user's KLHead that is k2_as_loss under another name gets k2_as_loss's rows, number for number."""
    (tmp_path / "my_heads.py").write_text(
        "import dataclasses\nfrom klgrad.kl import KL_HEADS\n"
        "half_square = dataclasses.replace(KL_HEADS['k2_as_loss'], name='half_square')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    head = load_penalty("my_heads:half_square")
    assert head.name == "half_square"
    assert head.coefficient_fn is KL_HEADS["k2_as_loss"].coefficient_fn
    cfg = AuditConfig(vocab=3, length=3)  # SMALL
    rows = run_audit(cfg, penalty="my_heads:half_square")["rows"]
    mine = [r for r in rows if r["head"] == "custom:my_heads:half_square"]
    k2 = [r for r in rows if r["head"] == "k2_as_loss"]
    assert len(mine) == len(k2) > 0
    for a, b in zip(mine, k2, strict=True):
        assert (a["level"], a["regime"], a["err_rkl"]) == (b["level"], b["regime"], b["err_rkl"])


@pytest.mark.parametrize("spec", ["nomodule", "json:does_not_exist", "no_such_module_xyz:f"])
def test_bad_penalty_spec_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="penalty"):
        load_penalty(spec)


def test_cli_rejects_bad_config_with_named_field(tmp_path, capsys):
    assert main(["audit", "--out", str(tmp_path), "--vocab", "1"]) == 2
    assert "vocab" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written before validation passes


def test_python_dash_m_and_help():
    out = subprocess.run([sys.executable, "-m", "klgrad", "--help"], capture_output=True, text=True, check=True)
    assert "audit" in out.stdout
    for cmd in ("audit", "reproduce"):
        out = subprocess.run(
            [sys.executable, "-m", "klgrad", cmd, "--help"], capture_output=True, text=True, check=True
        )
        assert "usage" in out.stdout


def test_stale_rollouts_are_exact_with_the_old_policys_logprobs_and_wrong_with_the_current_ones(small_result):
    """Staleness k = 1 and 4: samples from θ_{t−k}, the policy k exact gradient steps before θ_t. Every built-in
    head at every level it has a target at: the library's loss fed θ_{t−k}'s log-probs (sequence IS) gives the
    on-policy target's gradient at θ_t to float64 round-off; fed θ_t's own log-probs in their place (a stale
    trainer reusing its current forward) it is off by more than 1e-2 of ‖∇KL‖ (measured ≥ 0.05 at k = 1), and
    the combined and decoupled forms with sequence IS are exact too."""
    stale = small_result["staleness"]
    rows = stale["rows"]
    assert sorted({r["staleness"] for r in rows}) == [1, 4]
    expected = {(h, lv) for h in AUDIT_HEADS for lv, t in KL_HEADS[h].targets.items() if t is not None}
    for k in (1, 4):
        assert {(r["head"], r["level"]) for r in rows if r["staleness"] == k} == expected
    for r in rows:
        if r["regime"] == "is_seq":
            assert r["err_target"] < 1e-12, r
        if r["regime"] == "current_logp":
            assert r["err_target"] > 1e-2, r
    assert len(stale["forms"]) == 2 * 6
    for r in stale["forms"]:
        assert r["err_combined"] < 1e-12, r
        assert r["err_decoupled"] < 1e-12, r
    d1, d4 = stale["distances"]["1"], stale["distances"]["4"]
    assert 0 < d1["behaviour_kl"] < d4["behaviour_kl"]  # four steps back is further than one


def test_cli_staleness_flag(tmp_path, capsys):
    assert main(["audit", "--out", str(tmp_path / "a"), *SMALL, "--staleness", "none"]) == 0
    assert json.loads((tmp_path / "a" / "audit.json").read_text())["staleness"]["rows"] == []
    assert main(["audit", "--out", str(tmp_path / "b"), *SMALL, "--staleness", "0"]) == 2
    assert main(["audit", "--out", str(tmp_path / "c"), *SMALL, "--staleness", "x"]) == 2
    assert "staleness" in capsys.readouterr().err
