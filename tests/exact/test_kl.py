"""The prefix-tree KL against a brute-force sum over every response of two tiny random LMs.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import itertools
import math

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
    for prompt, got in zip(prompts, res["per_prompt_forward"], strict=True):  # KL(π_ref‖π): the roles swapped
        want, _ = brute_force_kl(ref, policy, prompt, temperature)
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
    assert abs(res["forward_kl"]) < 1e-12


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


def test_stepwise_kl_variance_against_k1_on_a_tiny_model():
    """Var_π(S) against Var_π(k1) for one pair of random tiny models, computed exactly over every response.

    A measurement on this pair, not a theorem: S is a sum of conditional means of k1's terms, each on its own
    prefix, and can have more variance than k1 (next test). Here it has less."""
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


class TableLM(torch.nn.Module):
    """A language model given by a table: next-token logits as a function of the response prefix.

    Prompts are one token; position 0 predicts the first response token from the prefix (), position j the
    (j+1)-th from the first j response tokens. Enough of the Hugging Face interface for :func:`stepwise_kl`."""

    def __init__(self, table: dict[tuple[int, ...], list[float]]):
        super().__init__()
        self.table = table
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # stepwise_kl reads the device off a parameter

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        rows = [
            [self.table.get(tuple(row[1 : 1 + j]), [0.0] * 3) for j in range(len(row))] for row in input_ids.tolist()
        ]
        logits = torch.tensor(rows, dtype=torch.float64)[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})()


def test_stepwise_kl_can_have_more_variance_than_k1():
    """π_ref uniform on {aa, ab, ba, bb}, π uniform on {aa, ab, ba}, tokens a = 1, b = 2 (0 never drawn).

    k1 = log((1/3)/(1/4)) = log 4/3 on every response: Var(k1) = 0. S(aa) = S(ab) = KL at step 1,
    (2/3)·log 4/3 + (1/3)·log 2/3 = 0.0566, and S(ba) = that + KL(δ_a ‖ uniform) = + log 2 = 0.7498; both
    means are log 4/3 = 0.2877 and Var(S) = (1/3)(2/3)·log² 2 = 0.1068, computed here by enumeration through
    stepwise_kl. A zero logit of −1e4 is a probability of exactly 0 in float64 (e^−1e4 underflows)."""
    never = -1e4
    log = math.log
    policy = TableLM({(): [never, log(2 / 3), log(1 / 3)], (1,): [never, 0.0, 0.0], (2,): [never, 0.0, never]})
    ref = TableLM({(): [never, 0.0, 0.0], (1,): [never, 0.0, 0.0], (2,): [never, 0.0, 0.0]})
    responses = [[1, 1], [1, 2], [2, 1]]  # π's support; bb has π-probability 0 and weight 0 in every moment
    ids = torch.tensor([[0, *y] for y in responses])
    attn = torch.ones_like(ids, dtype=torch.bool)
    resp_mask = torch.ones((3, 2), dtype=torch.bool)
    s = stepwise_kl(policy, ref, ids, attn, 1, resp_mask)
    k1 = torch.full((3,), log(1 / 3) - log(1 / 4), dtype=torch.float64)
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    step1 = (2 / 3) * log(4 / 3) + (1 / 3) * log(2 / 3)
    # float64 arithmetic on O(1) numbers: agreement to 1e-12 (module docstring)
    assert s.tolist() == pytest.approx([step1, step1, step1 + log(2)], abs=1e-12)
    mean_s, mean_k1 = float((w * s).sum()), float((w * k1).sum())
    assert mean_s == pytest.approx(log(4 / 3), abs=1e-12)
    assert mean_k1 == pytest.approx(log(4 / 3), abs=1e-12)
    var_s, var_k1 = float((w * (s - mean_s) ** 2).sum()), float((w * (k1 - mean_k1) ** 2).sum())
    assert var_k1 == 0.0
    assert var_s == pytest.approx((2 / 9) * log(2) ** 2, abs=1e-12)  # 0.1068
    assert var_s > var_k1


def test_clustered_mean_se_by_hand():
    values = torch.tensor([1.0, 3.0, 10.0, 10.0, 10.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    mean, se = clustered_mean_se(values, groups)
    assert mean == pytest.approx((2.0 + 10.0 + 4.0) / 3)
    assert se == pytest.approx((2.0 / 2) ** 0.5 / 3)  # group 0: s² = 2 over 2 draws; group 1 has no spread
