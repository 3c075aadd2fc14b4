"""The exact objective J_β, its optimum J* and KL(π‖π*): tree enumeration against a brute-force sum over every
response of two tiny real LMs, the identity J* − J = β·KL(π‖π*) computed two ways, J* ≥ J, a hand-worked
tabular case, the pruning bounds, and the end-to-end path through a tokenizer and klgrad's reward functions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from klgrad.exact.kl import enumerate_responses, tree_kl
from klgrad.exact.objective import (
    exact_objective,
    objective_from_leaves,
    objective_of_tree,
    pruning_bounds,
    reward_range,
)
from tests.helpers.tiny_llama import BOS, EOS, INTER, PAD, V, tiny_llama64
from tests.helpers.tolerances import llama_depth, log_softmax_tol, network_tol, sum_tol

pytestmark = pytest.mark.numerics

T = 3
R_RANGE = (0.0, 1.25)


def tiny(seed: int) -> LlamaForCausalLM:
    """sdpa keeps attention in float64 (eager's softmax is float32)."""
    return tiny_llama64(seed, "sdpa")


def token_reward(y: list[int]) -> float:
    """A reward on token ids in [0, 1.25]: 1 if token 3 appears, + 0.25 if the response ended with EOS."""
    return float(3 in y) + 0.25 * float(bool(y) and y[-1] == EOS)


def all_responses() -> list[list[int]]:
    """Every response: a live prefix of k < T tokens then EOS, or T tokens without EOS."""
    live = [t for t in range(V) if t != EOS]
    out = [[*p, EOS] for k in range(T) for p in itertools.product(live, repeat=k)]
    return out + [list(p) for p in itertools.product(live, repeat=T)]


def seq_logp(model, prompt: list[int], resp: list[int]) -> tuple[float, float]:
    """log π(resp | prompt) from one unpadded forward, and the largest |logit| it saw."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + resp])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[len(prompt) - 1 + j, tok] for j, tok in enumerate(resp))), float(logits.abs().max())


def brute_force(policy, ref, prompt: list[int], beta: float) -> dict:
    """J, J*, KL(π‖π_ref), KL(π_ref‖π), KL(π‖π*) by their definitions, summed over every response with math.fsum."""
    ys = all_responses()
    lp, lr, scale = [], [], 0.0
    for y in ys:
        a, sa = seq_logp(policy, prompt, y)
        b, sb = seq_logp(ref, prompt, y)
        lp.append(a)
        lr.append(b)
        scale = max(scale, sa, sb)
    r = [token_reward(y) for y in ys]
    p = [math.exp(x) for x in lp]
    log_z = math.log(math.fsum(math.exp(b + ri / beta) for b, ri in zip(lr, r, strict=True)))
    kl = math.fsum(pi * (a - b) for pi, a, b in zip(p, lp, lr, strict=True))
    kl_forward = math.fsum(math.exp(b) * (b - a) for a, b in zip(lp, lr, strict=True))
    kl_opt = math.fsum(pi * (a - (b + ri / beta - log_z)) for pi, a, b, ri in zip(p, lp, lr, r, strict=True))
    reward = math.fsum(pi * ri for pi, ri in zip(p, r, strict=True))
    log_ratio = max(abs(a - b) for a, b in zip(lp, lr, strict=True))
    return {
        "mass": math.fsum(p),
        "J": reward - beta * kl,
        "J_star": beta * log_z,
        "kl": kl,
        "kl_forward": kl_forward,
        "kl_to_optimum": kl_opt,
        "reward": reward,
        "logit_scale": scale,
        "max_log_ratio": log_ratio,
        "n": len(ys),
    }


def tree_objective(policy, ref, prompts, beta: float, prune: float) -> list[dict]:
    tree = enumerate_responses(policy, ref, prompts, eos_id=EOS, pad_id=PAD, max_new_tokens=T, prune=prune)
    rewards = torch.tensor([token_reward(y) for y in tree.responses], dtype=torch.float64)
    return objective_of_tree(tree, rewards, beta, R_RANGE)


@pytest.mark.parametrize("beta", [0.5, 0.1])
def test_tree_objective_equals_brute_force(beta):
    policy, ref = tiny(0), tiny(1)
    prompts = [[BOS, 3, 4], [BOS, 4]]
    for prompt, got in zip(prompts, tree_objective(policy, ref, prompts, beta, prune=0.0), strict=True):
        want = brute_force(policy, ref, prompt, beta)
        # Both sides are float64 throughout; they differ only in rounding order (the tree runs left-padded
        # batches, the brute force one unpadded sequence each). Per token a log-prob is off by at most the
        # network's rounding bound plus log-softmax's; a response sums T of them (δ). Each compared quantity is
        # Σ_y π(y)·f(y), and moving every log π, log π_ref (and so log Z) by ≤ δ moves each term by
        # ≤ π(y)·δ·S, S = 2 + max|log π/π_ref| + max R/β (β ≤ 1): the sums by ≤ S·δ per side, plus float64
        # summation error over n terms of size ≤ S.
        per_token = network_tol(llama_depth(1), INTER, want["logit_scale"], torch.float64) + log_softmax_tol(
            V, 2 * want["logit_scale"], torch.float64
        )
        delta = T * per_token
        s = 2 + want["max_log_ratio"] + R_RANGE[1] / beta
        tol = 2 * s * delta + sum_tol(want["n"], s, torch.float64)
        assert want["mass"] == pytest.approx(1.0, abs=want["n"] * 1e-15)  # every response enumerated
        for key in ("J", "J_star", "kl", "kl_forward", "kl_to_optimum", "reward"):
            assert got[key] == pytest.approx(want[key], abs=tol), key
        assert got["J_star"] >= got["J"]
        assert got["reward_error"] == 0.0
        assert got["J_star_error"] == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_identity_two_ways_and_optimum_dominates(seed, beta):
    """J* − J from their definitions (tree) against β·KL(π‖π*) summed directly over every response by brute
    force: two independent computations of both sides of J* − J = β·KL(π‖π*)."""
    policy, ref = tiny(10 + seed), tiny(20 + seed)
    prompt = [BOS, 4, 3]
    (got,) = tree_objective(policy, ref, [prompt], beta, prune=0.0)
    want = brute_force(policy, ref, prompt, beta)
    # |J*|, |J| ≤ max|R| + β·(KL bound): float64 subtraction and sums of ≤ n terms of size ≤ s; the two sides
    # come from different forwards, so the log-prob rounding bound of the test above applies as well.
    per_token = network_tol(llama_depth(1), INTER, want["logit_scale"], torch.float64) + log_softmax_tol(
        V, 2 * want["logit_scale"], torch.float64
    )
    s = 2 + want["max_log_ratio"] + R_RANGE[1] / beta
    tol = 2 * s * T * per_token + 2 * sum_tol(want["n"], s, torch.float64)
    assert got["J_star"] - got["J"] == pytest.approx(beta * want["kl_to_optimum"], abs=beta * tol)
    # and within one computation: the direct sum KL(π‖π*) vs (J* − J)/β, rounding of n-term float64 sums
    assert got["J_star"] - got["J"] == pytest.approx(beta * got["kl_to_optimum"], abs=2 * sum_tol(want["n"], s))
    assert got["J_star"] >= got["J"]
    assert got["kl_to_optimum"] > 0  # π is a random model, not the optimum


def test_hand_worked_tabular_optimum():
    """β = 1, π_ref = (1/2, 1/2), R = (log 3, 0): Z = (3 + 1)/2 = 2, J* = log 2, π* = (3/4, 1/4), and
    J(π*) = (3/4)·log 3 − [(3/4)·log(3/2) + (1/4)·log(1/2)] = log 2 = J*."""
    ref = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    r = torch.tensor([math.log(3.0), 0.0], dtype=torch.float64)
    at_opt = objective_from_leaves(torch.tensor([0.75, 0.25], dtype=torch.float64).log(), ref, r, 1.0)
    # a handful of float64 operations on numbers of size ≤ 2: a few ulps of 2
    assert at_opt["J_star"] == pytest.approx(math.log(2.0), abs=1e-15)
    assert at_opt["J"] == pytest.approx(math.log(2.0), abs=1e-15)
    assert abs(at_opt["kl_to_optimum"]) < 1e-15
    # π = π_ref: J = E_ref[R] = log(3)/2, KL(π_ref‖π*) = (J* − J)/β = log 2 − log(3)/2
    at_ref = objective_from_leaves(ref, ref, r, 1.0)
    assert at_ref["J"] == pytest.approx(math.log(3.0) / 2, abs=1e-15)
    assert at_ref["kl_to_optimum"] == pytest.approx(math.log(2.0) - math.log(3.0) / 2, abs=1e-15)
    with pytest.raises(ValueError, match="beta"):
        objective_from_leaves(ref, ref, r, 0.0)


def test_pruning_bounds_hold():
    """With pruning, the exact values (prune = 0) lie within the reported bounds."""
    policy, ref = tiny(5), tiny(6)
    prompts = [[BOS, 3], [BOS, 4, 4]]
    beta = 0.4
    exact = tree_objective(policy, ref, prompts, beta, prune=0.0)
    pruned = tree_objective(policy, ref, prompts, beta, prune=0.05)
    # the bounds are of the pruning; the exact and pruned runs round alike up to a few ulps of O(1) sums
    eps = 1e-12
    for e, p in zip(exact, pruned, strict=True):
        assert p["reward_error"] > 0
        assert p["J_star_error"] > 0
        assert abs(p["reward"] - e["reward"]) <= p["reward_error"] + eps
        assert abs(p["J_star"] - e["J_star"]) <= p["J_star_error"] + eps
        assert p["kl"] <= e["kl"] + eps  # coarse-graining lowers the KL
        assert e["J"] <= p["J"] + p["reward_error"] + eps
        assert e["kl_to_optimum"] >= p["kl_to_optimum"] - (p["reward_error"] + p["J_star_error"]) / beta - eps
        assert p["J_star"] - p["J"] == pytest.approx(beta * p["kl_to_optimum"], abs=eps)  # holds when coarse


def test_pruning_bounds_formula():
    """m_ref = 0.1, Z = 1 (log Z = 0), β = 1, R ∈ [0, 1]: J* moves by ≤ log(1 + 0.1·(e − 1));
    reward by ≤ 0.2·1 with π's pruned mass 0.2."""
    b = pruning_bounds(0.2, 0.1, 0.0, 1.0, (0.0, 1.0))
    assert b["reward_error"] == pytest.approx(0.2, abs=1e-16)
    assert b["J_star_error"] == pytest.approx(math.log1p(0.1 * (math.e - 1)), abs=1e-15)
    assert pruning_bounds(0.0, 0.0, 0.0, 1.0, (0.0, 1.0)) == {"reward_error": 0.0, "J_star_error": 0.0}


def test_tree_kl_is_the_objectives_kl():
    policy, ref = tiny(7), tiny(8)
    prompts = [[BOS, 3], [BOS, 4, 3]]
    for prune in (0.0, 0.02):
        tk = tree_kl(policy, ref, prompts, eos_id=EOS, pad_id=PAD, max_new_tokens=T, prune=prune)
        obj = tree_objective(policy, ref, prompts, 0.5, prune)
        # the same float64 sums over the same outcomes in another grouping
        assert tk["per_prompt"] == pytest.approx([o["kl"] for o in obj], abs=1e-14)
        assert tk["per_prompt_forward"] == pytest.approx([o["kl_forward"] for o in obj], abs=1e-14)
        if prune > 0:  # coarse-graining lowers the forward KL too
            exact = tree_kl(policy, ref, prompts, eos_id=EOS, pad_id=PAD, max_new_tokens=T, prune=0.0)
            assert all(
                a <= b + 1e-12 for a, b in zip(tk["per_prompt_forward"], exact["per_prompt_forward"], strict=True)
            )


def test_reward_range_known_for_builtins_only():
    from klgrad.rewards import RewardSpec

    specs = [RewardSpec.load("accuracy", 1.0), RewardSpec.load("format", 0.1)]
    assert reward_range(specs, [0.3]) == ((0.0, 1.1), True)
    neg = [RewardSpec.load("accuracy", 1.0), RewardSpec.load("format", -0.5)]
    assert reward_range(neg, []) == ((-0.5, 1.0), True)
    custom = [RewardSpec("mine", lambda prompts, completions, **kw: [2.0] * len(completions))]
    assert reward_range(custom, [2.0, 3.0]) == ((0.0, 3.0), False)


@pytest.mark.slow
def test_exact_objective_end_to_end_with_tokenizer_and_rewards():
    """A char tokenizer, two tiny float32 models, the addition task's examples, the accuracy + format rewards:
    the identity and J* ≥ J hold for the reported means, and the KL is tree_kl's."""
    from klgrad.data.tasks import make_splits
    from klgrad.models import build_char_tokenizer, build_tiny_model
    from klgrad.rewards import RewardSpec
    from klgrad.rollout.encoding import encode_prompts

    tok = build_char_tokenizer()
    policy, ref = build_tiny_model(tok, 0).eval(), build_tiny_model(tok, 1).eval()
    _, heldout = make_splits("addition", 10, 3, 0, 2)
    specs = [RewardSpec.load("accuracy", 1.0), RewardSpec.load("format", 0.1)]
    beta = 0.5
    out = exact_objective(policy, ref, tok, heldout, specs, beta=beta, max_new_tokens=3, prune=1e-3)
    assert out["n_prompts"] == 3
    assert out["reward_failures"] == 0
    assert out["reward_range"] == [0.0, 1.1]
    assert out["J_star"] >= out["J"]
    # float64 sums over ≤ leaves + pruned outcomes, each term of size ≤ S (log-ratios of a random tiny model
    # stay below 30 nats over 3 tokens; R/β ≤ 2.2): 1e-10 is thousands of times the float64 rounding bound
    assert out["J_star"] - out["J"] == pytest.approx(beta * out["kl_to_optimum"], abs=1e-10)
    ids, mask = encode_prompts(tok, [e.prompt for e in heldout])
    rows = [ids[i][mask[i]].tolist() for i in range(3)]
    tk = tree_kl(policy, ref, rows, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_new_tokens=3, prune=1e-3)
    assert out["kl"] == pytest.approx(tk["kl"], abs=1e-12)  # the same enumeration and sums
    assert 0 <= out["pruned_mass"] <= out["pruned_mass_max"] < 1


def test_eval_objective_prompts_default_and_validation():
    from klgrad.config import ConfigError, load_config
    from klgrad.trainer import eval_objective_prompts

    assert eval_objective_prompts(load_config("configs/tiny_add.yaml", {})) == 20  # short answers
    assert eval_objective_prompts(load_config("configs/tiny_add.yaml", {"rollout.max_new_tokens": 11})) == 0
    assert eval_objective_prompts(load_config("configs/tiny_add.yaml", {"kl.beta": 0.0})) == 0
    assert eval_objective_prompts(load_config("configs/tiny_add.yaml", {"train.eval_objective_prompts": 0})) == 0
    with pytest.raises(ConfigError, match="eval_objective_prompts"):
        load_config("configs/tiny_add.yaml", {"train.eval_objective_prompts": -1})
    with pytest.raises(ConfigError, match="eval_objective_prompts"):
        load_config("configs/tiny_add.yaml", {"train.eval_objective_prompts": 5, "kl.beta": 0.0})


def test_score_leaves_scores_as_the_run_does():
    """``score_leaves`` passes the run's timeout and failure value: a reward slower than the timeout fails every
    leaf of its call with ``failure_value``; under a timeout it meets, the same leaves score their values."""
    import time

    from klgrad.data.example import Example
    from klgrad.exact.objective import score_leaves
    from klgrad.rewards import RewardSpec

    def slow(prompts, completions, **kw):
        time.sleep(0.3)
        return [float(len(c)) for c in completions]

    specs = [RewardSpec("slow", slow)]
    examples = [Example("p0", "0", "a"), Example("p1", "1", "b")]
    texts = ["a", "bb", "ccc"]
    totals, failures = score_leaves(specs, examples, [0, 1, 1], texts, 2, timeout_s=0.05, failure_value=-7.0)
    assert (totals, failures) == ([-7.0, -7.0, -7.0], 3)
    totals, failures = score_leaves(specs, examples, [0, 1, 1], texts, 2, timeout_s=30.0)
    assert (totals, failures) == ([1.0, 2.0, 3.0], 0)


def test_exact_objective_scores_with_the_given_timeout():
    """The exact objective's leaves are scored under ``reward_timeout_s``: a reward that outlives it fails every
    leaf (all counted), one that it covers fails none."""
    import time

    from klgrad.data.tasks import make_splits
    from klgrad.models import build_char_tokenizer, build_tiny_model
    from klgrad.rewards import RewardSpec

    def slow(prompts, completions, **kw):
        time.sleep(0.2)
        return [1.0] * len(completions)

    tok = build_char_tokenizer()
    policy, ref = build_tiny_model(tok, 0).eval(), build_tiny_model(tok, 1).eval()
    _, heldout = make_splits("addition", 10, 1, 0, 2)
    specs = [RewardSpec("slow", slow)]
    kw = {"beta": 0.5, "max_new_tokens": 1, "prune": 0.0, "reward_batch": 1 << 20}
    failed = exact_objective(policy, ref, tok, heldout, specs, reward_timeout_s=0.01, **kw)
    assert failed["reward_failures"] == failed["leaves"] > 0
    scored = exact_objective(policy, ref, tok, heldout, specs, reward_timeout_s=30.0, **kw)
    assert scored["reward_failures"] == 0
    assert scored["reward"] == pytest.approx(1.0, abs=1e-12)  # every leaf scored 1, exact mean of ones
