"""Tests for klgrad.objective: aggregation, advantages (combined / decoupled), the clipped PG loss, the
full objective, micro-batching and diagnostics (docs/math.md: levels, forms, off-policy, reward shaping).

Every test would fail if the math were wrong: hand-worked values (arithmetic in the comments), plain-Python
loop references, autograd gradients compared at float64 with atol/rtol 1e-12 (or exact equality), and
hypothesis property tests (micro-batching == full batch; padding never matters).

``test_diagnostics_keep_float64_precision`` is the regression test of a defect this file found (diagnostics
lowered float64 to float32 and cancelled large per-sequence sums); it was fixed in objective.py.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.advantages import shape_rewards
from klgrad.choices import AGGREGATIONS, RATIO_LEVELS
from klgrad.config import AlgoConfig, KLConfig
from klgrad.kl import kl_loss_per_sequence
from klgrad.objective import (
    ObjectiveSpec,
    aggregate,
    aggregate_totals,
    combined_advantages,
    decoupled_advantages,
    objective_diagnostics,
    policy_gradient_loss,
    policy_objective,
)

pytestmark = pytest.mark.numerics

F64 = torch.float64
NAN = float("nan")
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def t64(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def mask_of(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def close(a, b, **kw) -> None:
    torch.testing.assert_close(a, b, **(kw or TIGHT))


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def random_batch(B: int, T: int, seed: int, *, pad=NAN):
    """Random float64 (logp, ref, old, mask) with left padding and holes; padding filled with ``pad``.

    Log-probs in [-3.05, -0.05]; ref = logp + N(0, 0.5²); old = logp + N(0, 0.3²) so that importance
    ratios land on both sides of every clip boundary. Rows may be fully masked.
    """
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.05
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.25  # holes
    left = torch.randint(0, T, (B,), generator=g)  # left padding of 0..T-1 tokens
    mask &= torch.arange(T)[None, :] >= left[:, None]
    for x in (logp, ref, old):
        x[~mask] = pad
    return logp, ref, old, mask


def safe_entropy(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-token 'entropy' -p log p that carries gradient through logp; NaN at padding.

    (Computed on a where-cleaned copy so that the test's own padding never produces NaN gradients.)
    """
    l = torch.where(mask, logp, 0.0)
    return torch.where(mask, -(l.exp() * l), NAN)


# ==========================================================================================================
# 1. aggregate / aggregate_totals
#
# per_token (B=2, T=3) with an uneven mask (so token_mean != seq_mean_token_mean); masked entries are NaN:
#   mask   = [[0, 0, 1],        row 0: left padding of 2, one token
#             [1, 0, 1]]        row 1: a hole in the middle, two tokens
#   values = [[NaN, NaN, 3],
#             [2, NaN, 5]]      -> totals [3, 7], counts [1, 2], Σ totals = 10, Σ m = 3
#   seq_mean_token_sum  = (3 + 7) / 2           = 5
#   token_mean          = 10 / 3
#   seq_mean_token_mean = (3/1 + 7/2) / 2 = 6.5/2 = 3.25
# With global normalisers num_sequences = 4, num_tokens = 8:
#   seq_mean_token_sum  = 10 / 4 = 2.5;  token_mean = 10 / 8 = 1.25;  seq_mean_token_mean = 6.5 / 4 = 1.625
# Gradient d agg / d values[i, t] = m_it / B, m_it / Σm, m_it / (B · n_i) respectively (0 at padding).
# ==========================================================================================================

AGG_MASK = [[False, False, True], [True, False, True]]
AGG_VALUES = [[NAN, NAN, 3.0], [2.0, NAN, 5.0]]
AGG_HAND = {"seq_mean_token_sum": 5.0, "token_mean": 10.0 / 3.0, "seq_mean_token_mean": 3.25}
AGG_HAND_GLOBAL = {"seq_mean_token_sum": 2.5, "token_mean": 1.25, "seq_mean_token_mean": 1.625}
AGG_GRAD = {
    "seq_mean_token_sum": [[0.0, 0.0, 1 / 2], [1 / 2, 0.0, 1 / 2]],
    "token_mean": [[0.0, 0.0, 1 / 3], [1 / 3, 0.0, 1 / 3]],
    "seq_mean_token_mean": [[0.0, 0.0, 1 / 2], [1 / 4, 0.0, 1 / 4]],
}


def test_aggregation_names():
    assert set(AGGREGATIONS) == {"seq_mean_token_sum", "token_mean", "seq_mean_token_mean"}


@pytest.mark.parametrize("mode", sorted(AGG_HAND))
def test_aggregate_hand_values_and_gradient(mode):
    x = t64(AGG_VALUES).requires_grad_(True)
    mask = mask_of(AGG_MASK)
    out = aggregate(x, mask, mode)
    assert out.dim() == 0
    assert out.item() == pytest.approx(AGG_HAND[mode], rel=1e-15, abs=1e-15)
    g = grad_of(out, x)
    close(g, t64(AGG_GRAD[mode]))  # finite (no NaN leaks from the padding) and exact
    # 0/1 float mask and bool mask agree
    assert aggregate(x, mask.to(F64), mode).item() == out.item()


@pytest.mark.parametrize("mode", sorted(AGG_HAND))
def test_aggregate_global_normalisers(mode):
    x = t64(AGG_VALUES)
    out = aggregate(x, mask_of(AGG_MASK), mode, num_sequences=4, num_tokens=8)
    assert out.item() == pytest.approx(AGG_HAND_GLOBAL[mode], rel=1e-15, abs=1e-15)


@pytest.mark.parametrize("mode", sorted(AGG_HAND))
def test_aggregate_totals_consistent_with_aggregate(mode):
    mask = mask_of(AGG_MASK)
    x = t64(AGG_VALUES)
    totals = torch.where(mask, x, 0.0).sum(-1)  # [3, 7]
    assert totals.tolist() == [3.0, 7.0]
    for kw in ({}, {"num_sequences": 4, "num_tokens": 8}, {"num_sequences": 3, "num_tokens": 5.0}):
        a = aggregate(x, mask, mode, **kw)
        b = aggregate_totals(totals, mask, mode, **kw)
        assert a.item() == pytest.approx(b.item(), rel=1e-15, abs=1e-15)
    # random case too
    logp, _, _, m = random_batch(5, 4, seed=3)
    tot = torch.where(m, logp, 0.0).sum(-1)
    close(aggregate(logp, m, mode), aggregate_totals(tot, m, mode))


