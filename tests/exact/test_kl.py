"""The prefix-tree KL against a brute-force sum over every response of two tiny random LMs.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaForCausalLM

from klgrad.exact.kl import clustered_mean_se, stepwise_kl, tree_kl
from tests.helpers.tiny_llama import BOS, EOS, PAD, V, tiny_llama64

pytestmark = pytest.mark.numerics

T = 3


def tiny(seed: int) -> LlamaForCausalLM:
    return tiny_llama64(seed, "eager")


def seq_logp(model, prompt: list[int], resp: list[int], temperature: float) -> float:
    ids = torch.tensor([prompt + resp])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[len(prompt) - 1 + j, tok] for j, tok in enumerate(resp)))


def brute_force_kl(policy, ref, prompt: list[int], temperature: float) -> tuple[float, float]:
    """Σ_y π(y) log π(y)/π_ref(y) over all responses: EOS-terminated, or T tokens long (any tokens)."""
    responses = []
    for k in range(T):  # a live prefix of k tokens (no EOS) followed by EOS
        responses += [[*p, EOS] for p in itertools.product([t for t in range(V) if t != EOS], repeat=k)]
    responses += [list(p) for p in itertools.product([t for t in range(V) if t != EOS], repeat=T)]
    total, mass = 0.0, 0.0
    for y in responses:
        lp, lr = seq_logp(policy, prompt, y, temperature), seq_logp(ref, prompt, y, temperature)
        total += torch.tensor(lp).exp().item() * (lp - lr)
        mass += torch.tensor(lp).exp().item()
    return total, mass


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_kl_equals_brute_force(temperature):
    policy, ref = tiny(0), tiny(1)
    prompts = [[BOS, 3, 4], [BOS, 4]]
    res = tree_kl(policy, ref, prompts, eos_id=EOS, pad_id=PAD, max_new_tokens=T, temperature=temperature, prune=0.0)
    for prompt, got in zip(prompts, res["per_prompt"], strict=True):
        want, mass = brute_force_kl(policy, ref, prompt, temperature)
        # The enumeration covers every response; HF eager attention runs its softmax in float32 even in a
        # float64 model, so the same prefix scores ~1e-9 differently inside sequences of different lengths.
        assert mass == pytest.approx(1.0, abs=1e-7)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert res["pruned_mass"] < 1e-12  # nothing pruned (round-off of a float difference)


def test_pruning_gives_a_lower_bound_and_reports_the_mass():
    policy, ref = tiny(2), tiny(3)
    exact = tree_kl(policy, ref, [[BOS, 3]], eos_id=EOS, pad_id=PAD, max_new_tokens=T, prune=0.0)
    pruned = tree_kl(policy, ref, [[BOS, 3]], eos_id=EOS, pad_id=PAD, max_new_tokens=T, prune=0.2)
    assert pruned["pruned_mass"] > 0
    assert pruned["kl"] <= exact["kl"] + 1e-12
    assert pruned["nodes"] < exact["nodes"]


def test_identical_models_have_zero_kl():
    m = tiny(4)
    res = tree_kl(m, m, [[BOS, 3, 4]], eos_id=EOS, pad_id=PAD, max_new_tokens=T, prune=0.0)
    assert abs(res["kl"]) < 1e-12


def all_responses() -> list[list[int]]:
    """Every response of at most T tokens: EOS-terminated, or T tokens without EOS."""
    live = [t for t in range(V) if t != EOS]
    out = [[*p, EOS] for k in range(T) for p in itertools.product(live, repeat=k)]
    return out + [list(p) for p in itertools.product(live, repeat=T)]


def response_batch(prompt: list[int], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, response mask): the prompt, then each response right-padded to T."""
    ids = torch.full((len(responses), len(prompt) + T), PAD)
    resp_mask = torch.zeros((len(responses), T), dtype=torch.bool)
    for i, y in enumerate(responses):
        ids[i, : len(prompt)] = torch.tensor(prompt)
        ids[i, len(prompt) : len(prompt) + len(y)] = torch.tensor(y)
        resp_mask[i, : len(y)] = True
    attn = torch.cat([torch.ones((len(responses), len(prompt)), dtype=torch.bool), resp_mask], dim=1)
    return ids, attn, resp_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stepwise_kl_is_unbiased_by_full_enumeration(temperature):
    """Σ_y π(y)·S(y) over every response is the sequence KL (the chain rule): S's expectation, with no sampling."""
    policy, ref = tiny(5), tiny(6)
    prompt = [BOS, 3, 4]
    responses = all_responses()
    ids, attn, resp_mask = response_batch(prompt, responses)
    s = stepwise_kl(policy, ref, ids, attn, len(prompt), resp_mask, temperature, rows_per_pass=7)
    weights = torch.tensor([seq_logp(policy, prompt, y, temperature) for y in responses], dtype=torch.float64).exp()
    want = tree_kl(policy, ref, [prompt], eos_id=EOS, pad_id=PAD, max_new_tokens=T, temperature=temperature, prune=0.0)
    # Same float32-softmax caveat as above (~1e-9 per prefix across layouts): rel 1e-6 holds it with room.
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-7)
    assert float((weights * s).sum()) == pytest.approx(want["kl"], rel=1e-6, abs=1e-9)
    assert bool((s >= 0).all())


def test_stepwise_kl_has_no_more_variance_than_k1():
    """Rao–Blackwell: S(y) = E[k1 | the prefixes], so Var_π(S) ≤ Var_π(k1), computed exactly over every response."""
    policy, ref = tiny(7), tiny(8)
    prompt = [BOS, 4]
    responses = all_responses()
    ids, attn, resp_mask = response_batch(prompt, responses)
    s = stepwise_kl(policy, ref, ids, attn, len(prompt), resp_mask)
    lp = torch.tensor([seq_logp(policy, prompt, y, 1.0) for y in responses], dtype=torch.float64)
    k1 = lp - torch.tensor([seq_logp(ref, prompt, y, 1.0) for y in responses], dtype=torch.float64)
    w = lp.exp()
    mean_s, mean_k1 = (w * s).sum(), (w * k1).sum()
    assert float(mean_s) == pytest.approx(float(mean_k1), rel=1e-6)
    assert float((w * (s - mean_s) ** 2).sum()) < float((w * (k1 - mean_k1) ** 2).sum())


def test_clustered_mean_se_by_hand():
    values = torch.tensor([1.0, 3.0, 10.0, 10.0, 10.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    mean, se = clustered_mean_se(values, groups)
    assert mean == pytest.approx((2.0 + 10.0 + 4.0) / 3)
    assert se == pytest.approx((2.0 / 2) ** 0.5 / 3)  # group 0: s² = 2 over 2 draws; group 1 has no spread
