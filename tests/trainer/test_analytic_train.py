"""``klgrad train`` with the analytic KL head (kl.head analytic_kl) on the shipped tiny reference, on- and
off-policy, and the training forward's KL_t against the full log-softmax of both models."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from klgrad.logprobs import logprobs_and_next_kl, sequence_logprobs
from klgrad.models import load_model_and_tokenizer
from klgrad.trainer import EMBEDDED_DIR, read_jsonl, train
from tests.helpers.tiny_runs import small

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "over",
    [
        {"kl.level": "token_to_go"},  # on-policy with the default kl.clip_eps: a clip never acts there
        {"kl.level": "sequence", "algo.ppo_epochs": 2, "kl.clip_eps": None},  # off-policy: the 2nd epoch is stale
    ],
)
def test_analytic_head_trains(tmp_path, over):
    cfg = small(tmp_path, **{"kl.head": "analytic_kl", "kl.beta": 0.1, "train.steps": 2, **over})
    train(cfg, progress=False)
    steps = [r for r in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "loss/kl" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["loss/kl"])
        assert math.isfinite(r["grad_norm"])
    if "algo.ppo_epochs" not in over:  # one update per step: at step 1 the policy is the reference, Σ_t KL_t = 0
        # up to float32 softmax rounding (V ~ 10^2 terms of 2^-24 relative each, per position)
        assert abs(steps[0]["loss/kl"]) < 1e-4


def test_training_forward_next_token_kl_matches_full_log_softmax():
    torch.manual_seed(0)
    policy, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    ref, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(3, 20, (2, 9))
    attn = torch.ones_like(ids)
    attn[1, -2:] = 0  # padding after the response's end reads 0
    logp, _, kl = logprobs_and_next_kl(policy, ids, attn, 4, ref=ref, temperature=0.8)
    want_logp, _ = sequence_logprobs(policy, ids, attn, 4, 0.8)
    # the packed forward (sequence_logprobs) against the padded one: float32 logits of O(10) summed over a hidden size
    # of O(10^2) round to ~10^2 · 2^-24 ≈ 6e-6 relative each; log-probs of |l| ≲ 10 then agree to ~1e-5 · (1 + |l|)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    z = policy(input_ids=ids, attention_mask=attn).logits[:, 3:-1] / 0.8
    zr = ref(input_ids=ids, attention_mask=attn).logits[:, 3:-1] / 0.8
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    direct = torch.where(attn[:, 4:].bool(), (lp.exp() * (lp - lq)).sum(-1), 0.0)
    torch.testing.assert_close(kl, direct, rtol=0, atol=1e-5)
    assert float(kl.max()) > 1e-4  # the perturbed reference differs: the check is not of zeros


def test_per_decision_ratio_trains_off_policy(tmp_path):
    over = {"kl.head": "k2_as_loss", "kl.level": "token_to_go", "kl.ratio_level": "per_decision"}
    cfg = small(tmp_path, **{**over, "kl.beta": 0.1, "algo.ppo_epochs": 2, "train.steps": 2})
    train(cfg, progress=False)
    steps = [r for r in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "loss/kl" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss/kl"]) and math.isfinite(r["grad_norm"]) for r in steps)
