"""The audit's precision axis (klgrad.audit.precision): `klgrad audit --dtype` rows, the ranges it reports, and the
claims docs/frameworks.md (“Precision”) makes from them.

Tolerances. The ρ·k3 values at single points are exact outputs of the dtype's arithmetic (checked for equality:
e.g. float32's −17 → −16 is e^{17} ≈ 2.4e7 rounded to float32's spacing of 2 there, then the cancellation). A term
"survives" a dtype when its largest relative error is within one rounding of the result, u_d (bfloat16 2^-8,
float16 2^-11, float32 2^-24), plus the float32 work of klgrad's heads, 40·2^-24 (the largest κ + m of
tests/kl/test_precision.py, which derives it).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from klgrad.audit.precision import (
    DTYPES,
    head_gradient,
    head_precision,
    log_prob_pairs,
    log_ratio_grid,
    precision_report,
    preset_gradient,
    preset_precision,
    u_ranges,
)
from klgrad.audit.precision_doc import RHO_K3, RHO_K3_CLAMPED, gradient_at, precision_reports, short_cell
from klgrad.audit.presets import PRESETS
from klgrad.cli import main
from klgrad.kl import KL_HEADS

pytestmark = [pytest.mark.numerics, pytest.mark.filterwarnings("ignore:k1_as_loss has zero expected gradient")]

UNIT = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
SURVIVES = {d: u + 40 * 2.0**-24 for d, u in UNIT.items()}
BY_ID = {p.id: p for p in PRESETS}
FIELDS = {
    "dtype",
    "dtype_grad_err",
    "dtype_grad_err_at",
    "dtype_overflow",
    "dtype_underflow",
    "dtype_nonfinite",
    "dtype_zero",
    "dtype_wrong",
}


@pytest.fixture(scope="module")
def reports():
    return precision_reports()


def test_grid_covers_the_range_with_exact_zero_and_log_probs():
    u = log_ratio_grid()
    assert float(u.min()) == -30.0
    assert float(u.max()) == 30.0
    assert bool((u == 0).any())
    assert bool(((u.abs() > 0) & (u.abs() <= 1e-6 * 1.0001)).any())  # the near-zero points
    l, r = log_prob_pairs(u)
    assert bool((l <= 0).all())
    assert bool((r <= 0).all())
    torch.testing.assert_close(l - r, u.repeat(3), rtol=0.0, atol=1e-14)


def test_u_ranges_text():
    u = torch.linspace(-3.0, 3.0, 7, dtype=torch.float64)  # -3 .. 3
    flag = lambda *idx: torch.tensor([i in idx for i in range(7)])  # noqa: E731
    assert u_ranges(u, flag()) is None
    assert u_ranges(u, flag(0, 1, 2, 3, 4, 5, 6)) == "everywhere"
    assert u_ranges(u, flag(0, 1)) == "u ≤ -2"
    assert u_ranges(u, flag(5, 6)) == "u ≥ 2"
    assert u_ranges(u, flag(0, 3, 6)) == "u ≤ -3, u ≥ 3, u = 0"
    assert u_ranges(u, flag(1, 2, 4), max_runs=2) == "-2 ≤ u ≤ -1, u = 1"
    assert u_ranges(u, flag(1, 3, 5), max_runs=2) == "3 points in [-2, 2]"


def test_float64_has_no_error_and_the_fields_are_json():
    row = precision_report(head_gradient(KL_HEADS["k3_as_loss"]), "float64").fields()
    assert set(row) == FIELDS
    assert row["dtype_grad_err"] == 0.0
    assert row["dtype_zero"] is None
    assert row["dtype_overflow"] is None
    json.dumps(row, allow_nan=False)
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision_report(head_gradient(KL_HEADS["k3_as_loss"]), "float8")


@pytest.mark.parametrize("dtype", list(UNIT))
def test_every_built_in_head_survives_every_dtype(dtype):
    """The audit's own measurement of klgrad's heads: within one rounding and the float32 work (bound above);
    nothing zero, wrong or non-finite where float64's gradient fits the dtype."""
    heads = {n: h for n, h in KL_HEADS.items() if n != "none"}
    for name, rep in head_precision(heads, dtype).items():
        assert rep.grad_err <= SURVIVES[dtype], (name, rep)
        assert (rep.zero, rep.wrong, rep.nonfinite) == (None, None, None), (name, rep)


def test_float16_overflow_is_reported_not_hidden():
    """e^{11.09} = 65504: k3's coefficient 1 − e^{−u} overflows float16 below u ≈ −11.1; reported as a range."""
    rep = head_precision({"k3": KL_HEADS["k3_in_reward"]}, "float16")["k3"]
    assert rep.overflow == "u ≤ -11.1"
    assert rep.underflow is not None  # |u| < 6e-5: below float16's smallest normal number
    rho = preset_precision((BY_ID[RHO_K3[0]],), "float16")[RHO_K3[0]]
    assert rho.nonfinite == "u ≤ -11.1"  # ρ·k3's g64 = u fits float16; its e^{−u} terms do not: inf − inf