def test_aggregate_unknown_mode_raises():
    x, mask = t64(AGG_VALUES), mask_of(AGG_MASK)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, mask, "token_sum")
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_totals(torch.zeros(2, dtype=F64), mask, "mean")


# ==========================================================================================================
# 2. Micro-batching: Σ over row chunks of policy_objective(chunk, num_sequences=B, num_tokens=Σm).loss equals
#    the full-batch loss, and its gradient w.r.t. logp equals the full-batch gradient. Advantages are
#    computed on the full batch first (as a trainer would), then split.
# ==========================================================================================================

FORM_LEVELS = (
    ("decoupled", "sequence"),
    ("decoupled", "token_to_go"),
    ("decoupled", "token"),
    ("combined", "sequence"),
    ("combined", "token_to_go"),
)


@settings(max_examples=40, deadline=None)
@given(
    n_groups=st.integers(1, 3),
    G=st.integers(2, 3),
    T=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    head=st.sampled_from(("k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward", "mse_in_reward")),
    method=st.sampled_from(("none", "grpo", "rloo", "group_baseline", "reinforce_pp_baseline")),
    ratio_level=st.sampled_from(("token", "sequence")),  # the reward head's exact IS ratios
    kl_ratio_level=st.sampled_from(RATIO_LEVELS),
    dual_clip=st.sampled_from((None, 1.5)),
    entropy_coef=st.sampled_from((0.0, 0.01)),
    data=st.data(),
)
def test_micro_batching_equals_full_batch(
    n_groups, G, T, seed, head, method, ratio_level, kl_ratio_level, dual_clip, entropy_coef, data
):
    B = n_groups * G
    cuts = data.draw(st.sets(st.integers(1, B - 1), max_size=B - 1), label="cuts")
    bounds = [0, *sorted(cuts), B]
    logp0, ref, old, mask = random_batch(B, T, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rewards = torch.rand(B, generator=g, dtype=F64)
    n_tok = int(mask.sum())

    for form, level in FORM_LEVELS:
        if form == "combined":
            adv = combined_advantages(
                rewards, head, logp0, ref, mask, beta=0.3, level=level, group_size=G, method=method
            )
        else:
            adv = decoupled_advantages(rewards, mask, G, method)
        for agg in AGGREGATIONS:
            spec = ObjectiveSpec(
                KLConfig(head=head, beta=0.3, level=level, form=form, clip_eps=0.2, ratio_level=kl_ratio_level),
                AlgoConfig(
                    clip_eps_low=0.2,
                    clip_eps_high=0.28,
                    dual_clip=dual_clip,
                    ratio_level=ratio_level,
                    aggregation=agg,
                    entropy_coef=entropy_coef,
                ),
            )
            for old_logp in (None, old):
                logp = logp0.clone().requires_grad_(True)
                ent = safe_entropy(logp, mask)
                full = policy_objective(logp, ref, mask, adv, spec, old_logp=old_logp, entropy=ent).loss
                g_full = grad_of(full, logp)

                logp = logp0.clone().requires_grad_(True)
                ent = safe_entropy(logp, mask)
                parts = []
                for a, b in itertools.pairwise(bounds):
                    parts.append(
                        policy_objective(
                            logp[a:b],
                            ref[a:b],
                            mask[a:b],
                            adv[a:b],
                            spec,
                            old_logp=None if old_logp is None else old_logp[a:b],
                            entropy=ent[a:b],
                            num_sequences=B,
                            num_tokens=n_tok,
                        ).loss
                    )
                total = torch.stack(parts).sum()
                g_chunks = grad_of(total, logp)

                ctx = f"{form}/{level}/{agg}/{'on' if old_logp is None else 'off'} bounds={bounds}"
                assert torch.isfinite(full), ctx
                torch.testing.assert_close(total, full, msg=ctx, **TIGHT)
                torch.testing.assert_close(g_chunks, g_full, msg=ctx, **TIGHT)
                assert torch.all(g_full[~mask] == 0), ctx  # padding (NaN) gets exactly zero gradient
                assert torch.isfinite(g_full).all(), ctx


# ==========================================================================================================
# 3. policy_gradient_loss
# ==========================================================================================================


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_pg_on_policy_value_and_gradient(ratio_level):
    logp, _, _, mask = random_batch(3, 4, seed=11)
    adv = torch.where(mask, torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(1)), NAN)
    x = logp.clone().requires_grad_(True)
    loss = policy_gradient_loss(x, adv, mask, ratio_level=ratio_level, clip_eps_low=0.1, clip_eps_high=0.3)
    expected = torch.where(mask, -adv, 0.0)  # ρ = 1 in value: ℓ = max(-A, -A·clip(1)) = -A
    close(loss.detach(), expected)
    # gradient of Σ ℓ w.r.t. l_t: -A_t (sequence ratio: ρ̃_t = sg(ρ)·exp(l_t - l̄_t) -> ∂/∂l_t = ρ = 1)
    close(grad_of(loss.sum(), x), expected)


# Asymmetric clip ε_low = 0.1, ε_high = 0.3 (range [0.9, 1.3]); token-level ratios, one token per case.
# (A, ρ, expected loss, expected ∂ℓ/∂l = -A·ρ if the gradient flows else 0)
PPO_CASES = [
    # A > 0: ℓ = -A·min(ρ, clip(ρ)); clipped (no gradient) iff ρ > 1 + ε_high
    (2.0, 1.4, -2.0 * 1.3, 0.0),  # ρ > 1.3 -> clipped: loss -A(1+ε_high), zero grad
    (2.0, 1.25, -2.0 * 1.25, -2.0 * 1.25),  # 1.1 < ρ < 1.3: flows (would be clipped if ε_high were 0.1)
    (2.0, 0.8, -2.0 * 0.8, -2.0 * 0.8),  # ρ < 1 - ε_low: still flows for A > 0
    # A < 0: ℓ = |A|·max(ρ, clip(ρ)); clipped iff ρ < 1 - ε_low
    (-3.0, 0.8, 3.0 * 0.9, 0.0),  # ρ < 0.9 -> clipped: loss |A|(1-ε_low), zero grad
    (-3.0, 0.85, 3.0 * 0.9, 0.0),  # 0.85 < 0.9 -> clipped (would flow if ε_low were 0.3 = ε_high)
    (-3.0, 0.95, 3.0 * 0.95, 3.0 * 0.95),  # inside: flows
    (-3.0, 1.4, 3.0 * 1.4, 3.0 * 1.4),  # ρ > 1 + ε_high: flows for A < 0
    (0.0, 2.0, 0.0, 0.0),
]


