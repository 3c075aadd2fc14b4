"""Exact audit rows of the analytic KL head and the per-decision ratio (float64, through the trainer's loss code)."""

from __future__ import annotations

from klgrad.audit.analytic import exact_heads_audit
from klgrad.audit.run import AuditConfig, AuditProblem, make_problem, stale_trajectory

EXACT = 1e-12
"""float64 enumeration over 121 responses: each gradient entry is a sum of O(10^2) terms of size O(1), so its
rounding is ~10^2 · 2^-53 ≈ 1e-14 relative; 1e-12 leaves two orders of margin."""


def _audit():
    cfg = AuditConfig()
    base = make_problem(cfg)
    thetas = stale_trajectory(base, 4, cfg.stale_lr, cfg.beta)
    problem = AuditProblem(base.space, thetas[-1], base.ref, base.behaviour, base.rewards)
    return exact_heads_audit(problem, thetas[0])


def test_audit_rows_exact():
    result = _audit()
    assert {r["regime"] for r in result["analytic"]} == {"on_policy", "stale", "perturbed", "engine"}
    for row in result["analytic"]:  # every level against its target (token: the local KL's gradient)
        assert row["err_target"] <= EXACT, row
    for row in result["per_decision"]:
        if row["ratio"] in ("sequence", "per_decision"):
            assert row["err_rkl"] <= EXACT, row
        if row["ratio"] == "token" and row["regime"] != "engine":
            assert row["err_rkl"] > 0.1, row  # the token ratio is biased (prefix mismatch ignored)
    capped = [r for r in result["per_decision"] if r["ratio"] == "per_decision_capped" and r["regime"] == "perturbed"]
    assert all(r["err_rkl"] > 1e-3 for r in capped)  # truncation at C = 2 bites: biased, and reported
