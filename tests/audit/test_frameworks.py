"""klgrad.audit.frameworks and klgrad.audit.presets: each framework preset against its formula written out here
independently (value and ∂/∂l per token, in plain float64 math), the presets' versions and sources, and the audit's
verdicts (and the remedy table's claims) on exact enumeration.

Tolerances: float64; the formulas differ from the presets only in operation order and in u = (u + r) − r being
rounded: a few roundings of terms as large as e^{|u|} (k3's e^{−u} and its derivative cancel to O(u) where u ≪ 0),
so 1e-12 relative to the largest term, 2·(1 + e^{|u|}), bounds the difference (the roundings are ~1e-16 each)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from klgrad.audit.framework_kl import AGGREGATIONS
from klgrad.audit.frameworks import (
    framework_rows,
    frozen_range,
    holds_for,
    installed_version,
    is_default,
    is_release_range,
    select,
)
from klgrad.audit.presets import PRESETS
from klgrad.audit.remedies import REMEDIES, remedy_row
from klgrad.audit.run import AuditConfig, make_problem
from klgrad.choices import FRAMEWORKS
from tests.helpers.extras import needs_extras

pytestmark = pytest.mark.numerics

F64 = torch.float64
# log-ratios u = l − r over ±25 (past NeMo-RL's ±20 input clamp); 500 points, none on a clamp's edge (±10, ±20)
U = torch.linspace(-25.0, 25.0, 500, dtype=F64)[:, None]  # (n, 1): one-token responses
R = torch.full_like(U, -1.3)
MASK = torch.ones_like(U, dtype=torch.bool)
O_SHIFT = 0.37  # behaviour o = l − 0.37: ρ = e^{0.37}
RHO = math.exp(O_SHIFT)


def clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def within(x: float, bound: float) -> float:
    """1 where |x| < bound (the clamp passes the gradient), else 0."""
    return 1.0 if abs(x) < bound else 0.0


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


def clamped_k3(u: float) -> float:  # k3 then clamp ±10, no input clamp
    return clamp(k3(u), -10, 10)


def dclamped_k3(u: float) -> float:
    return dk3(u) * within(k3(u), 10)


def nemo_value(u: float, weight: float = 1.0) -> float:  # input clamp ±20 on x = −u, weight·k3, output clamp ±10
    x = clamp(-u, -20, 20)
    return clamp(weight * (math.exp(x) - 1 - x), -10, 10)


def oi(u: float) -> float:  # Open-Instruct's d = clamp(l − r, ±40)
    return clamp(u, -40, 40)


# id -> (value(u), ∂/∂l(u)) with o = l − O_SHIFT, ρ = e^{O_SHIFT} (∂ρ/∂l = ρ); r fixed, l = u + r
FORMULAS = {
    "trl/grpo-k3": (k3, dk3),
    "trl/grpo-k3-bias-correction": (lambda u: RHO * k3(u), lambda u: RHO * (dk3(u) + k3(u))),
    # one-token responses: GSPO's sequence-mean ratio is the token ratio (multi-token: its own test below)
    "trl/grpo-k3-bias-correction-gspo": (lambda u: RHO * k3(u), lambda u: RHO * (dk3(u) + k3(u))),
    "verl/kl-loss-k1": (lambda u: u, lambda u: 1.0),
    "verl/kl-loss-abs": (abs, lambda u: math.copysign(1.0, u)),
    "verl/kl-loss-mse": (lambda u: 0.5 * u * u, lambda u: u),
    "verl/kl-loss-low-var-kl": (low_var, dlow_var),
    "verl/kl-loss-low-var-kl-plus": (low_var, lambda u: u),
    "openrlhf/kl-loss-k1": (lambda u: clamp(u, -10, 10), lambda u: within(u, 10)),
    "openrlhf/kl-loss-k2": (lambda u: clamp(0.5 * u * u, -10, 10), lambda u: u * within(0.5 * u * u, 10)),
    "openrlhf/kl-loss-k3": (clamped_k3, dclamped_k3),
    "openrlhf/kl-loss-k3-unclamped": (k3, dk3),
    # value: k1 clamped ±10 (the default estimator); gradient: w·u, w = ρ = e^{0.37} (< the cap 10), no clamp
    "openrlhf/kl-loss-unbiased-gradient": (lambda u: clamp(u, -10, 10), lambda u: RHO * u),
    "slime/kl-loss-k1": (lambda u: u, lambda u: 1.0),
    "slime/kl-loss-low-var-kl": (clamped_k3, dclamped_k3),
    "slime/kl-loss-low-var-kl-unbiased": (  # clamp after the ratio: ρ·k3 beyond ±10 has ∇ = 0
        lambda u: clamp(RHO * k3(u), -10, 10),
        lambda u: RHO * (dk3(u) + k3(u)) * within(RHO * k3(u), 10),
    ),
    "nemo-rl/k3-loss": (  # weight 1 in value, ∇ = ∇k3 + k3 = u unless a clamp acts
        nemo_value,
        lambda u: (dk3(u) + k3(u)) * within(u, 20) * within(k3(u), 10),
    ),
    "nemo-rl/k3-loss-on-policy-approximation": (
        lambda u: nemo_value(u, RHO),
        lambda u: RHO * (dk3(u) + k3(u)) * within(u, 20) * within(RHO * k3(u), 10),
    ),
    "nemo-rl/k3-loss-detached-weight": (nemo_value, lambda u: dk3(u) * within(u, 20) * within(k3(u), 10)),
    "nemo-rl/k3-loss-input-clamp": (
        lambda u: k3(clamp(u, -20, 20)),
        lambda u: dk3(u) * within(u, 20),
    ),
    "nemo-rl/k3-loss-unclamped": (k3, dk3),
    "deepseek-v3.2/unbiased-kl": (lambda u: RHO * k3(u), lambda u: RHO * (dk3(u) + k3(u))),
    "rpg/fkl": (lambda u: -u, lambda u: -1.0),
    "rpg/rkl": (
        lambda u: clamp(math.exp(u) * u, -10, 10),
        lambda u: math.exp(u) * (u + 1) * within(math.exp(u) * u, 10),
    ),
    "rpg/js": (
        lambda u: clamp(0.5 * (math.exp(u) + 1) * u, -10, 10),
        lambda u: 0.5 * (math.exp(u) * (u + 1) + 1) * within(0.5 * (math.exp(u) + 1) * u, 10),
    ),
    "rpg/ufkl": (
        lambda u: clamp(math.exp(u) - u - 1, -10, 10),
        lambda u: (math.exp(u) - 1) * within(math.exp(u) - u - 1, 10),
    ),
    "rpg/urkl": (
        lambda u: clamp(math.exp(u) * (u - 1) + 1, -10, 10),
        lambda u: math.exp(u) * u * within(math.exp(u) * (u - 1) + 1, 10),
    ),
    "rpg/ujs": (
        lambda u: clamp(0.5 * (math.exp(u) - 1) * u, -10, 10),
        lambda u: 0.5 * (math.exp(u) * (u + 1) - 1) * within(0.5 * (math.exp(u) - 1) * u, 10),
    ),
    "roll/kl-loss-k3": (clamped_k3, dclamped_k3),
    "roll/kl-loss-k3-seq-mean-token-sum": (clamped_k3, dclamped_k3),
    "open-instruct/k3-loss": (lambda u: math.expm1(-oi(u)) + oi(u), lambda u: dk3(u) * within(u, 40)),
    "open-instruct/ratio-k1-loss": (lambda u: RHO * oi(u), lambda u: RHO * (oi(u) + within(u, 40))),
    "open-instruct/k1-loss": (oi, lambda u: within(u, 40)),
    "open-instruct/k2-loss": (lambda u: oi(u) ** 2 / 2, lambda u: oi(u) * within(u, 40)),
    "torchtune/grpo-k3": (k3, dk3),
    "prime-rl/inference-kl": (lambda u: 0.5 * O_SHIFT**2, lambda u: O_SHIFT),  # ½(l − o)², o = l − 0.37
    "prime-rl/kimi-kl": (lambda u: RHO * O_SHIFT * (u - 1.3), lambda u: RHO * O_SHIFT),  # sg(ρ(l − o))·l
    "skyrl/kl-loss-k3": (low_var, dlow_var),
    "skyrl/kl-loss-k2": (lambda u: 0.5 * u * u, lambda u: u),
    "ms-swift/k3-loss": (low_var, dlow_var),
    "ms-swift/k3-loss-unclamped": (k3, dk3),
}
# the per-token KL a reward preset computes from the behaviour log-probs (o = l: the rollout's own)
REWARD_FORMULAS = {
    "trl/rloo-k1-reward": lambda u: u,
    "trl/ppo-k1-reward": lambda u: u,
    "trl/ppo-k3-reward": k3,
    "verl/kl-reward-grpo": lambda u: u,
    "verl/kl-reward-gae": lambda u: u,
    "openrlhf/k1-reward": lambda u: clamp(u, -10, 10),
    "openrlhf/k1-reward-unclamped": lambda u: u,
    "slime/kl-coef-grpo": lambda u: 0.0,
    "slime/kl-coef-reinforce-pp": lambda u: u,
    "slime/kl-coef-reinforce-pp-baseline": lambda u: u,
    "slime/kl-coef-ppo": lambda u: u,
    "nemo-rl/reinforce-pp-kl-in-reward": nemo_value,
    "nemo-rl/gae-kl-in-reward": nemo_value,
    "nemo-rl/gae-k1-in-reward": lambda u: clamp(u, -10, 10),
    "rpg/rf-fkl-reward": lambda u: -1.0,
    "rpg/rf-rkl-reward": lambda u: clamp(math.exp(u) * (u + 1), -10, 10),
    "rpg/rf-ufkl-reward": lambda u: clamp(math.exp(u) - 1, -10, 10),
    "rpg/rf-urkl-reward": lambda u: clamp(math.exp(u) * u, -10, 10),
    "roll/token-level-kl-gae": lambda u: u,
    "roll/token-level-kl-reinforce": lambda u: u,
    "roll/token-level-kl-gae-seq-mean-token-sum": lambda u: u,
    "roll/token-level-kl-reinforce-seq-mean-token-sum": lambda u: u,
    "areal/k1-reward": lambda u: clamp(u, -10, 10),
    "areal/k1-reward-unclamped": lambda u: u,
    "skyrl/kl-reward-grpo": low_var,
    "skyrl/kl-reward-grpo-k1": lambda u: u,
    "ms-swift/kl-in-reward": lambda u: u,
    "tinker/kl-advantage": lambda u: u,
    "tinker/kl-advantage-discounted": lambda u: u,
}


def formula_for(preset, table):
    """The formula of a preset; RPG's π_old-reference copies compute the same per-token term as its own."""
    return table[preset.id.removesuffix("-iterative")]


