"""klgrad.trainer.evaluation on the shipped tiny reference: greedy decoding against transformers ``generate``,
the KL of a policy to itself, the exact objective's identities, and which evaluations compute it."""

from __future__ import annotations

import pytest
import torch

from klgrad.config import load_config
from klgrad.data.example import examples_to_columns
from klgrad.models import load_model_and_tokenizer
from klgrad.rewards import compute_rewards
from klgrad.rollout.encoding import encode_prompts
from klgrad.rollout.samplers import make_sampler
from klgrad.trainer import EMBEDDED_DIR, eval_objective_prompts, evaluate, load_data, reward_specs

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def setting():
    cfg = load_config("configs/tiny_add.yaml", {"data.n_eval": 12, "train.eval_objective_prompts": 4})
    policy, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    ref, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    policy.eval()
    ref.eval()
    return cfg, policy, ref, tok, load_data(cfg)[1]


def test_greedy_accuracy_is_that_of_transformers_generate(setting):
    cfg, policy, ref, tok, heldout = setting
    sampler = make_sampler("klgrad", tok.eos_token_id, tok.pad_token_id)
    out = evaluate(policy, ref, tok, heldout, cfg, reward_specs(cfg), sampler, seed=0)
    ids, mask = encode_prompts(tok, [e.prompt for e in heldout])
    with torch.no_grad():
        generated = policy.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            max_new_tokens=cfg.rollout.max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(generated[:, ids.shape[1] :], skip_special_tokens=True)
    scored = compute_rewards(reward_specs(cfg), [e.prompt for e in heldout], texts, examples_to_columns(heldout))
    accuracy = scored.per_function["accuracy"]
    assert out["eval/greedy_accuracy"] == sum(accuracy) / len(accuracy)
    assert 0 < out["eval/greedy_accuracy"] < 1  # a check that could fail either way on this reference
    assert out["eval/greedy_reward"] == pytest.approx(sum(scored.total) / len(scored.total), abs=1e-12)


def test_a_policy_equal_to_its_reference_has_zero_kl_and_the_objective_identities_hold(setting):
    """π = π_ref: the sampled sequence log-ratios are differences of two float32 forwards of one model (the
    sampler's cached decode and the full forward), each token log-prob within ~1e-5 of the other for |log p| ≤
    20 (float32, 4 layers), ≤ 8 tokens: |k1| ≤ 8e-5. The exact KL enumerates the same model twice: 0 up to the
    same rounding. KL(π‖π*) = (J* − J_β)/β and J* ≥ J_β by construction of π*."""
    cfg, policy, ref, tok, heldout = setting
    sampler = make_sampler("klgrad", tok.eos_token_id, tok.pad_token_id)
    out = evaluate(policy, ref, tok, heldout, cfg, reward_specs(cfg), sampler, seed=3)
    assert abs(out["eval/kl_k1"]) <= 8e-5
    assert 0 <= out["eval/kl_k3"] <= 8e-5
    assert abs(out["eval/exact_kl"]) <= 8e-5
    assert out["eval/J_star"] >= out["eval/J"]
    beta = cfg.kl.beta
    assert out["eval/kl_to_optimum"] == pytest.approx((out["eval/J_star"] - out["eval/J"]) / beta, rel=1e-6)
    assert out["eval/kl_to_optimum"] > 1e-3  # the reference is not the optimum of J_β on this task


def test_another_reference_gives_a_positive_kl(setting):
    """A reference whose weights were perturbed: sampled k1 and k3 and the exact KL are clearly positive, and
    k1 (unbiased) is within a few standard errors of the exact KL on the same prompts."""
    cfg, policy, _, tok, heldout = setting
    other, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    other.eval()
    sampler = make_sampler("klgrad", tok.eos_token_id, tok.pad_token_id)
    out = evaluate(policy, other, tok, heldout, cfg, reward_specs(cfg), sampler, seed=3)
    assert out["eval/exact_kl"] > 1e-2
    assert out["eval/kl_k1"] > 0
    assert out["eval/kl_k3"] > 0


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({}, 20),  # short answers, β > 0, full distribution: on by default
        ({"kl.beta": 0.0}, 0),  # no objective to judge
        ({"rollout.top_p": 0.9, "kl.head": "none"}, 0),  # truncated sampling: the tree has no notion of it
        ({"rollout.max_new_tokens": 32}, 0),  # long answers: the response tree is too large
        ({"train.eval_objective_prompts": 7, "rollout.max_new_tokens": 32}, 7),  # explicit setting wins
    ],
)
def test_which_evaluations_compute_the_exact_objective(over, expected):
    assert eval_objective_prompts(load_config("configs/tiny_add.yaml", over)) == expected