@pytest.mark.parametrize(("A", "rho", "loss_exp", "grad_exp"), PPO_CASES)
def test_pg_ppo_clip_sides_asymmetric(A, rho, loss_exp, grad_exp):
    # B=1, T=3; token 0 is left padding (NaN everywhere), token 1 is the case, token 2 a neutral A=0 token.
    mask = mask_of([[False, True, True]])
    l = t64([[NAN, -1.0, -2.0]]).requires_grad_(True)
    old = t64([[NAN, -1.0 - math.log(rho), -2.0]])
    adv = t64([[NAN, A, 0.0]])
    loss = policy_gradient_loss(l, adv, mask, old_logp=old, clip_eps_low=0.1, clip_eps_high=0.3)
    assert loss[0, 0].item() == 0.0
    assert loss[0, 2].item() == 0.0
    assert loss[0, 1].item() == pytest.approx(loss_exp, rel=1e-12, abs=1e-12)
    g = grad_of(loss.sum(), l)
    assert g[0, 1].item() == pytest.approx(grad_exp, rel=1e-12, abs=1e-12)
    assert g[0, 0].item() == 0.0
    assert g[0, 2].item() == 0.0


# Dual clip c = 3 (ε = 0.2): for A < 0, ℓ = min(|A|·max(ρ, clip(ρ)), c·|A|).
DUAL_CASES = [
    (-2.0, 4.0, 3.0 * 2.0, 0.0),  # ρ > c: loss = -c·A = 6, zero gradient
    (-2.0, 2.0, 2.0 * 2.0, 2.0 * 2.0),  # 1.2 < ρ < c: plain IS term, flows
    (-2.0, 0.5, 2.0 * 0.8, 0.0),  # ordinary PPO clip for A < 0
    (2.0, 4.0, -2.0 * 1.2, 0.0),  # A > 0 untouched by dual clip
]


@pytest.mark.parametrize(("A", "rho", "loss_exp", "grad_exp"), DUAL_CASES)
def test_pg_dual_clip(A, rho, loss_exp, grad_exp):
    mask = mask_of([[True]])
    l = t64([[-1.0]]).requires_grad_(True)
    old = t64([[-1.0 - math.log(rho)]])
    loss = policy_gradient_loss(l, t64([[A]]), mask, old_logp=old, dual_clip=3.0)
    assert loss.item() == pytest.approx(loss_exp, rel=1e-12, abs=1e-12)
    assert grad_of(loss.sum(), l).item() == pytest.approx(grad_exp, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_pg_padding_never_matters(ratio_level, dual_clip):
    logp_nan, _, old_nan, mask = random_batch(4, 5, seed=5, pad=NAN)
    assert (~mask).any()
    g = torch.Generator().manual_seed(2)
    adv_base = torch.randn(4, 5, generator=g, dtype=F64)
    results = []
    for pad in (NAN, 0.0, 1e6, -1e6):
        l = torch.where(mask, logp_nan, pad).requires_grad_(True)
        o = torch.where(mask, old_nan, pad)
        a = torch.where(mask, adv_base, pad)
        kw = dict(ratio_level=ratio_level, dual_clip=dual_clip, clip_eps_low=0.2, clip_eps_high=0.28)
        loss = policy_gradient_loss(l, a, mask, old_logp=o, **kw)
        results.append((loss.detach(), grad_of(loss.sum(), l)))
        # on-policy too
        loss_on = policy_gradient_loss(l, a, mask, **kw)
        results.append((loss_on.detach(), grad_of(loss_on.sum(), l)))
    for i in range(2, len(results)):
        ref_loss, ref_grad = results[i % 2]
        assert torch.equal(results[i][0], ref_loss)
        assert torch.equal(results[i][1], ref_grad)
    for loss, grad in results:
        assert torch.isfinite(loss).all()
        assert torch.isfinite(grad).all()
        assert torch.all(loss[~mask] == 0)
        assert torch.all(grad[~mask] == 0)


# ==========================================================================================================
# 4. Off-policy check (docs/math.md, “Off-policy: importance sampling and the clip side”): R = 0, no shaping,
#    ε_low = ε_high = ε_KL, sequence ratios for both heads -> the decoupled KL head's gradient equals the
#    combined form's gradient, for every ratio, at sequence and token_to_go.
# ==========================================================================================================

SWEEP_RATIOS = (0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0)
EPS = 0.2
BETA = 0.7


@pytest.mark.parametrize("level", ["sequence", "token_to_go"])
@pytest.mark.parametrize("head", ["k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward"])
@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])  # 0.0: mixed-sign per-token log-ratios
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_decoupled_kl_head_gradient_equals_combined(level, head, sign, agg):
    # B=1, T=4, left padding of 1. u_t = l_t - r_t = sign·[0.3, 0.1, 0.2] (mixed: [0.3, -0.5, 0.1]).
    mask = mask_of([[False, True, True, True]])
    l0 = t64([[NAN, -1.2, -0.4, -2.0]])
    u = t64([[NAN, 0.3, -0.5, 0.1]]) if sign == 0.0 else sign * t64([[NAN, 0.3, 0.1, 0.2]])
    ref = l0 - u
    U = float(u[mask].sum())
    pg = AlgoConfig(clip_eps_low=EPS, clip_eps_high=EPS, ratio_level="sequence", aggregation=agg)
    kl = dict(head=head, beta=BETA, level=level, clip_eps=EPS, ratio_level="sequence")
    spec_c = ObjectiveSpec(KLConfig(form="combined", **kl), pg)
    spec_d = ObjectiveSpec(KLConfig(form="decoupled", **kl), pg)
    R = torch.zeros(1, dtype=F64)
    adv_c = combined_advantages(R, head, l0, ref, mask, beta=BETA, level=level, group_size=1, method="none")
    adv_d = decoupled_advantages(R, mask, 1, "none")
    assert torch.all(adv_d == 0)
    for rho in SWEEP_RATIOS:
        # spread log ρ over the 3 response tokens: Σ_t (l_t - o_t) = log ρ
        old = torch.where(mask, l0 - math.log(rho) / 3, NAN)
        l = l0.clone().requires_grad_(True)
        g_c = grad_of(policy_objective(l, ref, mask, adv_c, spec_c, old_logp=old).loss, l)
        l = l0.clone().requires_grad_(True)
        terms_d = policy_objective(l, ref, mask, adv_d, spec_d, old_logp=old)
        assert terms_d.policy_loss.item() == 0.0
        g_d = grad_of(terms_d.loss, l)
        torch.testing.assert_close(g_d, g_c, msg=f"rho={rho}", **TIGHT)
        if level == "sequence" and agg == "seq_mean_token_sum" and sign != 0.0:
            # Independent expectation: every token gets β·c(U)·ρ unless the clip removed the gradient
            # (c > 0 pushes ρ down: clipped iff ρ < 1-ε; c < 0: clipped iff ρ > 1+ε).
            c = {"k1_in_reward": U, "k2_as_loss": U}.get(head, 1.0 - math.exp(-U))
            clipped = (c > 0 and rho < 1 - EPS) or (c < 0 and rho > 1 + EPS)
            exp_g = 0.0 if clipped else BETA * c * rho
            close(g_c, torch.where(mask, t64(exp_g), t64(0.0)))