LOSS_PRESETS = [p for p in PRESETS if p.style == "loss"]
REWARD_PRESETS = [p for p in PRESETS if p.style == "reward"]


@pytest.mark.parametrize("preset", LOSS_PRESETS, ids=lambda p: p.id)
def test_loss_preset_value_and_gradient_are_its_formula(preset):
    value_of, grad_of = formula_for(preset, FORMULAS)
    l = (U + R).clone().requires_grad_(True)
    term = preset.token_kl(l, R, l.detach() - O_SHIFT, MASK)
    (grad,) = torch.autograd.grad(term.sum(), l)
    for i, u in enumerate(U[:, 0].tolist()):
        want_v, want_g = value_of(u), grad_of(u)
        bound = 1e-12 * 2 * (1 + math.exp(abs(u)))
        assert float(term[i, 0].detach()) == pytest.approx(want_v, rel=1e-12, abs=bound), (u, "value")
        assert float(grad[i, 0]) == pytest.approx(want_g, rel=1e-12, abs=bound), (u, "gradient")


@pytest.mark.parametrize("preset", REWARD_PRESETS, ids=lambda p: p.id)
def test_reward_preset_penalty_is_its_formula_from_the_behaviour_log_probs(preset):
    value_of = formula_for(preset, REWARD_FORMULAS)
    values = preset.penalty(U + R, R, MASK)[:, 0]
    want = [value_of(u) for u in U[:, 0].tolist()]
    bounds = [1e-12 * 2 * (1 + math.exp(abs(u))) for u in U[:, 0].tolist()]
    for got, w, b in zip(values.tolist(), want, bounds, strict=True):
        assert got == pytest.approx(w, rel=1e-12, abs=b)


