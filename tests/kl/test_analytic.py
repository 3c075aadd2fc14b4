"""The analytic KL head and the per-decision ratio: values, closed-form gradients, refusals (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from klgrad.kl import get_kl_head, kl_loss_per_sequence
from klgrad.kl.analytic import analytic_kl_per_sequence, next_token_kl
from klgrad.kl.offpolicy import per_decision_ratio


def test_next_token_kl_value_and_gradient_float64():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    zr = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    tau = 0.7
    lp, lq = torch.log_softmax(z / tau, -1), torch.log_softmax(zr / tau, -1)
    direct = (lp.exp() * (lp - lq)).sum(-1)  # (2, 5)
    kl = next_token_kl(z, zr, tau, chunk=2)  # chunks of 2 positions: 3 chunks, the last short
    assert torch.allclose(kl, direct, rtol=0, atol=1e-15)
    w = torch.randn(2, 5, generator=g, dtype=torch.float64)
    (g_closed,) = torch.autograd.grad((kl * w).sum(), z)
    (g_auto,) = torch.autograd.grad((direct * w).sum(), z)
    assert torch.allclose(g_closed, g_auto, rtol=0, atol=1e-14)  # O(1) entries, a few roundings each


def test_per_decision_weights_are_prefix_ratios():
    l = torch.tensor([[0.1, -0.3, 0.5, 9.0]], dtype=torch.float64, requires_grad=True)
    o = torch.tensor([[0.0, 0.2, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    w = per_decision_ratio(l, o, mask, "token_to_go").detach()  # (1, 4)
    d = [0.1, -0.5, 0.4]
    expected = [math.exp(d[0]), math.exp(d[0] + d[1]), math.exp(sum(d)), math.exp(sum(d))]
    assert torch.allclose(w[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
    seq = math.exp(sum(d))
    assert abs(float(w[0, 0]) - seq) > 0.1  # not the sequence ratio renamed
    # ∂w_t/∂l_s = w_t for s ≤ t (masked s never counts), 0 for s > t
    jac = torch.autograd.functional.jacobian(lambda x: per_decision_ratio(x, o, mask, "token_to_go")[0, :3], l)[:, 0]
    for t in range(3):
        for s in range(4):
            want = float(w[0, t]) if s <= t and s < 3 else 0.0
            assert abs(float(jac[t, s]) - want) < 1e-15
    tok = per_decision_ratio(l, o, mask, "token")  # token level: same values, gradient through l_t only
    assert torch.allclose(tok, w)
    jac_tok = torch.autograd.functional.jacobian(lambda x: per_decision_ratio(x, o, mask, "token")[0, :3], l)[:, 0]
    assert torch.allclose(jac_tok[:, :3], torch.diag(w[0, :3].detach()), rtol=1e-15, atol=0)
    capped = per_decision_ratio(l, o, mask, "token_to_go", cap=1.2)
    assert torch.allclose(capped, w.clamp(max=1.2), rtol=1e-15, atol=0)


def test_per_decision_on_policy_equals_token_to_go():
    g = torch.Generator().manual_seed(1)
    l = torch.randn(3, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    r = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 6, generator=g) < 0.8
    grads = []
    for ratio_level in ("sequence", "per_decision"):
        loss = kl_loss_per_sequence("k1_in_reward", l, r, mask, level="token_to_go", ratio_level=ratio_level)
        (gr,) = torch.autograd.grad(loss.sum(), l)
        grads.append(gr)
    # the same terms c_t' ∇l_t (t ≤ t') summed in another order: a few roundings of O(1) sums
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-13)


def test_analytic_refusals_and_on_policy_value():
    head = get_kl_head("analytic_kl")
    l, mask = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="next-token distributions"):
        kl_loss_per_sequence(head, l, l, mask)
    with pytest.raises(ValueError, match="no clipped form"):
        analytic_kl_per_sequence(l, l, mask, old_logp=l, clip_eps=0.2)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)
    for level in ("sequence", "token_to_go", "token"):  # on-policy value: Σ_t KL_t, the sequence KL's estimate
        v = analytic_kl_per_sequence(kl, l, mask, level=level)
        assert torch.allclose(v, kl.sum(-1), rtol=1e-15, atol=0)
