"""Mismatch weights' masked variants (verl's rollout rejection) and the sampler-vs-trainer gap statistics."""

from __future__ import annotations

import math

import pytest
import torch

from klgrad.rollout.mismatch import mismatch_stats, mismatch_weights, position_kl

F64 = torch.float64


def test_token_mask_keeps_in_range_ratios_and_zeroes_exactly_the_others():
    cap = 2.0
    d = torch.tensor([[0.0, math.log(1.9), math.log(2.1), -math.log(1.9), -math.log(2.1), 0.3]], dtype=F64)
    s = torch.zeros_like(d)
    m = torch.tensor([[True, True, True, True, True, False]])
    w = mismatch_weights(d, s, m, "token_mask", cap=cap)
    expected = torch.tensor([[1.0, 1.9, 0.0, 1 / 1.9, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)
    out = (d.exp() > cap) | (d.exp() < 1 / cap)  # the out-of-range response tokens, and only they, drop out
    assert torch.equal((w == 0) & m, out & m)


def test_sequence_mask_drops_whole_responses_whose_ratio_leaves_the_range():
    cap = 3.0
    trainer = torch.tensor([[0.5, 0.4, 9.0], [0.5, 0.7, 0.0], [-0.6, -0.6, 0.0]], dtype=F64)
    sampler = torch.zeros_like(trainer)
    m = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])
    w = mismatch_weights(trainer, sampler, m, "sequence_mask", cap=cap)
    # row sums of l̄ - s: 0.9 (e^0.9 = 2.46 in [1/3, 3]: kept), 1.2 (3.32 > 3: out), -1.2 (0.30 < 1/3: out)
    torch.testing.assert_close(w[0], torch.tensor([math.exp(0.9), math.exp(0.9), 0.0], dtype=F64))
    assert torch.equal(w[1:], torch.zeros(2, 3, dtype=F64))


@pytest.mark.parametrize("level", ["token_mask", "sequence_mask"])
def test_masked_levels_need_a_cap_above_one(level):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"cap must be > 1"):
        mismatch_weights(x, x, torch.ones(1, 2, dtype=torch.bool), level, cap=1.0)


@pytest.mark.parametrize("level", ["token", "sequence", "token_mask", "sequence_mask"])
def test_weights_are_the_trainer_over_sampler_ratio_not_a_ratio_with_itself(level):
    # what the loop passes: trainer log-probs l̄ and the engine's s. Weights from l̄ against itself would be 1
    trainer = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    sampler = trainer - torch.tensor([[0.2, -0.1, 0.05]], dtype=F64)
    m = torch.ones(1, 3, dtype=torch.bool)
    w = mismatch_weights(trainer, sampler, m, level, cap=2.0)
    d = trainer - sampler
    expected = d.exp() if level.startswith("token") else d.sum().exp().expand(1, 3)
    torch.testing.assert_close(w, expected)
    assert not torch.allclose(w, mismatch_weights(trainer, trainer, m, level, cap=2.0))


def test_stats_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 0.0, 0.0]], dtype=F64)
    sampler = torch.tensor([[-1.2, -1.9, -7.0], [-0.5, 0.0, 0.0]], dtype=F64)
    m = torch.tensor([[True, True, False], [True, False, False]])
    got = mismatch_stats(trainer, sampler, m)
    d = [0.2, -0.1, 0.0]  # l̄ - s on the three response tokens
    assert got["logp_diff_abs"] == pytest.approx(0.3 / 3)
    assert got["logp_diff_max"] == pytest.approx(0.2)
    assert got["kl_k1"] == pytest.approx(-(0.2 - 0.1) / 2)
    assert got["kl_k3"] == pytest.approx(sum(math.expm1(x) - x for x in d) / 2)


def test_stats_are_zero_when_sampler_equals_trainer():
    x = torch.randn(3, 4)
    assert mismatch_stats(x, x.clone(), torch.ones(3, 4, dtype=torch.bool)) == {
        "logp_diff_abs": 0.0,
        "logp_diff_max": 0.0,
        "kl_k1": 0.0,
        "kl_k3": 0.0,
    }


def test_position_kl_hand_computed_and_zero_for_equal_logits():
    zs = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]], dtype=F64)  # p_s = (1/4, 3/4), then (1/2, 1/2)
    zt = torch.zeros(1, 2, 2, dtype=F64)  # p_θ = (1/2, 1/2)
    m = torch.tensor([[True, True]])
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)  # second position: 0
    torch.testing.assert_close(position_kl(zs, zt, m), torch.tensor([expected], dtype=F64))
    assert float(position_kl(zs, zs, m)) == 0.0
    assert float(position_kl(zs, zt, torch.tensor([[False, True]]))) == 0.0