def test_every_formula_is_used_by_a_preset():
    assert {p.id.removesuffix("-iterative") for p in LOSS_PRESETS} == set(FORMULAS)
    assert {p.id for p in REWARD_PRESETS} == set(REWARD_FORMULAS)


def test_gspo_bias_correction_uses_the_sequence_mean_log_ratio():
    """TRL with importance_sampling_level=sequence: every token's k3 times exp(mean over the response of l − o),
    padding excluded from the mean; its gradient reaches every token of the response."""
    g = torch.Generator().manual_seed(3)
    l0 = torch.randn(2, 3, generator=g, dtype=F64)
    l = l0.clone().requires_grad_(True)
    r, o = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    preset = next(p for p in PRESETS if p.id == "trl/grpo-k3-bias-correction-gspo")
    term = preset.token_kl(l, r, o, mask)
    for i, n in ((0, 3), (1, 2)):
        w = math.exp(sum(float(l0[i, t] - o[i, t]) for t in range(n)) / n)
        for t in range(n):
            u = float(l0[i, t] - r[i, t])
            assert float(term[i, t].detach()) == pytest.approx(w * k3(u), rel=1e-12)
    (grad,) = torch.autograd.grad(term[1, 0], l)
    assert float(grad[1, 1]) != 0.0
    assert float(grad[1, 2]) == 0.0