# ==========================================================================================================
# 5. combined_advantages against a plain-loop reference
# ==========================================================================================================

# B = 4, T = 4, G = 2 or 4; left padding, holes and different lengths.
CA_MASK = [[False, True, True, True], [True, False, True, True], [False, False, True, True], [True] * 4]
CA_L = [[NAN, -0.5, -1.5, -0.25], [-2.0, NAN, -0.75, -1.0], [NAN, NAN, -0.1, -3.0], [-0.2, -0.4, -0.6, -0.8]]
CA_U = [[NAN, 0.4, -0.3, 0.2], [0.1, NAN, 0.5, -0.6], [NAN, NAN, 0.9, 0.3], [-0.2, 0.05, 0.15, 0.7]]
CA_R = [1.0, 0.25, 0.5, 0.0]
CA_METHODS = ("none", "group_baseline", "rloo", "group_norm", "grpo", "reinforce_pp_baseline", "batch_norm")


def _c(head: str, u: float) -> float:
    return u if head == "k1_in_reward" else 1.0 - math.exp(-u)


def _clip(s: float, lo, hi) -> float:
    if lo is not None:
        s = max(s, lo)
    if hi is not None:
        s = min(s, hi)
    return s


def _loo_inv_std(others: list[float], std_min, std_max) -> float:
    """1/clip(stdev(others)); 0 when the std is undefined (< 2 others) or 0 after clipping."""
    if len(others) < 2:
        return 0.0
    s = _clip(statistics.stdev(others), std_min, std_max)
    return 1.0 / s if s > 0 else 0.0


def _ref_scale(x: list[float], G: int, method: str, std_min, std_max) -> list[float]:
    """Prefix multiplier s_{-i}: the normalisation computed with sample i left out, by plain loops."""
    B = len(x)
    if method in ("none", "group_baseline", "rloo", "dr_grpo", "batch_baseline"):
        return [1.0] * B
    out = []
    for i in range(B):
        g0 = i - i % G
        if method in ("group_norm", "grpo"):
            out.append(_loo_inv_std([x[j] for j in range(g0, g0 + G) if j != i], std_min, std_max))
        elif method in ("batch_norm", "reinforce", "reinforce_pp"):
            out.append(_loo_inv_std([x[j] for j in range(B) if j != i], std_min, std_max))
        elif method == "reinforce_pp_baseline":
            centred = []  # group baselines recomputed without sample i, then the batch std of the rest
            for h0 in range(0, B, G):
                members = [j for j in range(h0, h0 + G) if j != i]
                m = sum(x[j] for j in members) / len(members)
                centred += [x[j] - m for j in members]
            out.append(_loo_inv_std(centred, std_min, std_max))
        else:
            raise AssertionError(method)
    return out


@pytest.mark.parametrize("head", ["k1_in_reward", "k3_as_loss"])
@pytest.mark.parametrize("method", CA_METHODS)
@pytest.mark.parametrize(("std_min", "std_max"), [(None, None), (5.0, None), (None, 0.01)])
@pytest.mark.parametrize("beta", [0.0, 0.4])
@pytest.mark.parametrize("G", [2, 4])
def test_combined_advantages_reference(head, method, std_min, std_max, beta, G):
    mask = mask_of(CA_MASK)
    l = t64(CA_L)
    u = t64(CA_U)
    ref = l - u
    R = t64(CA_R)
    B, T = 4, 4
    # --- sequence: A = shape(R - β c(U)) on every response token
    U = [sum(CA_U[i][t] for t in range(T) if CA_MASK[i][t]) for i in range(B)]
    x_seq = t64([CA_R[i] - beta * _c(head, U[i]) for i in range(B)])
    a_seq = shape_rewards(x_seq, G, method, std_min, std_max)
    got = combined_advantages(
        R,
        head,
        l,
        ref,
        mask,
        beta=beta,
        level="sequence",
        group_size=G,
        method=method,
        std_min=std_min,
        std_max=std_max,
    )
    exp = t64([[a_seq[i].item() if CA_MASK[i][t] else 0.0 for t in range(T)] for i in range(B)])
    close(got, exp)
    # --- token_to_go: A_{i,t} = shape(R - β Σ c)_i + s_{-i} · β · Σ_{t'<t} c_t'
    c = [[_c(head, CA_U[i][t]) if CA_MASK[i][t] else 0.0 for t in range(T)] for i in range(B)]
    x_tot = [CA_R[i] - beta * sum(c[i]) for i in range(B)]
    a_tot = shape_rewards(t64(x_tot), G, method, std_min, std_max).tolist()
    scale = _ref_scale(x_tot, G, method, std_min, std_max)
    exp_rows = []
    for i in range(B):
        row, prefix = [], 0.0
        for t in range(T):
            row.append(a_tot[i] + scale[i] * beta * prefix if CA_MASK[i][t] else 0.0)
            prefix += c[i][t]
        exp_rows.append(row)
    got = combined_advantages(
        R,
        head,
        l,
        ref,
        mask,
        beta=beta,
        level="token_to_go",
        group_size=G,
        method=method,
        std_min=std_min,
        std_max=std_max,
    )
    close(got, t64(exp_rows))
    # at the first response token the token_to_go advantage is exactly shape(R - β Σ_t c_t)
    first = [CA_MASK[i].index(True) for i in range(B)]
    close(got[torch.arange(B), torch.tensor(first)], t64(a_tot))
    if beta == 0.0:
        close(got, exp)  # no KL: both levels are the broadcast shaped reward


def test_combined_advantages_token_level_raises():
    mask = mask_of(CA_MASK)
    l = t64(CA_L)
    with pytest.raises(ValueError, match="token"):
        combined_advantages(t64(CA_R), "k1_in_reward", l, l, mask, beta=0.1, level="token", group_size=2, method="grpo")


