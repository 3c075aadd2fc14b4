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

from klgrad.experiments.exact_kl import tree_kl
from tiny_llama import BOS, EOS, PAD, V, tiny_llama64

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