def test_openrlhf_unbiased_gradient_caps_the_detached_importance_weight_at_10():
    """w = e^{l − o} is clamped to at most 10 and detached: with o = l − 3 (e^3 ≈ 20) the gradient is 10·u, and the
    value is the k1 estimator's, clamped ±10, whatever w is."""
    preset = next(p for p in PRESETS if p.id == "openrlhf/kl-loss-unbiased-gradient")
    l = (U + R).clone().requires_grad_(True)
    for shift, weight in ((3.0, 10.0), (-2.0, math.exp(-2.0))):
        term = preset.token_kl(l, R, l.detach() - shift, MASK)
        (grad,) = torch.autograd.grad(term.sum(), l)
        for i, u in enumerate(U[:, 0].tolist()):
            assert float(term[i, 0].detach()) == pytest.approx(clamp(u, -10, 10), rel=1e-12, abs=1e-12)
            assert float(grad[i, 0]) == pytest.approx(weight * u, rel=1e-12, abs=1e-12)


def test_roll_aggregation_and_openrlhf_unbiased_gradient_by_version():
    """ROLL 0.1.0 defaulted to seq-mean-token-sum (a token sum), 0.1.1 on to seq-mean-token-mean; OpenRLHF's
    --algo.kl.unbiased_gradient is in the 0.11.1 package, not in v0.11.0."""
    by_id = {p.id: p for p in PRESETS}
    at_0_1_0 = {p.id: p.aggregation for p in select("roll", "0.1.0")}
    assert at_0_1_0 == {
        "roll/kl-loss-k3-seq-mean-token-sum": "token_sum",
        "roll/token-level-kl-gae-seq-mean-token-sum": "token_sum",
        "roll/token-level-kl-reinforce-seq-mean-token-sum": "token_sum",
    }
    for version in ("0.1.1", "0.3.0"):
        assert {p.id: p.aggregation for p in select("roll", version)} == {
            "roll/kl-loss-k3": "seq_mean",
            "roll/token-level-kl-gae": "seq_mean",
            "roll/token-level-kl-reinforce": "seq_mean",
        }
    assert [p.id for p in select("roll", "0.1.0") if is_default(p, "0.1.0")] == [
        "roll/kl-loss-k3-seq-mean-token-sum", "roll/token-level-kl-gae-seq-mean-token-sum",
    ]  # fmt: skip
    assert not is_default(by_id["roll/kl-loss-k3"], "0.1.0")
    assert is_default(by_id["roll/kl-loss-k3"], "0.1.1")
    for version, has in (("0.11.0", False), ("0.11.1", True), ("0.11.2", True)):
        assert ("openrlhf/kl-loss-unbiased-gradient" in {p.id for p in select("openrlhf", version)}) is has
    assert not is_default(by_id["openrlhf/kl-loss-unbiased-gradient"], "0.11.2")  # opt-in


def test_zero_default_weights_and_std_normalised_rewards_are_recorded():
    """ROLL's kl_loss_coef defaults to 0 (use_kl_loss alone adds nothing) and its init_kl_coef to 0.2; the KL in
    the reward passes through a std normalisation in GRPO (verl, SkyRL) and in ms-swift; both are on the rows."""
    from klgrad.audit.frameworks import zero_weight_text

    zero = {p.id for p in PRESETS if zero_weight_text(p) is not None}
    assert zero == {"roll/kl-loss-k3", "roll/kl-loss-k3-seq-mean-token-sum"}
    for p in PRESETS:
        if p.framework == "roll" and p.style == "reward":
            assert p.coef_default == ("init_kl_coef", 0.2), p.id
    assert {p.id for p in PRESETS if p.std_normalised} == {
        "verl/kl-reward-grpo", "skyrl/kl-reward-grpo", "skyrl/kl-reward-grpo-k1", "ms-swift/kl-in-reward",
    }  # fmt: skip
    assert all(p.style == "reward" for p in PRESETS if p.std_normalised)