def test_combined_advantages_uses_current_logp_only_detached():
    mask = mask_of(CA_MASK)
    l = t64(CA_L).requires_grad_(True)
    ref = t64(CA_L) - t64(CA_U)
    a = combined_advantages(
        t64(CA_R), "k2_as_loss", l, ref, mask, beta=0.3, level="token_to_go", group_size=2, method="grpo"
    )
    assert not a.requires_grad
    assert torch.isfinite(a).all()


def test_decoupled_advantages_broadcast():
    mask = mask_of(CA_MASK)
    a = decoupled_advantages(t64(CA_R), mask, 2, "rloo")
    # rloo, G=2: a_i = r_i - r_other -> [0.75, -0.75, 0.5, -0.5]
    exp = [0.75, -0.75, 0.5, -0.5]
    close(a, t64([[exp[i] if CA_MASK[i][t] else 0.0 for t in range(4)] for i in range(4)]))


# ==========================================================================================================
# 6. ObjectiveSpec validation
# ==========================================================================================================


@pytest.mark.parametrize(
    ("record", "kwargs", "field"),
    [
        (KLConfig, {"beta": -0.1}, "beta"),
        (KLConfig, {"beta": NAN}, "beta"),
        (KLConfig, {"head": "k4_as_loss"}, "head"),
        (KLConfig, {"form": "mixed"}, "form"),
        (AlgoConfig, {"aggregation": "token_sum"}, "aggregation"),
        (AlgoConfig, {"clip_eps_low": 0.0}, "clip_eps_low"),
        (AlgoConfig, {"clip_eps_low": -0.1}, "clip_eps_low"),
        (AlgoConfig, {"clip_eps_low": 1.0}, "clip_eps_low"),
        (AlgoConfig, {"clip_eps_low": 1.5}, "clip_eps_low"),
        (AlgoConfig, {"clip_eps_high": 0.0}, "clip_eps_high"),
        (AlgoConfig, {"clip_eps_high": -0.2}, "clip_eps_high"),
        (AlgoConfig, {"dual_clip": 1.0}, "dual_clip"),
        (AlgoConfig, {"dual_clip": 0.5}, "dual_clip"),
        (KLConfig, {"clip_eps": 0.0}, "clip_eps"),
        (KLConfig, {"clip_eps": 1.0}, "clip_eps"),
        (KLConfig, {"clip_eps": -0.3}, "clip_eps"),
        (AlgoConfig, {"entropy_coef": -1e-3}, "entropy_coef"),
        (KLConfig, {"form": "combined", "level": "token"}, "level"),
    ],
)
def test_the_objective_records_reject_bad_values(record, kwargs, field):
    """The loss's options are checked once, by the records the objective takes (the config's own sections)."""
    with pytest.raises(ValueError, match=field):
        record(**kwargs)
    with pytest.raises(ValueError, match="max_log_ratio"):
        ObjectiveSpec(max_log_ratio=0.0)


@pytest.mark.parametrize(
    ("kl", "pg"),
    [
        ({}, {}),
        ({}, {"clip_eps_high": 1.5, "clip_eps_low": 0.999}),  # clip-higher may exceed 1
        ({"clip_eps": None}, {"dual_clip": 1.0001}),
        ({"form": "decoupled", "level": "token"}, {}),
        ({"form": "combined", "level": "token_to_go"}, {}),
        ({"beta": 0.0}, {"entropy_coef": 0.0}),
    ],
)
def test_the_objective_records_accept_good_values(kl, pg):
    spec = ObjectiveSpec(KLConfig(**kl), AlgoConfig(**pg))
    assert spec.head.name == spec.kl.head


# ==========================================================================================================
# 7. policy_objective
# ==========================================================================================================


def _setup(seed=21, B=4, T=5):
    logp0, ref, old, mask = random_batch(B, T, seed)
    g = torch.Generator().manual_seed(seed)
    adv = decoupled_advantages(torch.rand(B, generator=g, dtype=F64), mask, 2, "grpo")
    return logp0, ref, old, mask, adv


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("level", ["sequence", "token_to_go", "token"])
@pytest.mark.parametrize("off", [False, True])
def test_decoupled_loss_is_pg_plus_beta_kl(agg, level, off):
    logp0, ref, old, mask, adv = _setup()
    old_logp = old if off else None
    spec = ObjectiveSpec(
        KLConfig(head="k3_as_loss", beta=0.37, level=level), AlgoConfig(aggregation=agg, ratio_level="token")
    )
    logp = logp0.clone().requires_grad_(True)
    terms = policy_objective(logp, ref, mask, adv, spec, old_logp=old_logp)
    assert terms.loss.item() == terms.policy_loss.item() + 0.37 * terms.kl_loss.item()
    assert not terms.policy_loss.requires_grad
    assert not terms.kl_loss.requires_grad
    assert terms.entropy.item() == 0.0
    # each part equals its independent computation
    pg = aggregate(policy_gradient_loss(logp0, adv, mask, old_logp=old_logp), mask, agg)
    kl_tot = kl_loss_per_sequence(
        "k3_as_loss", logp0, ref, mask, old_logp=old_logp, level=level, clip_eps=0.2, ratio_level="sequence"
    )
    kl = aggregate_totals(kl_tot, mask, agg)
    assert terms.policy_loss.item() == pytest.approx(pg.item(), rel=1e-12, abs=1e-12)
    assert terms.kl_loss.item() == pytest.approx(kl.item(), rel=1e-12, abs=1e-12)
    assert terms.kl_loss.item() != 0.0
    # and the gradient of loss is the gradient of pg + β kl
    g = grad_of(terms.loss, logp)
    x = logp0.clone().requires_grad_(True)
    pg_x = aggregate(policy_gradient_loss(x, adv, mask, old_logp=old_logp), mask, agg)
    kl_x = aggregate_totals(
        kl_loss_per_sequence("k3_as_loss", x, ref, mask, old_logp=old_logp, level=level, clip_eps=0.2),
        mask,
        agg,
    )
    close(g, grad_of(pg_x + 0.37 * kl_x, x))


def test_combined_form_has_no_kl_loss():
    logp0, ref, _, mask, _ = _setup()
    spec = ObjectiveSpec(KLConfig(head="k2_as_loss", beta=0.5, form="combined", level="token_to_go"))
    adv = combined_advantages(
        torch.ones(4, dtype=F64) * t64([1, 0, 0, 1]),
        "k2_as_loss",
        logp0,
        ref,
        mask,
        beta=0.5,
        level="token_to_go",
        group_size=2,
        method="grpo",
    )
    logp = logp0.clone().requires_grad_(True)
    terms = policy_objective(logp, ref, mask, adv, spec)
    assert terms.kl_loss.item() == 0.0
    assert terms.loss.item() == terms.policy_loss.item()
    close(grad_of(terms.loss, logp), grad_of(aggregate(policy_gradient_loss(logp, adv, mask), mask), logp))


