"""klgrad.audit.frameworks: each framework preset against its formula written out here independently (value and
∂/∂l per token, in plain float64 math), and the audit's verdicts on exact enumeration.

Tolerances: float64; the formulas differ from the presets only in operation order and in u = (u + r) − r being
rounded: a few roundings of terms as large as e^{|u|} (k3's e^{−u} and its derivative cancel to O(u) where u ≪ 0),
so 1e-12 relative to the largest term, 2·(1 + e^{|u|}), bounds the difference (the roundings are ~1e-16 each)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klgrad.audit.frameworks import ALL_PRESETS, FRAMEWORKS, framework_rows, frozen_range, select
from klgrad.audit.run import AuditConfig, make_problem

pytestmark = pytest.mark.numerics

F64 = torch.float64
U = torch.linspace(-15.0, 15.0, 301, dtype=F64)  # log-ratios u = l − r
R = torch.full_like(U, -1.3)
O_SHIFT = 0.37  # behaviour o = l − 0.37: ρ = e^{0.37}


def clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def k3(u: float) -> float:
    return math.exp(-u) - 1 + u


def dk3(u: float) -> float:  # ∂k3/∂l
    return 1 - math.exp(-u)


def low_var(u: float) -> float:
    x = clamp(-u, -20, 20)
    return clamp(math.exp(x) - x - 1, -10, 10)


def dlow_var(u: float) -> float:
    x = -u
    inner = math.exp(x) - x - 1
    return 0.0 if abs(x) > 20 or not -10 < inner < 10 else -(math.exp(x) - 1)


RHO = math.exp(O_SHIFT)
# (framework, variant prefix) -> (value(u), ∂/∂l(u)) with o = l − O_SHIFT, ρ = e^{O_SHIFT} (∂ρ/∂l = ρ)
FORMULAS = {
    ("trl", "k3 loss (GRPO"): (k3, dk3),
    ("trl", "k3 loss, use_bias"): (lambda u: RHO * k3(u), lambda u: RHO * dk3(u) + RHO * k3(u)),
    ("verl", "kl_loss_type=k1"): (lambda u: u, lambda u: 1.0),
    ("verl", "kl_loss_type=abs"): (abs, lambda u: math.copysign(1.0, u)),
    ("verl", "kl_loss_type=mse"): (lambda u: 0.5 * u * u, lambda u: u),
    ("verl", "kl_loss_type=low_var_kl ("): (low_var, dlow_var),
    ("verl", "kl_loss_type=low_var_kl+"): (low_var, lambda u: u),
    ("openrlhf", "k2 loss"): (lambda u: clamp(0.5 * u * u, -10, 10), lambda u: u if 0.5 * u * u < 10 else 0.0),
    ("openrlhf", "k3 loss"): (lambda u: clamp(k3(u), -10, 10), lambda u: dk3(u) if k3(u) < 10 else 0.0),
    ("slime", "kl_loss_type=low_var_kl, use-unbiased"): (  # clamp after the ratio: ρ·k3 beyond ±10 has ∇ = 0
        lambda u: clamp(RHO * k3(u), -10, 10),
        lambda u: RHO * (dk3(u) + k3(u)) if RHO * k3(u) < 10 else 0.0,
    ),
    ("nemo-rl", "k3, weight exp(x"): (  # weight 1 in value, ∇ = ∇k3 + k3 = u unless the output clamp acts
        lambda u: clamp(k3(u), -10, 10),
        lambda u: dk3(u) + k3(u) if k3(u) < 10 else 0.0,
    ),
    ("nemo-rl", "k3, use_on_policy"): (
        lambda u: clamp(RHO * k3(u), -10, 10),
        lambda u: RHO * (dk3(u) + k3(u)) if RHO * k3(u) < 10 else 0.0,
    ),
    ("rpg", "rpg_fkl"): (lambda u: -u, lambda u: -1.0),
    ("rpg", "rpg_rkl"): (
        lambda u: clamp(math.exp(u) * u, -10, 10),
        lambda u: math.exp(u) * (u + 1) if math.exp(u) * u < 10 else 0.0,
    ),
    ("rpg", "rpg_ufkl"): (
        lambda u: clamp(math.exp(u) - u - 1, -10, 10),
        lambda u: math.exp(u) - 1 if math.exp(u) - u - 1 < 10 else 0.0,
    ),
    ("rpg", "rpg_urkl"): (
        lambda u: clamp(math.exp(u) * (u - 1) + 1, -10, 10),
        lambda u: math.exp(u) * u if -10 < math.exp(u) * (u - 1) + 1 < 10 else 0.0,
    ),
    ("deepseek-v3.2", "unbiased KL"): (lambda u: RHO * k3(u), lambda u: RHO * dk3(u) + RHO * k3(u)),
}
REWARD_FORMULAS = {  # the per-token KL a reward preset computes from the behaviour log-probs
    ("verl", "use_kl_in_reward (k1, GRPO"): lambda u: u,
    ("verl", "use_kl_in_reward (k1, GAE"): lambda u: u,
    ("openrlhf", "k1 in reward"): lambda u: clamp(u, -10, 10),
}


def formula_for(preset, table):
    """The formula of a preset (RPG's π_old-reference copies compute the same per-token term)."""
    hits = [f for (fw, prefix), f in table.items() if preset.framework == fw and preset.variant.startswith(prefix)]
    assert len(hits) == 1, (preset.framework, preset.variant)
    return hits[0]


LOSS_PRESETS = [p for p in ALL_PRESETS if p.style == "loss"]
REWARD_PRESETS = [p for p in ALL_PRESETS if p.style == "reward"]


@pytest.mark.parametrize("preset", LOSS_PRESETS, ids=lambda p: f"{p.framework}:{p.variant}")
def test_loss_preset_value_and_gradient_are_its_formula(preset):
    value_of, grad_of = formula_for(preset, FORMULAS)
    l = (U + R).clone().requires_grad_(True)
    term = preset.token_kl(l, R, l.detach() - O_SHIFT)
    (grad,) = torch.autograd.grad(term.sum(), l)
    for i, u in enumerate(U.tolist()):
        if abs(u) < 1e-9 and preset.variant == "kl_loss_type=abs":
            continue  # |u| has no derivative at 0
        want_v, want_g = value_of(u), grad_of(u)
        bound = 1e-12 * 2 * (1 + math.exp(abs(u)))
        assert float(term[i].detach()) == pytest.approx(want_v, rel=1e-12, abs=bound), (u, "value")
        assert float(grad[i]) == pytest.approx(want_g, rel=1e-12, abs=bound), (u, "gradient")


@pytest.mark.parametrize("preset", REWARD_PRESETS, ids=lambda p: f"{p.framework}:{p.variant}")
def test_reward_preset_penalty_is_its_formula_from_the_behaviour_log_probs(preset):
    value_of = formula_for(preset, REWARD_FORMULAS)
    values = preset.token_kl(U + R, R, U + R)
    assert values.tolist() == pytest.approx([value_of(u) for u in U.tolist()], rel=1e-12, abs=1e-12)


def test_every_loss_and_reward_formula_is_used():
    used = {formula_for(p, FORMULAS) for p in LOSS_PRESETS} | {formula_for(p, REWARD_FORMULAS) for p in REWARD_PRESETS}
    assert len(used) == len(FORMULAS) + len(REWARD_FORMULAS)


def test_frameworks_are_the_required_names():
    assert FRAMEWORKS == ("trl", "verl", "openrlhf", "slime", "nemo-rl", "deepseek-v3.2", "rpg")
    assert select("all") == ALL_PRESETS
    with pytest.raises(ValueError, match="trl"):
        select("megatron")


@pytest.fixture(scope="module")
def rows():
    return {(r["framework"], r["variant"], r["regime"]): r for r in framework_rows(make_problem(AuditConfig()))}


def row(rows, framework, prefix, regime="on_policy"):
    """The row of the one variant that starts with ``prefix`` (or is exactly ``prefix``)."""
    hits = [r for (fw, v, reg), r in rows.items() if fw == framework and v.startswith(prefix) and reg == regime]
    exact = [r for r in hits if r["variant"] == prefix]
    (hit,) = exact or hits
    return hit


def test_the_audit_verdicts_follow_from_the_math(rows):
    """What the derivations say each framework's KL differentiates to, checked by exact enumeration."""
    # k3 as a per-token loss (TRL, verl low_var_kl, OpenRLHF k3): the per-step forward KL
    for fw, prefix in (("trl", "k3 loss (GRPO"), ("verl", "kl_loss_type=low_var_kl ("), ("openrlhf", "k3 loss")):
        assert row(rows, fw, prefix)["equals"] == "k3_as_loss@token (local_fkl)"
    # k3 × ratio with the ratio carrying gradient (TRL bias correction, DeepSeek-V3.2, slime unbiased), k2 as
    # loss, verl's k2 straight-through and NeMo-RL's score-function fix: the per-step reverse KL
    for fw, prefix in (
        ("trl", "k3 loss, use_bias"),
        ("deepseek-v3.2", "unbiased"),
        ("slime", "kl_loss_type=low_var_kl, use-unbiased"),
        ("verl", "kl_loss_type=mse"),
        ("verl", "kl_loss_type=low_var_kl+"),
        ("openrlhf", "k2 loss"),
        ("nemo-rl", "k3, weight"),
        ("nemo-rl", "k3, use_on_policy"),
    ):
        assert row(rows, fw, prefix)["equals"] == "k1_in_reward@token (local_rkl)", (fw, prefix)
    # k1 as a loss has zero expected gradient; k1 in the reward, summed, is the exact reverse-KL gradient
    assert row(rows, "verl", "kl_loss_type=k1")["equals"] == "none@sequence (zero)"
    for fw, prefix in (
        ("verl", "use_kl_in_reward (k1, GRPO"),
        ("verl", "use_kl_in_reward (k1, GAE"),
        ("openrlhf", "k1"),
    ):
        assert row(rows, fw, prefix)["err_rkl"] < 1e-12
        # off-policy the KL coefficient is the behaviour's and the PPO ratio is per token: biased
        assert row(rows, fw, prefix, "off_policy")["err_rkl"] > 0.05
    # no IS on a KL loss: off-policy it is no longer the on-policy gradient
    assert row(rows, "trl", "k3 loss (GRPO", "off_policy")["equals"].startswith("≈")
    # RPG in its own setting (reference = behaviour π_old, samples from π_old): the forward forms are exact
    for prefix in ("rpg_fkl: −log w, reference", "rpg_ufkl: w − log w − 1, reference"):
        assert row(rows, "rpg", prefix, "off_policy")["err_fkl"] < 1e-12
    # ... and with a separate reference and samples from π, −log w (k1 as loss) has zero expected gradient
    assert row(rows, "rpg", "rpg_fkl: −log w")["equals"] == "none@sequence (zero)"


def test_clamp_ranges_are_where_the_formulas_say():
    by_name = {(p.framework, p.variant): p for p in ALL_PRESETS}
    low = by_name[("verl", "kl_loss_type=low_var_kl (k3)")]
    # k3 = e^{-u} - 1 + u reaches 10 at u ≈ -2.6150 (below: clamped) and u ≈ 11.00002 (above)
    assert frozen_range(low, "gradient") == "u ≤ -2.62, u ≥ 11"
    k2 = next(p for p in ALL_PRESETS if p.framework == "openrlhf" and p.variant.startswith("k2"))
    edge = math.ceil(math.sqrt(20) * 100) / 100  # ½u² = 10 at |u| = √20, first grid point (step 0.01) beyond
    assert frozen_range(k2, "gradient") == f"u ≤ {-edge:.3g}, u ≥ {edge:.3g}"
    assert frozen_range(by_name[("trl", "k3 loss (GRPOTrainer, beta > 0)")], "gradient") is None


def test_cli_writes_frameworks_json(tmp_path, capsys):
    from klgrad.cli import main

    assert main(["audit", "--framework", "verl", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "frameworks.json").read_text())
    assert {r["framework"] for r in data["rows"]} == {"verl"}
    assert {r["regime"] for r in data["rows"]} == {"on_policy", "off_policy"}
    for r in data["rows"]:
        assert {"framework", "variant", "regime", "err_rkl", "err_fkl", "equals"} <= set(r)
    assert "low_var_kl" in capsys.readouterr().out
    assert main(["audit", "--framework", "nope", "--out", str(tmp_path)]) == 2