def test_group_std_normalisation_cancels_beta_when_the_task_reward_has_no_spread():
    """The docs' limit for the std-normalised KL-in-reward presets, in plain float64: a group whose task reward is
    the same for every response gets advantages −(K_i − mean K)/std K whatever β is (up to the ε added to the
    std), so the KL's size is lost and its ranking kept."""
    kl = [0.31, 1.7, 0.02, 0.9, 0.55]  # summed KL of each response of one group
    n = len(kl)

    def advantages(beta: float, task: float = 1.0, eps: float = 1e-6) -> list[float]:
        r = [task - beta * k for k in kl]
        mean = sum(r) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1))  # torch.std: unbiased
        return [(x - mean) / (std + eps) for x in r]

    kl_mean = sum(kl) / n
    kl_std = math.sqrt(sum((k - kl_mean) ** 2 for k in kl) / (n - 1))
    want = [-(k - kl_mean) / kl_std for k in kl]
    for beta in (0.001, 0.05, 1.0, 20.0):  # the ε shrinks every advantage by the factor 1/(1 + ε/(β·std K))
        assert advantages(beta) == pytest.approx(want, rel=1e-6 / (beta * kl_std) + 1e-12)
    assert advantages(1.0, eps=0.0) == pytest.approx(want, rel=1e-12)


def test_presets_carry_versions_sources_and_stable_ids():
    assert FRAMEWORKS == (
        "trl", "verl", "openrlhf", "slime", "nemo-rl", "deepseek-v3.2", "rpg", "roll", "areal", "open-instruct",
        "torchtune", "prime-rl", "skyrl", "ms-swift", "tinker",
    )  # fmt: skip
    from packaging.specifiers import SpecifierSet

    assert len({p.id for p in PRESETS}) == len(PRESETS)
    for p in PRESETS:
        assert p.id.startswith(p.framework + "/")
        assert p.framework in FRAMEWORKS
        assert p.aggregation in AGGREGATIONS, p.id
        for spec in (p.versions, p.default):
            if spec is not None and is_release_range(spec):
                SpecifierSet(spec)  # parses
        assert p.versions.startswith(("main@", "report")) or is_release_range(p.versions), p.id
        # the commit (12 hex digits) or the release tag the lines were read at, or the report
        assert re.search(r"@[0-9a-f]{12} \(20\d\d-\d\d-\d\d|\bv\d+\.\d+|arXiv", p.source), p.id


@needs_extras("trl")  # ends on the installed TRL's version
def test_version_selection_and_defaults():
    """TRL's default KL changed in 1.10 (use_bias_correction_kl on); verl's low_var_kl+ works from 0.8."""
    by_id = {p.id: p for p in PRESETS}
    assert is_default(by_id["trl/grpo-k3"], "1.9.2")
    assert not is_default(by_id["trl/grpo-k3"], "1.10.0")
    assert is_default(by_id["trl/grpo-k3-bias-correction"], "1.16.0")
    assert not holds_for(by_id["trl/grpo-k3-bias-correction"], "0.25.1")
    assert {p.id for p in select("trl", "1.13.0")} == {
        "trl/grpo-k3", "trl/grpo-k3-bias-correction", "trl/grpo-k3-bias-correction-gspo", "trl/rloo-k1-reward",
    }  # fmt: skip  # PPO removed in 1.13
    assert "verl/kl-loss-low-var-kl-plus" not in {p.id for p in select("verl", "0.7.1")}
    assert "verl/kl-loss-low-var-kl-plus" in {p.id for p in select("verl", "0.8.0")}
    assert [p.id for p in select("openrlhf", "0.8.5") if is_default(p, "0.8.5")] == ["openrlhf/k1-reward-unclamped"]
    assert select("rpg", "1.0") == select("rpg")  # no releases: every version
    with pytest.raises(ValueError, match="not a version"):
        select("trl", "latest")
    with pytest.raises(ValueError, match="audited ranges"):
        select("trl", "0.1.0")
    with pytest.raises(ValueError, match="trl"):
        select("megatron")
    found = installed_version("trl")  # TRL is a test dependency here
    assert found is not None
    assert found[0] == "trl"
    assert installed_version("slime") is None


@pytest.fixture(scope="module")
def all_rows():
    return framework_rows(make_problem(AuditConfig()))


@pytest.fixture(scope="module")
def rows(all_rows):
    return {(r["id"], r["aggregation"], r["regime"]): r for r in all_rows}


def row(rows, pid, regime="on_policy", aggregation=None):
    """The row of preset ``pid`` at ``aggregation`` (None: the framework's default)."""
    (hit,) = [
        r
        for (i, agg, reg), r in rows.items()
        if i == pid
        and reg == regime
        and (r["framework_default_aggregation"] if aggregation is None else agg == aggregation)
    ]
    return hit