def test_entropy_coef_without_entropy_raises():
    logp0, ref, _, mask, adv = _setup()
    with pytest.raises(ValueError, match="entropy"):
        policy_objective(logp0, ref, mask, adv, ObjectiveSpec(pg=AlgoConfig(entropy_coef=0.01)))


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_entropy_bonus_lowers_loss_by_coef_times_aggregate(agg):
    logp0, ref, _, mask, adv = _setup()
    coef = 0.03
    base = ObjectiveSpec(KLConfig(head="k2_as_loss", beta=0.2), AlgoConfig(aggregation=agg))
    spec = ObjectiveSpec(KLConfig(head="k2_as_loss", beta=0.2), AlgoConfig(aggregation=agg, entropy_coef=coef))
    ent0 = safe_entropy(logp0, mask).detach()
    ent = ent0.clone().requires_grad_(True)
    t0 = policy_objective(logp0, ref, mask, adv, base, entropy=ent)
    t1 = policy_objective(logp0, ref, mask, adv, spec, entropy=ent)
    agg_ent = aggregate(ent0, mask, agg).item()
    assert agg_ent > 0
    assert t1.loss.item() == pytest.approx(t0.loss.item() - coef * agg_ent, rel=1e-12, abs=1e-12)
    assert t1.entropy.item() == pytest.approx(agg_ent, rel=1e-12, abs=1e-12)
    assert t0.entropy.item() == 0.0  # coef 0: entropy not even aggregated
    # ∂loss/∂entropy = -coef · ∂agg/∂entropy
    g = grad_of(t1.loss, ent)
    e = ent0.clone().requires_grad_(True)
    close(g, -coef * grad_of(aggregate(e, mask, agg), e))


@pytest.mark.parametrize(("head", "beta"), [("none", 0.5), ("k2_as_loss", 0.0), ("k3_as_loss", 0.0)])
@pytest.mark.parametrize("off", [False, True])
def test_no_kl_term_for_head_none_or_beta_zero(head, beta, off):
    logp0, ref, old, mask, adv = _setup()
    old_logp = old if off else None
    spec = ObjectiveSpec(KLConfig(head=head, beta=beta))
    logp = logp0.clone().requires_grad_(True)
    terms = policy_objective(logp, ref, mask, adv, spec, old_logp=old_logp)
    assert terms.kl_loss.item() == 0.0
    assert terms.loss.item() == terms.policy_loss.item()
    x = logp0.clone().requires_grad_(True)
    close(
        grad_of(terms.loss, logp),
        grad_of(aggregate(policy_gradient_loss(x, adv, mask, old_logp=old_logp), mask), x),
    )


# ==========================================================================================================
# 8. objective_diagnostics
#
# The semantic tests below use dyadic inputs (multiples of 1/8) and power-of-two token counts, so every
# expected value is exact in float32 as well as float64; the float64-precision defect has its own test.
# ==========================================================================================================

# B=2, T=5; 8 response tokens (row 0: left padding of 1; row 1: a hole at t=2).
DG_MASK = [[False, True, True, True, True], [True, True, False, True, True]]
DG_L = [[NAN, -0.5, -1.25, -2.0, -0.125], [-1.0, -0.25, NAN, -3.0, -0.75]]
DG_U = [[NAN, 0.25, -0.5, 0.125, 0.375], [-0.25, -0.125, NAN, -0.5, 0.25]]
# U_0 = 0.25 - 0.5 + 0.125 + 0.375 = 0.25 ;  U_1 = -0.25 - 0.125 - 0.5 + 0.25 = -0.625
# kl_k1 = (0.25 - 0.625)/2 = -0.1875 ;  kl_k2 = (½·0.0625 + ½·0.390625)/2 = 0.11328125
# logp_gap = Σ u / 8 = -0.375/8 = -0.046875 ;  logp_gap_abs = (1.25 + 1.125)/8 = 0.296875


def _dg_inputs():
    mask = mask_of(DG_MASK)
    l = t64(DG_L)
    ref = torch.where(mask, l - t64(DG_U), NAN)
    adv = torch.where(mask, t64([[NAN, 1.0, -1.0, 2.0, 0.0], [0.5, -0.5, NAN, 1.0, -2.0]]), NAN)
    return l, ref, mask, adv


def test_diagnostics_on_policy_hand_values():
    l, ref, mask, adv = _dg_inputs()
    l = l.requires_grad_(True)
    spec = ObjectiveSpec(KLConfig(head="k2_as_loss", beta=0.5))
    d = objective_diagnostics(l, ref, mask, adv, spec)
    assert all(type(v) is float for v in d.values()), {k: type(v) for k, v in d.items()}
    assert d["ratio_mean"] == d["ratio_max"] == d["ratio_min"] == 1.0
    assert d["clip_frac"] == 0.0
    assert d["kl_clip_frac"] == 0.0
    assert d["kl_k1"] == -0.1875
    assert d["kl_k2"] == 0.11328125
    assert d["logp_gap"] == -0.046875
    assert d["logp_gap_abs"] == 0.296875
    assert d["kl_k3"] > 0  # k3 = e^{-U} - 1 + U ≥ 0 (its exact value: see the float64 test below)
    assert l.grad is None
    assert torch.is_grad_enabled()
    # explicit old_logp == logp is on-policy in value too: ratio exp(0) = 1, nothing clipped
    d2 = objective_diagnostics(l, ref, mask, adv, spec, old_logp=l.detach().clone())
    assert d2["ratio_mean"] == d2["ratio_max"] == d2["ratio_min"] == 1.0
    assert d2["clip_frac"] == 0.0
    assert d2["kl_clip_frac"] == 0.0
    for k in ("kl_k1", "kl_k2", "kl_k3", "logp_gap", "logp_gap_abs"):
        assert d2[k] == d[k]


