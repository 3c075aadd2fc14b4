"""klgrad.fmt.fmt_num: each table style in fmt.py's docstring matches a plain reference formatter for that style."""

from __future__ import annotations

import math

import pytest

from klgrad.fmt import fmt_num

VALUES = [0.0, -0.0, 1e-17, -3e-16, 2.5e-13, 1e-12, 4.2e-9, 9.99e-4, 1e-3, 0.0042, 0.00999, 0.01, 0.5, -0.75,
          1.0, 3.14159265, 999.4, 1000.0, 9999.4, 1e4, -2.5e5, 1.2e8]  # fmt: skip


def ref_verdict_fmt(x, nd=4):  # default style: k3-gaussian / k3-uniform-bias verdicts
    if isinstance(x, str):
        return {"inf": "∞", "-inf": "-∞"}.get(x, x)
    if not math.isfinite(x):
        return "∞" if x > 0 else ("-∞" if x < 0 else "nan")
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.{max(nd - 1, 1)}e}"
    return f"{x:.{nd}f}"


def ref_fixed_points_fmt(x):  # fixed-points distances at float64 round-off
    if abs(x) < 1e-15:
        return "< 1e-15"
    return f"{x:.1e}" if abs(x) < 1e-3 else f"{x:.4f}"


def ref_audit_fmt(x):  # relative errors of the gradient audit
    if x is None:
        return "—"
    if x == 0 or (abs(x) < 1e-12):
        return "<1e-12" if x != 0 else "0"
    return f"{x:.2e}" if abs(x) < 1e-2 or abs(x) >= 1e3 else f"{x:.3f}"


@pytest.mark.parametrize("x", VALUES)
def test_styles_match_their_reference_formatters(x):
    assert fmt_num(x) == ref_verdict_fmt(x)
    assert fmt_num(x, 2) == ref_verdict_fmt(x, 2)
    assert fmt_num(x, 4, sci_digits=1, sci_from=math.inf, tiny=1e-15, tiny_text="< 1e-15") == ref_fixed_points_fmt(x)
    audit = fmt_num(x, 3, sci_digits=2, sci_below=1e-2, sci_from=1e3, tiny=1e-12, tiny_text="<1e-12", zero="0")
    assert audit == ref_audit_fmt(x)
    assert fmt_num(x, 3, significant=True) == f"{x:.3g}"


def test_hand_values():
    assert fmt_num(0.123456) == "0.1235"
    assert fmt_num(0.000123456) == "1.235e-04"
    assert fmt_num(123456.0) == "1.235e+05"
    assert fmt_num(0.0) == "0.0000"  # zero is never scientific
    assert fmt_num(3e-16, tiny=1e-15, tiny_text="< 1e-15") == "< 1e-15"
    assert fmt_num(0.0, zero="0", tiny=1e-12, tiny_text="<1e-12") == "0"
    assert fmt_num(1234.5, 3, significant=True) == "1.23e+03"


def test_non_finite_and_missing():
    cases = ((math.inf, "∞"), (-math.inf, "-∞"), (math.nan, "nan"), ("inf", "∞"), ("-inf", "-∞"), ("nan", "nan"))
    for x, text in cases:
        assert fmt_num(x) == text
        assert fmt_num(x, 3, significant=True) == text
    assert fmt_num("n/a") == "n/a"
    assert fmt_num(None) == "—"
    assert fmt_num(None, missing="") == ""
    assert ref_audit_fmt(None) == fmt_num(None)