def test_the_audit_verdicts_follow_from_the_math(rows):
    """What the derivations say each framework's KL differentiates to, checked by exact enumeration."""
    # k3 as a per-token loss: the per-step forward KL under a token sum
    for pid in ("trl/grpo-k3", "verl/kl-loss-low-var-kl", "openrlhf/kl-loss-k3", "nemo-rl/k3-loss-detached-weight",
                "open-instruct/k3-loss", "ms-swift/k3-loss", "roll/kl-loss-k3", "torchtune/grpo-k3",
                "roll/kl-loss-k3-seq-mean-token-sum"):  # fmt: skip
        assert row(rows, pid, aggregation="token_sum" if "token_sum" in {k[1] for k in rows if k[0] == pid}
                   else "token_mean")["equals"] == "k3_as_loss@token (local_fkl)", pid  # fmt: skip
    # k3 × a ratio carrying gradient, k2 as a loss, verl's straight-through, NeMo-RL's e^{x − sg x}, Open-Instruct's
    # ρ·k1: the per-step reverse KL
    for pid in (
        "trl/grpo-k3-bias-correction",
        "deepseek-v3.2/unbiased-kl",
        "verl/kl-loss-mse",
        "verl/kl-loss-low-var-kl-plus",
        "openrlhf/kl-loss-k2",
        "nemo-rl/k3-loss",
        "nemo-rl/k3-loss-on-policy-approximation",
        "open-instruct/ratio-k1-loss",
        "openrlhf/kl-loss-unbiased-gradient",
        "tinker/kl-advantage",  # k1 per token into the advantage, no return: the same per-step term
    ):
        assert row(rows, pid)["equals"] == "k2_as_loss@token (local_rkl)", pid
    # off-policy, OpenRLHF's detached w·∇k2 and TRL's differentiable ρ·k3 have the same per-token gradient ρ·u
    # (w < 10 here): the same row, neither the per-step reverse KL (the prefixes are still π_old's)
    unbiased = row(rows, "openrlhf/kl-loss-unbiased-gradient", "off_policy")
    trl_bc = row(rows, "trl/grpo-k3-bias-correction", "off_policy")
    assert unbiased["err_rkl"] == pytest.approx(trl_bc["err_rkl"], rel=1e-9)
    assert unbiased["equals"] == trl_bc["equals"]
    assert unbiased["equals"].startswith("≈")
    # ROLL 0.1.0's seq-mean-token-sum: the token-level KL in the reward with REINFORCE returns is a sum, exact
    assert row(rows, "roll/token-level-kl-reinforce-seq-mean-token-sum")["err_rkl"] < 1e-12
    assert row(rows, "roll/token-level-kl-reinforce")["equals"] == "k2_as_loss@token_to_go/|y|"
    # ... but GSPO's sequence-mean ratio is neither per-step KL
    assert row(rows, "trl/grpo-k3-bias-correction-gspo")["equals"].startswith("≈")
    # k1 as a loss has zero expected gradient under a token sum, and is a pure length term under 1/|y|
    for pid in ("verl/kl-loss-k1", "openrlhf/kl-loss-k1", "open-instruct/k1-loss", "rpg/fkl"):
        assert row(rows, pid, aggregation="token_mean")["equals"] == "none@sequence (zero)", pid
    assert row(rows, "slime/kl-loss-k1")["equals"] == "E[1/|y|]"
    # k1 in the reward, summed over the response: the exact reverse-KL gradient on-policy under a token sum or
    # mean, biased off-policy (the KL is the behaviour's, the PPO ratio per token)
    for pid in ("verl/kl-reward-grpo", "verl/kl-reward-gae", "openrlhf/k1-reward", "areal/k1-reward",
                "trl/rloo-k1-reward", "skyrl/kl-reward-grpo-k1", "nemo-rl/gae-k1-in-reward"):  # fmt: skip
        assert row(rows, pid)["err_rkl"] < 1e-12, pid
        assert row(rows, pid, "off_policy")["err_rkl"] > 0.05, pid
    # ... and under a per-sequence mean, the length-weighted KL with a push to short answers
    for pid in ("ms-swift/kl-in-reward", "trl/rloo-k1-reward", "verl/kl-reward-grpo"):
        assert row(rows, pid, aggregation="seq_mean")["equals"] == "E[(log(π/π_ref) − 1)/|y|]", pid
    # slime: --kl-coef with grpo is ignored; reinforce++ sums it, the per-sequence mean reweights it
    assert row(rows, "slime/kl-coef-grpo")["equals"] == "none@sequence/|y|"
    assert row(rows, "slime/kl-coef-reinforce-pp")["equals"] == "k2_as_loss@token_to_go/|y|"
    assert row(rows, "slime/kl-coef-reinforce-pp", aggregation="token_sum")["err_rkl"] < 1e-12
    assert row(rows, "slime/kl-coef-reinforce-pp-baseline")["equals"] == "k2_as_loss@token/|y|"
    # NeMo-RL's Reinforce++ k3 per token, no return: no KL gradient (0.87 relative error on this problem)
    assert row(rows, "nemo-rl/reinforce-pp-kl-in-reward")["err_rkl"] > 0.5
    # GAE with λ = 0.95 (zero critic) discounts the KL return: close to, but not, the reverse-KL gradient
    assert 1e-3 < row(rows, "trl/ppo-k1-reward")["err_rkl"] < 0.1
    # Tinker's summed baseline depends on the length: not exact
    assert row(rows, "tinker/kl-advantage-discounted")["err_rkl"] > 0.05
    # no IS on a KL loss: off-policy it is no longer the on-policy gradient
    assert row(rows, "trl/grpo-k3", "off_policy")["equals"].startswith("≈")
    # RPG in its own setting (reference = behaviour π_old, samples from π_old): the forward forms are exact
    for pid in ("rpg/fkl-iterative", "rpg/ufkl-iterative"):
        assert row(rows, pid, "off_policy")["err_fkl"] < 1e-12
    # ... and its rf reward forms see log w = 0: rf_ufkl, rf_urkl add nothing
    for pid in ("rpg/rf-ufkl-reward", "rpg/rf-urkl-reward"):
        assert row(rows, pid, "off_policy")["equals"] == "none@sequence (zero)"


