"""klgrad.integrations.verl against the real verl 0.9.1, in its own virtual environment.

verl pins transformers >=5.5.3,<5.11, so it cannot share klgrad's main environment. A session fixture builds
the environment with tools/verl_env.sh when it is missing (about 2 minutes once; cached in .venvs/verl or
$KLGRAD_VERL_ENV afterwards), then tests/helpers/verl_checks.py runs there in a subprocess and prints JSON that these
tests assert on. Nothing is skipped: if the environment cannot be built the tests fail with pip's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = Path(os.environ.get("KLGRAD_VERL_ENV", ROOT / ".venvs" / "verl"))
ENV = ENV if ENV.is_absolute() else ROOT / ENV
EXACT = 1e-12  # float64 parity
F32 = 1e-6  # float32 losses computed by two paths of the same math


@pytest.fixture(scope="session")
def verl_python() -> Path:
    """The verl environment's python, built by tools/verl_env.sh if needed (idempotent)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "verl_env.sh")],
        cwd=ROOT,
        env={**os.environ, "KLGRAD_VERL_ENV": str(ENV), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        tail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING: Location" not in line)
        pytest.fail(f"tools/verl_env.sh could not build the verl environment at {ENV}:\n{tail[-4000:]}")
    return ENV / "bin" / "python"


@pytest.fixture(scope="session")
def checks(verl_python: Path) -> dict:
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "klgrad.integrations.verl"}
    proc = subprocess.run(
        [str(verl_python), str(ROOT / "tests" / "helpers" / "verl_checks.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"tests/helpers/verl_checks.py failed in the verl env:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_versions(checks):
    assert checks["versions"]["verl"] == "0.9.1"
    assert checks["versions"]["torch"].startswith("2.13.0")


def test_loaded_through_verl_external_modules(checks):
    ext = checks["external_module"]
    assert ext["env"] == "klgrad.integrations.verl"
    assert ext["loaded_by_import_verl"], "import verl did not import klgrad.integrations.verl"
    assert ext["get_policy_loss_fn_is_klgrad"]
    assert checks["loss"]["registered_is_klgrad"]


@pytest.mark.parametrize("option", ["k1", "kl", "k2", "mse", "k2+", "mse+", "k1+"])
def test_parity_exact_everywhere(checks, option):
    """verl's k1/k2 options equal klgrad's estimators and heads in value and gradient for every log-ratio."""
    row = checks["parity"][option]
    for tag in ("moderate", "all"):
        assert row[f"value_max_abs_diff_{tag}"] <= EXACT
        assert row[f"grad_max_abs_diff_{tag}"] <= EXACT
        assert row[f"grad_vs_coefficient_max_abs_diff_{tag}"] <= EXACT
    assert row["differs_at_u"] is None
    assert row["klgrad_finite"]


@pytest.mark.parametrize("option", ["k3", "low_var_kl", "k3+"])
def test_parity_k3_and_where_verl_clamps(checks, option):
    """k3: equal for moderate log-ratios; verl clamps the value at 10 (so u < -2.61 or u > 11 differ, and for
    plain k3 the gradient is zeroed there), klgrad stays exact and finite."""
    row = checks["parity"][option]
    assert row["value_max_abs_diff_moderate"] <= 1e-12
    assert row["grad_max_abs_diff_moderate"] <= 1e-12
    lo, hi = row["differs_at_u"]["agrees_on_u_in"]
    assert -2.62 < lo < -2.6
    assert hi == pytest.approx(11.0)
    assert row["value_max_abs_diff_all"] > 1.0  # documented difference, not hidden
    if option == "k3+":
        assert row["grad_max_abs_diff_all"] <= EXACT  # straight-through: k2's gradient, never clamped
        assert row["verl_grad_zeroed_at_n"] == 0
    else:
        assert row["verl_grad_zeroed_at_n"] > 0
    assert row["klgrad_finite"]


def test_registered_loss_in_verl_equals_core(checks):
    cases = checks["loss"]["cases"]
    assert {c["loss_agg_mode"] for c in cases} == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean"}
    for c in cases:
        assert c["config_type"] == "ActorConfig"
        assert c["policy_loss_type"] == "KlgradPolicyLossConfig"
        assert c["finite"]
        assert c["grad_nonzero"]
        assert c["loss_abs_diff"] <= F32, c
        assert c["grad_max_abs_diff"] <= F32, c
        assert c["direct_call_loss_abs_diff"] <= F32, c
        assert c["direct_call_grad_max_abs_diff"] <= F32, c
        assert {"klgrad/kl_loss", "klgrad/kl_clip_frac", "actor/pg_clipfrac"} <= set(c["metric_keys"])


def test_matches_verl_where_it_should_and_differs_off_policy(checks):
    v = checks["loss"]["vs_verl"]
    for tag in ("on_policy", "off_policy"):  # KL off: klgrad's reward head is verl's vanilla PPO loss
        assert v[f"vanilla_{tag}"]["loss_abs_diff"] <= F32
        assert v[f"vanilla_{tag}"]["grad_max_abs_diff"] <= F32
    # k2 at token level: same gradient as verl's kl_loss on-policy; off-policy klgrad adds IS + clip
    assert v["k2_token_kl_on_policy"]["grad_max_abs_diff"] <= F32
    assert v["k2_token_kl_off_policy"]["grad_max_abs_diff"] > 1e-3


def test_errors_are_clear(checks):
    loss = checks["loss"]
    assert "klgrad_ppo_loss" in loss["missing_ref_error"]
    assert "use_kl_loss" in loss["missing_ref_error"]
    assert "kl_head" in loss["bad_head_error"]
    assert loss["stock_ppo_loss_kl_off_finite"]


def test_verl_plain_policy_loss_config_takes_klgrad_defaults(checks):
    plain = checks["loss"]["plain_policy_loss_config"]
    assert plain == {"type": "PolicyLossConfig", "kl_head": "k2_as_loss", "beta": 0.0, "kl_clip_eps": 0.2}


def test_audit_presets_are_verls_own_kl(checks):
    """Every verl preset of ``klgrad audit --framework verl`` equals verl 0.9.1's ``kl_penalty`` on the same
    tensors: values and gradients w.r.t. the log-prob, every log-ratio including clamped ones (float64, the same
    operations: EXACT)."""
    rows = checks["audit_presets"]
    assert len(rows) == 7
    for variant, row in rows.items():
        assert row["value_max_abs_diff"] <= EXACT, variant
        if row["style"] == "loss":
            assert row["grad_max_abs_diff"] <= EXACT, variant