def test_diagnostics_clip_frac_counts_clipped_branch():
    # ε_low = 0.25, ε_high = 0.5 (range [0.75, 1.5]); token ratios ρ = e^{l - o} set per token.
    # row 0 (A, ρ): (1, e^{0.5}=1.65) clipped | (-1, e^{-0.5}=0.61) clipped | (2, e^{-0.5}) flows
    #               | (0, e^2) not counted (A = 0)
    # row 1 (A, ρ): (0.5, 1) no | (-0.5, e^{0.5}) flows | (1, e^{0.25}=1.28 < 1.5) flows
    #               | (-2, e^{-1}) clipped
    # -> 3 clipped of 8 tokens: clip_frac = 0.375. Padding (NaN, or a huge log-ratio) is never counted.
    l, ref, mask, adv = _dg_inputs()
    log_rho = t64([[50.0, 0.5, -0.5, -0.5, 2.0], [0.0, 0.5, 50.0, 0.25, -1.0]])
    old = torch.where(mask, l - log_rho, NAN)
    spec = ObjectiveSpec(pg=AlgoConfig(clip_eps_low=0.25, clip_eps_high=0.5, ratio_level="token"))
    d = objective_diagnostics(l, ref, mask, adv, spec, old_logp=old)
    assert d["clip_frac"] == 0.375
    assert d["kl_clip_frac"] == 0.0  # head 'none'
    # cross-check against the gradient: the counted tokens are exactly those with A ≠ 0 and zero PG gradient
    x = l.clone().requires_grad_(True)
    pg = policy_gradient_loss(x, adv, mask, old_logp=old, clip_eps_low=0.25, clip_eps_high=0.5)
    g = grad_of(pg.sum(), x)
    a = torch.where(mask, adv, 0.0)
    assert int(((g == 0) & (a != 0) & mask).sum()) == 3