def test_reference_is_behaviour_presets_are_audited_off_policy_only(all_rows):
    for r in all_rows:
        if r["reference"] != "π_ref":
            assert r["regime"] == "off_policy", r["id"]
    ids = {r["id"] for r in all_rows}
    assert {p.id for p in PRESETS} == ids  # every preset has rows


def test_rows_carry_versions_source_and_aggregation(all_rows):
    for r in all_rows:
        assert r["versions"], r["id"]
        assert r["source"], r["id"]
        assert r["aggregation"] in AGGREGATIONS, r["id"]
    # each preset: its default aggregation and the other family's, both regimes (or off-policy only)
    by_id = {}
    for r in all_rows:
        by_id.setdefault(r["id"], set()).add((r["aggregation"], r["regime"]))
    for p in PRESETS:
        assert len(by_id[p.id]) == 2 * len(p.regimes), p.id


def test_sum_family_aggregations_differ_from_a_token_sum_by_beta_alone():
    """A constant normaliser (Dr. GRPO's L) divides the exact expected gradient and leaves its direction: the
    token-mean and constant rows are audited as the token sum, and dividing the loss by L divides the gradient."""
    from klgrad.audit.tabular import expected_gradient, token_logps

    problem = make_problem(AuditConfig())
    sp = problem.space
    preset = next(p for p in PRESETS if p.id == "verl/kl-loss-low-var-kl")
    ref_lp = token_logps(sp, problem.ref)
    loss = preset.loss(ref_lp, sp.mask, "token_sum")
    g, _ = expected_gradient(sp, loss, problem.theta, problem.theta)
    g4, _ = expected_gradient(sp, lambda lp, b: loss(lp, b) / 4.0, problem.theta, problem.theta)
    assert torch.allclose(g4 * 4.0, g, rtol=1e-12, atol=0)


def test_a_batch_baseline_leaves_the_on_policy_gradient():
    """Tinker's batch-mean baseline is a constant per token: E_π[c·∇log π_t] = 0, so on-policy (and with the
    unclipped importance weight off-policy) the preset's expected gradient equals the one without it."""
    import dataclasses

    from klgrad.audit.tabular import expected_gradient, token_logps

    problem = make_problem(AuditConfig())
    sp = problem.space
    ref_lp = token_logps(sp, problem.ref)
    with_b = next(p for p in PRESETS if p.id == "tinker/kl-advantage")
    without = dataclasses.replace(with_b, batch_baseline=False)
    for sampler in (problem.theta, problem.behaviour):
        g1, _ = expected_gradient(sp, with_b.loss(ref_lp, sp.mask, "token_sum"), problem.theta, sampler)
        g0, _ = expected_gradient(sp, without.loss(ref_lp, sp.mask, "token_sum"), problem.theta, sampler)
        assert float((g1 - g0).norm()) < 1e-12 * float(g0.norm())