# The issue's claims about ρ·k3 (TRL ≥ 1.10's default, DeepSeek-V3.2): its gradient is u, computed with cancellation.
@pytest.mark.parametrize("pid", RHO_K3)
def test_rho_k3_gradient_cancels(pid):
    for u in (-30.0, -17.0, -8.0, -1.0, 0.5):
        assert gradient_at(pid, u, "float64") == pytest.approx(u, rel=1e-9)
    assert gradient_at(pid, -41.0, "float64") == 0.0  # float64: e^{41} ≈ 6e17 swallows 41
    assert gradient_at(pid, -8.0, "bfloat16") == 0.0
    assert gradient_at(pid, -12.0, "bfloat16") == 0.0
    assert gradient_at(pid, -17.0, "float32") == -16.0
    assert gradient_at(pid, -20.0, "float32") == -32.0
    assert gradient_at(pid, -1.0, "bfloat16") == -1.0  # near the reference it survives


def test_rho_k3_ranges(reports):
    trl = RHO_K3[0]
    bf16, f32 = reports["bfloat16"][trl], reports["float32"][trl]
    assert bf16.zero.startswith("u ≤ -8.")  # 0 for every u below about −8
    assert f32.zero == "u ≤ -20.1"
    assert f32.wrong.startswith("u ≤ -17.")
    assert bf16.grad_err == 1.0
    assert f32.grad_err == 1.0


def test_clamped_rho_k3_is_zeroed_by_its_clamp_first(reports):
    """slime's and NeMo-RL's ρ·k3 clamp the product at ±10: in float64 already, the gradient is 0 below u ≈ −2.6."""
    for pid in RHO_K3_CLAMPED:
        g = preset_gradient(BY_ID[pid])
        u = torch.tensor([-3.0, -8.0, -20.0], dtype=torch.float64)
        assert torch.equal(g(u, torch.zeros_like(u)), torch.zeros_like(u))
    assert reports["bfloat16"]["nemo-rl/k3-loss"].grad_err < 0.05


def test_k1_and_k2_survive_every_dtype_and_k3_loses_u_near_zero(reports):
    for d in UNIT:
        for pid in ("openrlhf/k1-reward", "verl/kl-reward-gae", "verl/kl-loss-mse", "trl/rloo-k1-reward"):
            rep = reports[d][pid]
            assert rep.grad_err <= SURVIVES[d], (d, pid, rep)
            assert (rep.zero, rep.nonfinite) == (None, None), (d, pid, rep)
    k3 = reports["bfloat16"]["trl/grpo-k3"]
    assert k3.zero is not None
    assert "≤ u ≤" in k3.zero
    assert gradient_at("trl/grpo-k3", -0.001, "bfloat16") == 0.0  # 1 − e^{0.001} rounds to 0 in bfloat16


def test_every_precision_remedy_survives_bfloat16():
    """The flags docs/frameworks.md lists under “Surviving bfloat16” (the exact reverse-KL ones) keep the gradient
    to one rounding in every dtype."""
    from klgrad.audit.remedies import REMEDIES

    presets = tuple(BY_ID[m.preset] for m in REMEDIES if m.preset is not None and m.preset not in RHO_K3)
    for d in UNIT:
        for pid, rep in preset_precision(presets, d).items():
            assert rep.grad_err <= SURVIVES[d], (d, pid, rep)
            assert (rep.zero, rep.nonfinite) == (None, None), (d, pid, rep)


def test_short_cell():
    row = {
        "dtype_grad_err": 1.0,
        "dtype_zero": "u ≤ -8.37, 154 points in [-8.02, 0.00146]",
        "dtype_wrong": "u ≤ -7.66",
        "dtype_nonfinite": None,
    }
    assert short_cell(row) == "1.000; 0 at u ≤ -8.37, …; wrong at u ≤ -7.66"


def test_cli_writes_dtype_rows(tmp_path):
    """`klgrad audit --dtype bfloat16` and `klgrad audit --framework all --dtype bfloat16` rows carry the fields."""
    assert main(["audit", "--framework", "all", "--dtype", "bfloat16", "--out", str(tmp_path / "fw")]) == 0
    rows = json.loads((tmp_path / "fw" / "frameworks.json").read_text())["rows"]
    assert {r["id"] for r in rows} == set(BY_ID)
    assert all(FIELDS <= set(r) and r["dtype"] == "bfloat16" for r in rows)
    trl = next(r for r in rows if r["id"] == RHO_K3[0])
    assert trl["dtype_grad_err"] == 1.0
    assert trl["dtype_zero"].startswith("u ≤ -8.")
    out = tmp_path / "audit"
    args = ["audit", "--vocab", "3", "--length", "2", "--dtype", "float16", "--out", str(out)]
    assert main(args) == 0
    data = json.loads((out / "audit.json").read_text())
    assert data["dtype"] == "float16"
    assert all(FIELDS <= set(r) and r["dtype"] == "float16" for r in data["rows"] + data["frameworks"])
    k3 = next(r for r in data["rows"] if r["head"] == "k3_as_loss")
    assert k3["dtype_grad_err"] <= SURVIVES["float16"]
    assert k3["dtype_overflow"] == "u ≤ -11.1"


def test_cli_rejects_an_unknown_dtype(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["audit", "--dtype", "float8", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "float8" in capsys.readouterr().err


def test_dtypes_match_the_cli_choices():
    from klgrad.choices import AUDIT_DTYPES

    assert tuple(DTYPES) == AUDIT_DTYPES
    assert all(isinstance(DTYPES[d], torch.dtype) for d in AUDIT_DTYPES)
    assert math.isclose(torch.finfo(DTYPES["float16"]).max, 65504.0)
