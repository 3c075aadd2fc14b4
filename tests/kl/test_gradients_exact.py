"""Every documented gradient claim, checked by exact enumeration over all responses of tabular policies.

The expected gradient of a per-sample loss under samples from q is ∇_θ Σ_y q(y) ℓ(y; θ), computed with the
library's own ``kl_loss_per_sequence`` on a batch holding every response once (float64). Targets are
computed independently from closed-form divergences (``exact_objective``), never from the heads.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from klgrad.audit.tabular import (
    build_space,
    exact_gradient,
    exact_objective,
    expected_gradient,
    random_logits,
    sequence_logps,
    token_logps,
)
from klgrad.choices import LEVELS
from klgrad.kl import KL_HEADS, custom_kl_head, get_kl_head, kl_loss_per_sequence, level_coefficients
from klgrad.objective import combined_advantages, policy_gradient_loss

pytestmark = [pytest.mark.filterwarnings("ignore:k1_as_loss has zero expected gradient"), pytest.mark.numerics]

SPACES = [(3, 3, True), (2, 4, True), (3, 2, False), (4, 3, True)]
SEEDS = [0, 1, 2]


def problem(vocab: int, length: int, eos: bool, seed: int, ref_d: float = 0.7, beh_d: float = 0.4):
    sp = build_space(vocab, length, eos)
    g = torch.Generator().manual_seed(seed)
    theta = random_logits(sp, g)
    ref = theta + ref_d * random_logits(sp, g)
    beh = theta + beh_d * random_logits(sp, g)
    return sp, theta, ref, beh


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def expected(sp, head, theta, ref, sampler, **kw):
    ref_lp = token_logps(sp, ref)

    def loss(logp, sample_logp):
        if "old_logp" in kw:
            kw2 = {**kw, "old_logp": sample_logp}
        else:
            kw2 = kw
        return kl_loss_per_sequence(head, logp, ref_lp, sp.mask, **kw2)

    return expected_gradient(sp, loss, theta, sampler)[0]


# ---------------------------------------------------------------------------------------------------------
# the enumeration itself


@pytest.mark.parametrize(("vocab", "length", "eos"), SPACES)
def test_enumeration_is_a_distribution(vocab, length, eos):
    sp, theta, _, _ = problem(vocab, length, eos, 0)
    p = sequence_logps(sp, theta).exp()
    assert p.sum().item() == pytest.approx(1.0, abs=1e-12)
    n_expected = sum((vocab - 1) ** k for k in range(length)) + (vocab - 1) ** length if eos else vocab**length
    assert sp.num_sequences == n_expected
    # the exact reverse KL is a KL: non-negative, zero at the reference
    _, _, ref, _ = problem(vocab, length, eos, 1)
    assert exact_objective(sp, "rkl", theta, ref).item() > 0
    assert exact_objective(sp, "fkl", theta, ref).item() > 0
    assert abs(exact_objective(sp, "rkl", theta, theta + 0.3).item()) < 1e-12  # shifted logits = same policy


def test_exact_rkl_gradient_matches_finite_differences():
    sp, theta, ref, _ = problem(3, 3, True, 4)
    g = exact_gradient(sp, "rkl", theta, ref)
    e = torch.zeros_like(theta)
    for idx in [(0, 0), (1, 2), (4, 1)]:
        e.zero_()
        e[idx] = 1e-6
        fd = (exact_objective(sp, "rkl", theta + e, ref) - exact_objective(sp, "rkl", theta - e, ref)) / 2e-6
        assert g[idx].item() == pytest.approx(fd.item(), abs=1e-8)


# ---------------------------------------------------------------------------------------------------------
# on-policy claims (docs/math.md, “KL heads” and “Where a head acts: level”)


@pytest.mark.parametrize(("vocab", "length", "eos"), SPACES)
@pytest.mark.parametrize("seed", SEEDS)
def test_every_head_hits_its_documented_target_on_policy(vocab, length, eos, seed):
    sp, theta, ref, _ = problem(vocab, length, eos, seed)
    for name, head in KL_HEADS.items():
        for level in LEVELS:
            target = head.targets[level]
            if target is None:
                continue
            g = expected(sp, head, theta, ref, theta, level=level)
            t = exact_gradient(sp, target, theta, ref)
            scale = exact_gradient(sp, "rkl", theta, ref).norm()
            assert float((g - t).norm() / max(t.norm(), scale)) < 1e-10, (name, level, target)


@pytest.mark.parametrize("seed", SEEDS)
def test_k2_as_loss_equals_k1_in_reward_per_sample_at_sequence_level(seed):
    """Not only in expectation: the per-sample gradients are identical (docs/math.md, “Where a head acts: level”)."""
    sp, theta, ref, _ = problem(3, 3, True, seed)
    ref_lp = token_logps(sp, ref)
    th = theta.clone().requires_grad_(True)
    logp = token_logps(sp, th)
    for level in LEVELS:
        a = kl_loss_per_sequence("k1_in_reward", logp, ref_lp, sp.mask, level=level)
        b = kl_loss_per_sequence("k2_as_loss", logp, ref_lp, sp.mask, level=level)
        for i in range(sp.num_sequences):
            (ga,) = torch.autograd.grad(a[i], th, retain_graph=True)
            (gb,) = torch.autograd.grad(b[i], th, retain_graph=True)
            torch.testing.assert_close(ga, gb, rtol=0, atol=1e-13)


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_reward_exact_at_sequence_and_token_to_go_but_token_level_k2_is_biased(seed):
    sp, theta, ref, _ = problem(3, 4, True, seed)
    g_rkl = exact_gradient(sp, "rkl", theta, ref)
    for level in ("sequence", "token_to_go"):
        assert rel(expected(sp, "k1_in_reward", theta, ref, theta, level=level), g_rkl) < 1e-12
    bias = rel(expected(sp, "k2_as_loss", theta, ref, theta, level="token"), g_rkl)
    assert bias > 0.02, "token-level k2 should be visibly biased against the sequence reverse KL"


@pytest.mark.parametrize(("vocab", "length", "eos"), [(3, 3, True), (3, 4, True), (2, 3, False)])
@pytest.mark.parametrize("seed", SEEDS)
def test_token_to_go_equals_the_sequence_level_only_for_additive_coefficients(vocab, length, eos, seed):
    """token_to_go sums per-token coefficients Σ_t c(u_t); the sequence level uses c(Σ_t u_t). They agree when c is
    linear (k1_in_reward, k2_as_loss: c(u) = u) and not for k3 (c(u) = 1 − e^(−u)): measured 0.087–0.34 relative
    over these 9 problems, so docs saying "token_to_go equals the sequence level" must name the heads."""
    sp, theta, ref, _ = problem(vocab, length, eos, seed)
    for head in ("k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward"):
        ttg = expected(sp, head, theta, ref, theta, level="token_to_go")
        seq = expected(sp, head, theta, ref, theta, level="sequence")
        if head.startswith("k3"):
            assert rel(ttg, seq) > 0.01, head
        else:
            assert rel(ttg, seq) < 1e-12, head


def test_token_level_k2_is_exact_when_the_sequence_has_one_token():
    """With T = 1 there are no future terms, so token level = sequence level."""
    sp, theta, ref, _ = problem(5, 1, False, 3)
    g_rkl = exact_gradient(sp, "rkl", theta, ref)
    assert rel(expected(sp, "k2_as_loss", theta, ref, theta, level="token"), g_rkl) < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
def test_k3_as_loss_equals_k3_in_reward_and_is_the_forward_kl_gradient(seed):
    sp, theta, ref, _ = problem(3, 3, True, seed)
    g_fkl = exact_gradient(sp, "fkl", theta, ref)
    g_rkl = exact_gradient(sp, "rkl", theta, ref)
    g3 = expected(sp, "k3_as_loss", theta, ref, theta, level="sequence")
    g3r = expected(sp, "k3_in_reward", theta, ref, theta, level="sequence")
    assert rel(g3, g3r) < 1e-12
    assert rel(g3, g_fkl) < 1e-12
    assert rel(g3, g_rkl) > 0.05  # biased against the reverse KL


def test_k3_bias_is_first_order_in_the_distance_to_the_reference():
    """Taylor trap: 1 - δ = -log δ + O((δ-1)²), so the relative bias shrinks ~linearly with the distance."""
    errs = []
    for d in (0.4, 0.2, 0.1):
        sp, theta, ref, _ = problem(3, 3, True, 7, ref_d=d)
        errs.append(
            rel(
                expected(sp, "k3_as_loss", theta, ref, theta, level="sequence"),
                exact_gradient(sp, "rkl", theta, ref),
            )
        )
    assert errs[0] > errs[1] > errs[2] > 0
    for big, small in itertools.pairwise(errs):
        assert 1.5 < big / small < 2.6  # halving the distance roughly halves the bias


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_k1_as_loss_has_zero_expected_gradient(level):
    sp, theta, ref, _ = problem(3, 4, True, 5)
    g = expected(sp, "k1_as_loss", theta, ref, theta, level=level)
    assert float(g.norm()) < 1e-13
    # ... but it is not zero per sample: it only adds noise
    ref_lp = token_logps(sp, ref)
    th = theta.clone().requires_grad_(True)
    per = kl_loss_per_sequence("k1_as_loss", token_logps(sp, th), ref_lp, sp.mask, level=level)
    (g0,) = torch.autograd.grad(per[0], th)
    assert float(g0.norm()) > 0.1


def test_k1_as_loss_at_token_to_go_is_the_expected_length_gradient():
    sp, theta, ref, _ = problem(3, 4, True, 6)
    g = expected(sp, "k1_as_loss", theta, ref, theta, level="token_to_go")
    t = exact_gradient(sp, "expected_length", theta, ref)
    assert float(t.norm()) > 0.1
    assert rel(g, t) < 1e-12
    # with fixed-length responses it is zero again
    sp2, theta2, ref2, _ = problem(3, 3, False, 6)
    assert float(expected(sp2, "k1_as_loss", theta2, ref2, theta2, level="token_to_go").norm()) < 1e-13


def test_mse_head_is_the_gradient_of_half_squared_distance():
    sp, theta, ref, _ = problem(3, 3, True, 8)
    g = expected(sp, "mse_in_reward", theta, ref, theta, level="sequence")
    assert rel(g, exact_gradient(sp, "mse", theta, ref)) < 1e-12


def test_custom_head_from_k2_penalty_reproduces_k2():
    sp, theta, ref, beh = problem(3, 3, True, 9)
    head = custom_kl_head(lambda l, r: 0.5 * (l - r) ** 2, "my_k2")
    for level in LEVELS:
        assert (
            rel(
                expected(sp, head, theta, ref, theta, level=level),
                expected(sp, "k2_as_loss", theta, ref, theta, level=level),
            )
            < 1e-12
        )
        assert (
            rel(
                expected(sp, head, theta, ref, beh, level=level, old_logp=True),
                expected(sp, "k2_as_loss", theta, ref, beh, level=level, old_logp=True),
            )
            < 1e-12
        )


# ---------------------------------------------------------------------------------------------------------
# off-policy claims (docs/math.md, “Off-policy: importance sampling and the clip side”)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("head", ["k1_in_reward", "k2_as_loss", "k3_as_loss", "mse_in_reward"])
@pytest.mark.parametrize("level", LEVELS)
def test_sequence_is_is_unbiased_off_policy(seed, head, level):
    sp, theta, ref, beh = problem(3, 3, True, seed)
    on = expected(sp, head, theta, ref, theta, level=level)
    off = expected(sp, head, theta, ref, beh, level=level, old_logp=True, ratio_level="sequence")
    assert rel(off, on) < 1e-12


@pytest.mark.parametrize("head", ["k2_as_loss", "k3_as_loss"])
@pytest.mark.parametrize("level", ["sequence", "token_to_go"])
def test_as_loss_without_is_is_biased_off_policy(head, level):
    sp, theta, ref, beh = problem(3, 3, True, 1)
    on = expected(sp, head, theta, ref, theta, level=level)
    bug = expected(sp, head, theta, ref, beh, level=level, old_logp=True, is_correction=False)
    assert rel(bug, on) > 0.05


def test_token_level_is_is_biased_for_token_to_go_but_exact_for_a_single_token():
    sp, theta, ref, beh = problem(3, 3, True, 2)
    on = expected(sp, "k1_in_reward", theta, ref, theta, level="token_to_go")
    tok = expected(sp, "k1_in_reward", theta, ref, beh, level="token_to_go", old_logp=True, ratio_level="token")
    assert rel(tok, on) > 0.02
    sp1, theta1, ref1, beh1 = problem(5, 1, False, 2)
    on1 = expected(sp1, "k1_in_reward", theta1, ref1, theta1, level="token")
    tok1 = expected(sp1, "k1_in_reward", theta1, ref1, beh1, level="token", old_logp=True, ratio_level="token")
    assert rel(tok1, on1) < 1e-12


def test_clipping_is_exact_inside_the_trust_region_and_biased_outside():
    sp, theta, ref, _ = problem(3, 3, True, 3)
    on = expected(sp, "k2_as_loss", theta, ref, theta, level="sequence")
    near = theta + 1e-3 * random_logits(sp, torch.Generator().manual_seed(11))  # every ratio within 1 ± 0.2
    clipped_near = expected(sp, "k2_as_loss", theta, ref, near, level="sequence", old_logp=True, clip_eps=0.2)
    assert rel(clipped_near, on) < 1e-12
    far = theta + 1.0 * random_logits(sp, torch.Generator().manual_seed(12))
    clipped_far = expected(sp, "k2_as_loss", theta, ref, far, level="sequence", old_logp=True, clip_eps=0.2)
    assert rel(clipped_far, on) > 0.05


def test_clip_side_is_ppo_consistent():
    """A penalty c > 0 pushes log π down: keep pushing while ρ > 1+ε, stop once ρ < 1-ε.

    docs/math.md, “Off-policy: importance sampling and the clip side”.
    """
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-3.0, -3.0]], dtype=torch.float64)  # U = 3 > 0, so c = U > 0
    mask = torch.ones(1, 2, dtype=torch.bool)

    def grad_at(seq_log_ratio: float) -> torch.Tensor:
        old = logp.detach() - seq_log_ratio / 2
        loss = kl_loss_per_sequence("k2_as_loss", logp, ref, mask, old_logp=old, clip_eps=0.2)
        (g,) = torch.autograd.grad(loss.sum(), logp)
        return g

    import math

    for rho in (1.5, 1.0, 0.9):  # ρ above or inside the region: gradient ρ·c on every token, c = 3
        torch.testing.assert_close(grad_at(math.log(rho)), torch.full((1, 2), rho * 3.0, dtype=torch.float64))
    assert float(grad_at(math.log(0.7)).abs().max()) == 0.0  # already pushed down past 1 - ε: stop
    # the paper's min(ρc, clip(ρ)c) would do the opposite; make sure we are not doing that
    ref_neg = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # U = -3 < 0, c < 0: pushes log π up
    old = logp.detach() - math.log(1.5) / 2
    loss = kl_loss_per_sequence("k2_as_loss", logp, ref_neg, mask, old_logp=old, clip_eps=0.2)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert float(g.abs().max()) == 0.0  # ρ = 1.5 > 1 + ε already moved up: stop


def test_per_sample_variance_matches_a_per_sample_backward_loop():
    sp, theta, ref, beh = problem(3, 3, True, 4)
    ref_lp = token_logps(sp, ref)

    def loss(logp, sample_logp):
        return kl_loss_per_sequence("k3_as_loss", logp, ref_lp, sp.mask, level="token_to_go", old_logp=sample_logp)

    mean, var = expected_gradient(sp, loss, theta, beh, with_variance=True)
    th = theta.clone().requires_grad_(True)
    per = loss(token_logps(sp, th), token_logps(sp, beh))
    q = sequence_logps(sp, beh).exp()
    grads = torch.stack([torch.autograd.grad(per[i], th, retain_graph=True)[0] for i in range(sp.num_sequences)])
    ref_mean = (q[:, None, None] * grads).sum(0)
    ref_var = float((q * ((grads - ref_mean) ** 2).sum((1, 2))).sum())
    torch.testing.assert_close(mean, ref_mean, rtol=0, atol=1e-13)
    assert var == pytest.approx(ref_var, rel=1e-12)


# ---------------------------------------------------------------------------------------------------------
# the combined form's token_to_go level under group shaping: enumerate every group of G responses

GROUP_SHAPINGS = [("grpo", None), ("grpo", 0.1), ("dr_grpo", None), ("rloo", None), ("reinforce_pp_baseline", None)]
U64 = 2.0**-53  # float64 unit roundoff


def group_expected_gradient(sp, theta, ref, rewards, G, method, std_min, level, beta=0.5, std_full=False):
    """E over i.i.d. groups y_1..y_G ~ π of ∇_θ Σ_i Σ_t loss_it, loss = the on-policy PPO head with the combined
    advantages (detached, as the trainer computes them): the exact sum over all N^G groups.

    Returns (expected gradient (S, V), bound (S, V)-norm on its float64 rounding). ``std_full``: instead, the
    prefix term scaled by 1/clip(std) of the whole group, sample i's own total included (the biased form).
    """
    idx = torch.tensor(list(itertools.product(range(sp.num_sequences), repeat=G))).reshape(-1)  # (n·G,)
    th = theta.clone().requires_grad_(True)
    logp = token_logps(sp, th)[idx]  # (n·G, T)
    lp, rlp, mask, r = logp.detach(), token_logps(sp, ref)[idx], sp.mask[idx], rewards[idx]
    kw = dict(beta=beta, group_size=G, method=method, std_min=std_min)
    per_group = method == "reinforce_pp_baseline"  # batch statistics: one call per group (the batch is one group)
    n_rows = idx.numel()
    chunks = [slice(a, a + G) for a in range(0, n_rows, G)] if per_group else [slice(0, n_rows)]
    adv = torch.cat(
        [combined_advantages(r[s], "k1_in_reward", lp[s], rlp[s], mask[s], level=level, **kw) for s in chunks]
    )  # (n·G, T)
    if std_full:
        seq = torch.cat(
            [combined_advantages(r[s], "k1_in_reward", lp[s], rlp[s], mask[s], level="sequence", **kw) for s in chunks]
        )  # (n·G, T)
        coef = level_coefficients(get_kl_head("k1_in_reward"), lp, rlp, mask, "token_to_go")  # (n·G, T)
        totals = r - beta * coef[:, 0]  # (n·G,), every response has a first token at t = 0
        std = totals.view(-1, G).std(-1).clamp(min=std_min or 0.0).repeat_interleave(G)  # (n·G,)
        std = torch.where(std > 0, std, 1.0)  # a constant group: 1, as the biased form had it
        adv = torch.where(mask, seq + beta * (coef[:, :1] - coef) / std[:, None], 0.0)
    q = lp.sum(-1).exp().view(-1, G).prod(-1).repeat_interleave(G)  # (n·G,) probability of the row's group
    loss = policy_gradient_loss(logp, adv, mask)  # (n·G, T), gradient -A ∇l
    (g,) = torch.autograd.grad((q[:, None] * loss).sum(), th)
    # Each entry of g sums at most n·G·T terms q·A·∂l/∂θ with |∂l/∂θ| ≤ 1, so float64 summation adds at most
    # n·G·T·u·Σ q|A|; the advantages' own rounding (a few u relative) is of the same order: bound ×2.
    bound = 2 * n_rows * sp.length * U64 * float((q[:, None] * adv.abs()).sum())
    return g, bound


@pytest.mark.parametrize(("vocab", "length", "eos"), [(2, 2, False), (2, 2, True)])
@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize(("method", "std_min"), GROUP_SHAPINGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_combined_token_to_go_has_the_sequence_level_expected_gradient(vocab, length, eos, G, method, std_min, seed):
    """The prefix term s_{-i}·β·Σ_{t'<t} c has zero expected gradient because s_{-i} ignores sample i."""
    sp, theta, ref, _ = problem(vocab, length, eos, seed)
    rewards = torch.rand(sp.num_sequences, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g_seq, b_seq = group_expected_gradient(sp, theta, ref, rewards, G, method, std_min, "sequence")
    g_ttg, b_ttg = group_expected_gradient(sp, theta, ref, rewards, G, method, std_min, "token_to_go")
    # each side is within its rounding bound of its exact value, and the exact values are equal
    assert float((g_ttg - g_seq).norm()) <= (b_seq + b_ttg) * g_seq.numel() ** 0.5
    assert float(g_seq.norm()) > 1e3 * (b_seq + b_ttg) * g_seq.numel() ** 0.5  # the check is not vacuous
    if method == "grpo" and G == 4:
        # power: scaled by the group's own std (sample i's total included) the prefix term biases the gradient
        g_full, _ = group_expected_gradient(sp, theta, ref, rewards, G, method, std_min, "token_to_go", std_full=True)
        assert rel(g_full, g_seq) > 1e-3