@pytest.mark.parametrize("remedy", REMEDIES, ids=lambda r: r.framework)
def test_every_remedy_claim_holds_in_the_audit(remedy, all_rows):
    """The remedy table of docs/frameworks.md: each claim checked against the audit's own rows."""
    assert remedy.framework in (*FRAMEWORKS, "klgrad")
    hit = remedy_row(remedy, all_rows)
    if remedy.claim == "none":
        assert hit is None
    elif remedy.claim == "exact":
        assert hit["err_rkl"] < 1e-12, remedy
    elif remedy.claim == "exact_fkl":
        assert hit["err_fkl"] < 1e-12, remedy
    else:
        assert remedy.claim == "local_rkl"
        assert hit["equals"] == "k2_as_loss@token (local_rkl)", remedy
    if hit is not None:
        assert hit["framework"] == remedy.framework
    assert {r.framework for r in REMEDIES} == {*FRAMEWORKS, "klgrad"}


def test_nearest_head_breaks_round_off_ties_by_table_order():
    """Two heads with the same expected gradient differ in float64 by round-off: the first in table order is named,
    whichever of the two the round-off favours."""
    from klgrad.audit.frameworks import nearest_head

    g = torch.tensor([1.0, 0.0], dtype=F64)
    far = torch.tensor([0.0, 1.0], dtype=F64)
    for eps in (1e-15, -1e-15):
        table = {"a@token": torch.tensor([0.5, 0.5], dtype=F64), "b@token": torch.tensor([0.5, 0.5 + eps], dtype=F64),
                 "c@token": far}  # fmt: skip
        assert nearest_head(g, table, 1.0).startswith("≈ a@token (")


def test_clamp_ranges_are_where_the_formulas_say():
    by_id = {p.id: p for p in PRESETS}
    # k3 = e^{-u} - 1 + u reaches 10 at u ≈ -2.6150 (below: clamped) and u ≈ 11.00002 (above)
    assert frozen_range(by_id["verl/kl-loss-low-var-kl"], "gradient") == "u ≤ -2.62, u ≥ 11"
    edge = math.ceil(math.sqrt(20) * 100) / 100  # ½u² = 10 at |u| = √20, first grid point (step 0.01) beyond
    assert frozen_range(by_id["openrlhf/kl-loss-k2"], "gradient") == f"u ≤ {-edge:.3g}, u ≥ {edge:.3g}"
    assert frozen_range(by_id["trl/grpo-k3"], "gradient") is None
    assert frozen_range(by_id["nemo-rl/k3-loss-input-clamp"], "gradient") == "u ≤ -20, u ≥ 20"  # the input clamp
    # a cancellation to an exact 0 is no clamp: ∂(ρ·k3)/∂l = u is computed as (1 − e^{−u}) + (e^{−u} − 1 + u)
    assert frozen_range(by_id["trl/grpo-k3-bias-correction"], "gradient", limit=45.0, steps=9001) is None
    assert frozen_range(by_id["slime/kl-coef-grpo"], "value") is None  # an ignored flag: constant, not clamped
    assert frozen_range(by_id["openrlhf/k1-reward"], "value") == "u ≤ -10, u ≥ 10"


@needs_extras("trl")  # ends with an audit of the installed TRL
def test_cli_writes_frameworks_json(tmp_path, capsys):
    from klgrad.cli import main

    assert main(["audit", "--framework", "verl", "--version", "0.7.1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "frameworks.json").read_text())
    assert {r["framework"] for r in data["rows"]} == {"verl"}
    assert {r["regime"] for r in data["rows"]} == {"on_policy", "off_policy"}
    assert "verl/kl-loss-low-var-kl-plus" not in {r["id"] for r in data["rows"]}  # raised in 0.6.0–0.7.1
    for r in data["rows"]:
        assert {
            "id",
            "framework",
            "variant",
            "regime",
            "versions",
            "source",
            "aggregation",
            "err_rkl",
            "equals",
        } <= set(r)
    out = capsys.readouterr().out
    assert "low_var_kl" in out
    assert "In verl 0.7.1, switching the KL on" in out
    assert "The exact reverse-KL gradient in verl (Hydra overrides)" in out
    assert main(["audit", "--framework", "trl", "--out", str(tmp_path)]) == 0  # the installed TRL's version
    out = capsys.readouterr().out
    assert "the installed package trl is version" in out
    assert main(["audit", "--framework", "roll", "--version", "0.1.1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "roll/kl-loss-k3: kl_loss_coef defaults to 0, so the switch alone adds no KL" in out
    assert main(["audit", "--framework", "nope", "--out", str(tmp_path)]) == 2
    assert main(["audit", "--framework", "all", "--version", "1.0", "--out", str(tmp_path)]) == 2