@pytest.mark.parametrize("seed", range(6))
def test_diagnostics_clip_frac_matches_zero_gradient_tokens(seed):
    logp, ref, old, mask = random_batch(4, 8, seed)
    adv = torch.where(mask, torch.randn(4, 8, dtype=F64, generator=torch.Generator().manual_seed(seed)), NAN)
    spec = ObjectiveSpec(pg=AlgoConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    d = objective_diagnostics(logp, ref, mask, adv, spec, old_logp=old)
    x = logp.clone().requires_grad_(True)
    pg = policy_gradient_loss(x, adv, mask, old_logp=old, clip_eps_low=0.2, clip_eps_high=0.28)
    g = grad_of(pg.sum(), x)
    n_zero = int(((g == 0) & mask & (torch.where(mask, adv, 0.0) != 0)).sum())
    assert round(d["clip_frac"] * int(mask.sum())) == n_zero


def test_diagnostics_kl_clip_frac():
    # decoupled k1_in_reward at sequence level, sequence ratios, ε = 0.2:
    # row 0: U = 0.25 > 0 (c > 0), ρ_seq = e^{-1} = 0.37 < 0.8 -> clipped, its 4 tokens count
    # row 1: U = -0.625 (c < 0), ρ_seq = e^{-1} -> the penalty pushes ρ up: not clipped
    # -> kl_clip_frac = 4/8 = 0.5. With ρ_seq = e^{+1} in both rows: row 1 clipped only -> 0.5 again,
    # and with ρ_seq(row 0) = e^{-1}, ρ_seq(row 1) = e^{+1}: both clipped -> 1.0.
    l, ref, mask, adv = _dg_inputs()
    spec = ObjectiveSpec(
        KLConfig(head="k1_in_reward", beta=0.1, clip_eps=0.2, level="sequence", ratio_level="sequence")
    )

    def old_for(r0: float, r1: float) -> torch.Tensor:
        per_tok = t64([[0.0, r0 / 4] + [r0 / 4] * 3, [r1 / 4] * 5])  # 4 response tokens per row
        return torch.where(mask, l - per_tok, NAN)

    assert objective_diagnostics(l, ref, mask, adv, spec, old_logp=old_for(-1, -1))["kl_clip_frac"] == 0.5
    assert objective_diagnostics(l, ref, mask, adv, spec, old_logp=old_for(1, 1))["kl_clip_frac"] == 0.5
    assert objective_diagnostics(l, ref, mask, adv, spec, old_logp=old_for(-1, 1))["kl_clip_frac"] == 1.0
    assert objective_diagnostics(l, ref, mask, adv, spec, old_logp=old_for(1, -1))["kl_clip_frac"] == 0.0
    # cross-check with the decoupled KL loss gradient: clipped rows get exactly zero KL gradient
    x = l.clone().requires_grad_(True)
    kl_tot = kl_loss_per_sequence("k1_in_reward", x, ref, mask, old_logp=old_for(-1, 1), clip_eps=0.2)
    assert torch.all(grad_of(kl_tot.sum(), x) == 0)
    # combined form, head none, or no KL clip: no KL clip fraction
    for s in (
        ObjectiveSpec(KLConfig(head="k1_in_reward", beta=0.1, form="combined")),
        ObjectiveSpec(KLConfig(head="none")),
        ObjectiveSpec(KLConfig(head="k1_in_reward", beta=0.1, clip_eps=None)),
    ):
        assert objective_diagnostics(l, ref, mask, adv, s, old_logp=old_for(-1, 1))["kl_clip_frac"] == 0.0


def test_diagnostics_builds_no_graph():
    l, ref, mask, adv = _dg_inputs()
    x = l.clone().requires_grad_(True)
    old = torch.where(mask, l - 0.1, NAN).requires_grad_(True)
    a = adv.clone().requires_grad_(True)
    spec = ObjectiveSpec(KLConfig(head="k3_as_loss", beta=0.1))
    d = objective_diagnostics(x, ref, mask, a, spec, old_logp=old)
    expected_keys = {
        "kl_k1",
        "kl_k2",
        "kl_k3",
        "logp_gap",
        "logp_gap_abs",
        "ratio_mean",
        "ratio_max",
        "ratio_min",
        "clip_frac",
        "dual_clip_frac",
        "kl_clip_frac",
    }
    assert set(d) == expected_keys
    assert all(type(v) is float and math.isfinite(v) for v in d.values())
    assert x.grad is None
    assert old.grad is None
    assert a.grad is None
    assert torch.is_grad_enabled()


# Regression (fixed): objective_diagnostics used to cast every input to float32 (`.float()`)
# and then summed each sequence's log-probs l and r separately before subtracting (kl_estimate(seq_l, seq_r)),
# so float64 inputs are silently downgraded and the sequence KL suffers catastrophic cancellation. Input
# below: B=8, T=1000 (3 left-padding tokens), l ~ U(-5, 0), r = l + N(0, 0.003²), o = l + N(0, 0.001²),
# seed 0. Float64 truth vs returned value:
#   kl_k1    0.06378352334  got 0.06378173828  (rel. error 2.8e-5)
#   kl_k2    0.00409632817  got 0.00410552323  (2.2e-3)
#   kl_k3    0.00393181771  got 0.00394073129  (2.3e-3)
#   logp_gap 6.3975449e-05  got 6.3976797e-05  (2.1e-5); ratio_max/min/mean off by ~1e-7 (float32 exp).
# Expected: float64 stays float64 (the `at_least_f32` rule of klgrad.kl.numerics), and the per-token gap u = l - r is
# formed before summing over tokens.
def test_diagnostics_keep_float64_precision():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 1000
    l = -5.0 * torch.rand(B, T, generator=g, dtype=F64)
    r = l + 0.003 * torch.randn(B, T, generator=g, dtype=F64)
    o = l + 0.001 * torch.randn(B, T, generator=g, dtype=F64)
    m = torch.ones(B, T, dtype=torch.bool)
    m[:, :3] = False  # a little left padding
    adv = torch.ones(B, T, dtype=F64)
    u = torch.where(m, l - r, 0.0)
    U = u.sum(-1)
    rho = torch.exp(torch.where(m, l - o, 0.0))[m]
    expected = {
        "kl_k1": U.mean().item(),
        "kl_k2": (0.5 * U * U).mean().item(),
        "kl_k3": (torch.exp(-U) - 1.0 + U).mean().item(),
        "logp_gap": (u.sum() / m.sum()).item(),
        "logp_gap_abs": (u.abs().sum() / m.sum()).item(),
        "ratio_mean": rho.mean().item(),
        "ratio_max": rho.max().item(),
        "ratio_min": rho.min().item(),
    }
    d = objective_diagnostics(l, r, m, adv, ObjectiveSpec(), old_logp=o)
    bad = {k: (d[k], v) for k, v in expected.items() if not math.isclose(d[k], v, rel_tol=1e-10, abs_tol=1e-12)}
    assert not bad, f"(got, float64 truth): {bad}"


def test_gspo_ratio_is_the_length_normalised_sequence_ratio_with_gspo_token_gradient():
    """Two responses of lengths 3 and 1 (left padding with garbage, even NaN, in the masked slots):
    s_i = exp((1/|y_i|) Σ_t (l_t - o_t)) on every token, gradient of Σ_t s_{i,t} w.r.t. l_t is s_i (GSPO-token);
    a response without tokens gets 1."""
    from klgrad.kl import gspo_ratio, importance_ratio

    nan = float("nan")
    l = torch.tensor([[-1.0, -0.5, -2.0, -0.25], [nan, nan, nan, -0.7], [nan, nan, nan, nan]], requires_grad=True)
    o = torch.tensor([[-1.2, -0.4, -1.0, -0.75], [nan, 5.0, nan, -0.4], [nan, nan, nan, nan]])
    m = torch.tensor([[False, True, True, True], [False, False, False, True], [False] * 4])
    s0 = math.exp(((-0.5 + 0.4) + (-2.0 + 1.0) + (-0.25 + 0.75)) / 3)  # = exp(-0.2)
    s1 = math.exp(-0.7 + 0.4)
    ratio = gspo_ratio(l, o, m)
    expected = torch.tensor([[s0] * 4, [s1] * 4, [1.0] * 4])
    torch.testing.assert_close(torch.where(m, ratio, 0.0), torch.where(m, expected, 0.0))
    torch.testing.assert_close(ratio[2], torch.ones(4))
    torch.where(m, ratio, 0.0).sum().backward()
    grad = torch.tensor([[0.0, s0, s0, s0], [0.0, 0.0, 0.0, s1], [0.0] * 4])
    torch.testing.assert_close(l.grad, grad)
    torch.testing.assert_close(importance_ratio(l, o, m, "gspo"), ratio)
    # the unnormalised sequence level is exp of the sum, not of the mean
    seq = importance_ratio(l, o, m, "sequence")
    torch.testing.assert_close(seq[0, 1:], torch.full((3,), s0**3))


def test_gspo_level_in_the_reward_head_is_gspo_loss():
    """ratio_level gspo + seq_mean_token_mean: loss (1/B) Σ_i max(-A_i s_i, -A_i clip(s_i, 1-ε_l, 1+ε_h)) and
    gradient -(1/B) Σ_i A_i s_i (1/|y_i|) Σ_t ∇l_t where unclipped (GSPO, Zheng et al. 2025)."""
    torch.manual_seed(0)
    l = (torch.randn(3, 5) * 0.01 - 1.0).requires_grad_(True)
    o = l.detach() + torch.randn(3, 5) * 0.01
    m = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    a = torch.tensor([1.0, -0.5, 2.0])
    spec = ObjectiveSpec(
        pg=AlgoConfig(ratio_level="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq_mean_token_mean")
    )
    adv = torch.where(m, a[:, None], 0.0)
    loss = policy_objective(l, l.detach(), m, adv, spec, old_logp=o).loss
    n = m.sum(-1)
    s = torch.exp(torch.where(m, l.detach() - o, 0.0).sum(-1) / n)  # (B,)
    per_seq = torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4))
    torch.testing.assert_close(loss, per_seq.mean())
    loss.backward()
    live = (-a * s >= -a * s.clamp(1 - 3e-4, 1 + 4e-4)).float()  # (B,) the unclipped branch is the max
    grad = torch.where(m, (-(a * s * live) / n / 3)[:, None], 0.0)
    torch.testing.assert_close(l.grad, grad)
    with pytest.raises(ValueError, match="ratio_level"):
        KLConfig(ratio_level="gspo")


def test_kl_aggregation_reduces_the_kl_term_alone():
    """``kl.aggregation`` (what a framework preset head sets) reduces the decoupled KL term; the reward head keeps
    ``algo.aggregation``. Same arithmetic as the KL term under that algo.aggregation: equal to the last bit."""
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 5, generator=gen, dtype=torch.float64)
    ref = -torch.rand(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 3, 1])[:, None]
    adv = torch.randn(4, 5, generator=gen, dtype=torch.float64)

    def terms(kl_agg, pg_agg):
        kl = KLConfig(head="k2_as_loss", level="token", beta=0.5, aggregation=kl_agg)
        return policy_objective(logp, ref, mask, adv, ObjectiveSpec(kl, AlgoConfig(aggregation=pg_agg)))

    mixed = terms("token_mean", "seq_mean_token_sum")
    assert mixed.kl_loss == terms(None, "token_mean").kl_loss
    assert mixed.policy_loss == terms(None, "seq_mean_token_sum").policy_loss
    assert mixed.kl_loss != terms(None, "seq_mean_token_sum").kl_loss
