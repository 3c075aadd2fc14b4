"""The sampled estimators of klgrad.exact.estimators: log Ẑ and its delta-method SE in closed form, the
rule-of-three limits, the SE's coverage on tabular problems whose KL(π‖π*) is known exactly, and the estimates on
the shipped tiny addition model against exact enumeration (within 4 stated SEs).

Tolerances: closed forms in float64 on O(1) numbers agree to 1e-12 (a few dozen roundings). A sampled estimate is
compared with its exact value within 4 of its own stated SEs (a normal deviate beyond 4 has probability 6e-5), plus
where the exact side prunes, the pruning's own stated error; every sampled test is seeded, so it is deterministic,
and fails when an estimator is biased by more than a few SEs or its SE is too small.
"""

from __future__ import annotations

import math

import pytest
import torch

from klgrad.exact.estimators import (
    CHAT_PROMPTS,
    chat_prompts,
    forgetting_kl,
    kl_to_optimum_from_samples,
    log_z_estimate,
    log_z_of_masses,
    unseen_mass_limit,
)
from klgrad.exact.optima import kl_divergence, reverse_kl_optimum

pytestmark = pytest.mark.numerics


def test_log_z_of_a_binary_reward_in_closed_form():
    """R ∈ {0, 1}, success rate p̂ = k/K: Ẑ = 1 + p̂·(e^{1/β} − 1), SE(log Ẑ) = s_W/(√K·Ẑ) with
    s_W² = p̂(1 − p̂)·K/(K − 1)·(e^{1/β} − 1)² (the unbiased sample variance of W = e^{R/β})."""
    k, n, beta = 77, 256, 0.4
    r = torch.tensor([1.0] * k + [0.0] * (n - k))
    got = log_z_estimate(r, beta, (0.0, 1.0))
    p, e = k / n, math.exp(1 / beta)
    z = 1 + p * (e - 1)
    assert got["log_z"] == pytest.approx(math.log(z), abs=1e-12)
    s_w = math.sqrt(p * (1 - p) * n / (n - 1)) * (e - 1)
    assert got["log_z_se"] == pytest.approx(s_w / (math.sqrt(n) * z), rel=1e-12)
    assert (got["never_rewarded"], got["always_rewarded"]) == (0.0, 0.0)
    assert got["log_z_lo"] == got["log_z_hi"] == got["log_z"]  # both ends of the range were sampled


def test_log_z_does_not_overflow_at_small_beta():
    """β = 0.001, R ∈ {0, 1}: e^{1/β} = e^{1000} overflows float64; log Ẑ = 1000 + log(p̂ + (1 − p̂)·e^{−1000})."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    got = log_z_estimate(r, 0.001, (0.0, 1.0))
    assert got["log_z"] == pytest.approx(1000 + math.log(0.25), abs=1e-9)
    assert math.isfinite(got["log_z_se"])


def test_rule_of_three_limits():
    """Never rewarded (all K at r_lo = 0): log Z ∈ [0, log(1 + q·(e^{1/β} − 1))], q = 1 − 0.05^{1/K} ≈ 3/K;
    always rewarded (all at r_hi = 1): log Z ∈ [log(e^{1/β} − q·(e^{1/β} − 1)), 1/β]."""
    k, beta = 256, 0.5
    q = unseen_mass_limit(k)
    assert q == pytest.approx(1 - 0.05 ** (1 / k), abs=1e-15)
    assert 2.9 / k < q < 3.0 / k  # the rule of three, −ln 0.05 = 2.996
    e = math.exp(1 / beta)
    never = log_z_estimate(torch.zeros(k), beta, (0.0, 1.0))
    assert (never["log_z"], never["log_z_se"], never["log_z_lo"]) == (0.0, 0.0, 0.0)
    assert never["log_z_hi"] == pytest.approx(math.log1p(q * (e - 1)), abs=1e-12)
    assert never["never_rewarded"] == 1.0
    always = log_z_estimate(torch.ones(k), beta, (0.0, 1.0))
    assert always["log_z"] == pytest.approx(1 / beta, abs=1e-12)
    assert always["log_z_lo"] == pytest.approx(math.log(e - q * (e - 1)), abs=1e-12)
    assert always["log_z_hi"] == always["log_z"]
    assert always["always_rewarded"] == 1.0
    with pytest.raises(ValueError, match="beta"):
        log_z_estimate(torch.zeros(3), 0.0, (0.0, 1.0))


def tabular_problem(seed: int, n_prompts: int, n_responses: int = 6):
    """Per prompt: π_ref, π (softmax of random logits) and a reward in {0, 0.5, 1} whose reference success mass is
    between 0.15 and 0.85 (so K = 32 reference samples rarely miss a value)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n_prompts:
        ref = torch.softmax(torch.randn(n_responses, generator=g, dtype=torch.float64), 0)
        pol = torch.softmax(torch.randn(n_responses, generator=g, dtype=torch.float64), 0)
        reward = torch.randint(0, 3, (n_responses,), generator=g).double() / 2
        if 0.15 < float(ref[reward > 0].sum()) < 0.85:
            out.append((ref, pol, reward))
    return out


def draw(problem, n: int, k: int, g: torch.Generator):
    """n policy samples (k1 = log π/π_ref as the per-sample KL estimate, and the reward) and k reference rewards
    per prompt, prompts contiguous."""
    k1, rew, pid, ref_rew, ref_pid = [], [], [], [], []
    for i, (ref, pol, reward) in enumerate(problem):
        y = torch.multinomial(pol, n, replacement=True, generator=g)
        k1.append(pol[y].log() - ref[y].log())
        rew.append(reward[y])
        pid.append(torch.full((n,), i))
        y_ref = torch.multinomial(ref, k, replacement=True, generator=g)
        ref_rew.append(reward[y_ref])
        ref_pid.append(torch.full((k,), i))
    return [torch.cat(x) for x in (k1, rew, pid, ref_rew, ref_pid)]


def test_the_stated_se_covers_the_exact_value_and_log_zs_term_is_needed():
    """300 independent estimates of KL(π‖π*) over 8 tabular prompts (256 policy samples, 32 reference samples
    per prompt: log Ẑ's error dominates). The exact value lies within ±1.96 stated SE in about 95% of them (binomial
    sd 1.3%: [0.91, 0.985] is beyond 3 sd on each side; log Ẑ's O(1/K) bias and the delta method lower it by about
    a point), and without log Ẑ's variance term the interval would cover far less: the test detects a missing term."""
    beta = 0.5
    problem = tabular_problem(0, 8)
    exact = sum(kl_divergence(pol, reverse_kl_optimum(ref, r, beta)) for ref, pol, r in problem) / len(problem)
    g = torch.Generator().manual_seed(1)
    hits, hits_without_log_z, reps = 0, 0, 300
    for _ in range(reps):
        est = kl_to_optimum_from_samples(*draw(problem, 256, 32, g), beta, (0.0, 1.0))
        err = abs(est["kl_to_optimum"] - exact)
        hits += err <= 1.96 * est["kl_to_optimum_se"]
        hits_without_log_z += err <= 1.96 * math.sqrt(est["kl_to_optimum_se"] ** 2 - est["log_z_se"] ** 2)
    assert 0.91 <= hits / reps <= 0.985
    assert hits_without_log_z / reps < 0.8


def test_identity_and_per_prompt_pieces():
    """J* − J = β·KL(π‖π*) holds for the estimates (the same three means), and each prompt's estimate is its mean
    of S − R/β plus its log Ẑ."""
    beta = 0.3
    problem = tabular_problem(2, 3)
    s, r, pid, rr, rpid = draw(problem, 16, 64, torch.Generator().manual_seed(3))
    est = kl_to_optimum_from_samples(s, r, pid, rr, rpid, beta, (0.0, 1.0))
    assert est["J_star"] - est["J"] == pytest.approx(beta * est["kl_to_optimum"], abs=1e-12)
    for i, p in enumerate(est["per_prompt"]):
        want = float((s[pid == i] - r[pid == i] / beta).mean()) + log_z_estimate(rr[rpid == i], beta, (0, 1))["log_z"]
        assert p["kl_to_optimum"] == pytest.approx(want, abs=1e-12)
    assert est["n_prompts"] == 3
    with pytest.raises(ValueError, match="prompt 2 has no"):
        kl_to_optimum_from_samples(s, r, pid, rr, torch.where(rpid == 2, 3, rpid), beta, (0.0, 1.0))


def test_a_prompt_never_rewarded_is_counted_and_its_range_holds_the_truth():
    """One prompt whose reference is rewarded with mass 0.002 (256 reference samples all miss it with this seed):
    it is counted, its log Ẑ is 0 (the bottom of the range), and the exact KL(π‖π*) lies in the reported
    unseen-reward range widened by 4 SE; the plain estimate there is below the truth (log Z underestimated)."""
    beta = 0.2
    ref = torch.tensor([0.002, 0.5, 0.498], dtype=torch.float64)
    pol = torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64)
    reward = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    exact = kl_divergence(pol, reverse_kl_optimum(ref, reward, beta))
    s, r, pid, rr, rpid = draw([(ref, pol, reward)], 4096, 256, torch.Generator().manual_seed(0))
    assert float(rr.max()) == 0.0  # the seed gives the case under test
    est = kl_to_optimum_from_samples(s, r, pid, rr, rpid, beta, (0.0, 1.0))
    assert est["prompts_never_rewarded"] == 1
    assert est["log_z"] == 0.0
    lo, hi = est["kl_to_optimum_unseen_95"]
    assert lo == pytest.approx(est["kl_to_optimum"], abs=1e-12)
    assert lo - 4 * est["kl_to_optimum_se"] <= exact <= hi + 4 * est["kl_to_optimum_se"]
    assert est["kl_to_optimum"] + 4 * est["kl_to_optimum_se"] < exact


def test_the_shipped_chat_prompts():
    prompts = chat_prompts()
    assert len(prompts) == 32
    assert len(set(prompts)) == 32
    assert all(5 < len(p) < 200 for p in prompts)
    assert CHAT_PROMPTS.is_file()


# --- the shipped tiny addition model (char tokenizer, 90 tokens), against exact enumeration -----------------------

MAX_NEW_TOKENS = 8
TEMPERATURE = 0.7
"""τ of the SmolLM2 configs; it also thins the tails, so the enumeration prunes little (at τ = 1 and prune 1e-6
the reference's pruned mass is 2e-3; at τ = 0.7 and 1e-7, 4e-5)."""
PRUNE = 1e-7
TOKEN_LOG_RATIO = 30.0
"""A per-token |log π − log π_ref| bound used only to size the pruning slack below (the KL inside a pruned subtree
is at most its mass times MAX_NEW_TOKENS times this); with pruned masses ≤ 1e-4 the slack stays under 0.025,
small against the 4-SE bands it is added to. Measured for scale: lowering prune from 1e-6 to 1e-7 and to 1e-8 raised
the tree's forward KL by 4 and 14 nats per unit of reference mass no longer pruned, against the 240 assumed here."""


def tiny_addition_pair():
    """(policy, reference, tokenizer, four held-out addition examples): the shipped discovery model (trained on
    a+b+1) as the policy, the shipped addition model as its reference."""
    from klgrad.data.tasks import make_splits
    from klgrad.models import load_model_and_tokenizer
    from klgrad.models.sources import EMBEDDED_DIR

    ref, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    policy, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition_discovery")
    _, heldout = make_splits("addition", 50, 4, 0, 2)
    return policy.eval(), ref.eval(), tok, heldout


def test_kl_to_optimum_on_the_tiny_addition_model_against_exact_enumeration():
    """The sampled KL(π‖π*) (64 policy and 256 reference samples per prompt) against exact_objective's, and its
    pieces KL(π‖π_ref) and log Z against theirs, each within 4 stated SEs plus the enumeration's pruning error."""
    from klgrad.exact.estimators import estimate_kl_to_optimum
    from klgrad.exact.objective import exact_objective
    from klgrad.rewards import RewardSpec

    policy, ref, tok, examples = tiny_addition_pair()
    specs = [RewardSpec.load("accuracy", 1.0), RewardSpec.load("format", 0.1)]
    beta = 0.5
    exact = exact_objective(
        policy,
        ref,
        tok,
        examples,
        specs,
        beta=beta,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        prune=PRUNE,
    )
    est = estimate_kl_to_optimum(
        policy,
        ref,
        tok,
        examples,
        specs,
        beta=beta,
        samples=64,
        ref_samples=256,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
    )
    assert exact["pruned_mass_max"] < 1e-4
    assert est["reward_range"] == [0.0, 1.1]
    assert est["reward_failures"] == 0
    inside = exact["pruned_mass"] * MAX_NEW_TOKENS * TOKEN_LOG_RATIO  # KL inside pruned subtrees
    slack = (exact["reward_error"] + exact["J_star_error"]) / beta + inside
    assert abs(est["kl_to_optimum"] - exact["kl_to_optimum"]) <= 4 * est["kl_to_optimum_se"] + slack
    assert abs(est["kl"] - exact["kl"]) <= 4 * est["kl_se"] + inside
    assert abs(est["log_z"] - exact["J_star"] / beta) <= 4 * est["log_z_se"] + exact["J_star_error"] / beta
    assert est["kl_to_optimum"] > 10 * est["kl_to_optimum_se"]  # a policy far from π*: the band is not trivial


def test_forgetting_kl_of_a_model_with_itself_is_zero():
    """Both models the same: every next-token KL along every sample is exactly 0, in both directions."""
    _, ref, tok, examples = tiny_addition_pair()
    out = forgetting_kl(ref, ref, tok, [e.prompt for e in examples], 4, MAX_NEW_TOKENS, TEMPERATURE)
    assert (out["reverse_kl"], out["forward_kl"]) == (0.0, 0.0)
    assert (out["reverse_kl_se"], out["forward_kl_se"]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="samples"):
        forgetting_kl(ref, ref, tok, ["1+1="], 1, MAX_NEW_TOKENS, 1.0)


def test_forgetting_kl_against_the_tree_in_both_directions():
    """Reverse and forward KL from 64 samples per prompt (policy samples, reference samples) against the exact
    tree sums of both directions, within 4 stated SEs plus the pruned subtrees' inside KL."""
    from klgrad.exact.kl import tree_kl
    from klgrad.rollout.encoding import encode_prompts

    policy, ref, tok, examples = tiny_addition_pair()
    prompts = [e.prompt for e in examples]
    out = forgetting_kl(policy, ref, tok, prompts, 64, MAX_NEW_TOKENS, TEMPERATURE)
    ids, mask = encode_prompts(tok, prompts)
    rows = [ids[i][mask[i]].tolist() for i in range(len(prompts))]
    tree = tree_kl(
        policy,
        ref,
        rows,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        prune=PRUNE,
    )
    assert max(tree["pruned_mass"], tree["pruned_mass_ref"]) < 1e-4
    assert (
        abs(out["reverse_kl"] - tree["kl"])
        <= 4 * out["reverse_kl_se"] + tree["pruned_mass"] * MAX_NEW_TOKENS * TOKEN_LOG_RATIO
    )
    fwd_slack = tree["pruned_mass_ref"] * MAX_NEW_TOKENS * TOKEN_LOG_RATIO
    assert abs(out["forward_kl"] - tree["forward_kl"]) <= 4 * out["forward_kl_se"] + fwd_slack
    assert out["forward_kl"] > 10 * out["forward_kl_se"]
    assert 0.0 <= out["truncated_policy"] <= 1.0
    assert 1.0 <= out["length_reference"] <= MAX_NEW_TOKENS


def test_the_reference_draw_is_made_once_for_one_reference_and_again_for_another(monkeypatch):
    """A grid's runs share a reference: the second estimate against the same reference reuses the first one's
    reference responses (the same log Z, bit for bit, and no second draw); a reference whose weights differ in one
    parameter by one float32 ulp draws afresh."""
    from klgrad.exact import estimators
    from klgrad.rewards import RewardSpec

    policy, ref, tok, examples = tiny_addition_pair()
    specs = [RewardSpec.load("accuracy", 1.0)]
    draws = []
    real = estimators._reference_texts
    monkeypatch.setattr(estimators, "_reference_texts", lambda *a, **k: draws.append(1) or real(*a, **k))
    monkeypatch.setattr(estimators, "_REF_TEXTS", {})
    kw = dict(beta=0.5, samples=2, ref_samples=8, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
    first = estimators.estimate_kl_to_optimum(policy, ref, tok, examples[:2], specs, **kw)
    second = estimators.estimate_kl_to_optimum(policy, ref, tok, examples[:2], specs, **kw)
    assert len(draws) == 1
    assert first["log_z"] == second["log_z"]
    with torch.no_grad():
        p = next(ref.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf")))
    estimators.estimate_kl_to_optimum(policy, ref, tok, examples[:2], specs, **kw)
    assert len(draws) == 2


def test_forgetting_reuses_the_reference_draw_and_gives_the_same_numbers(monkeypatch):
    """A grid's runs share a reference: :func:`forgetting_kl` against the same reference twice draws the reference's
    responses once, and the second forward KL equals what a fresh draw gives, bit for bit (the same seed draws the
    same responses; only the teacher-forced scoring is repeated); a reference one float32 ulp away draws afresh."""
    from klgrad.exact import estimators

    policy, ref, tok, examples = tiny_addition_pair()
    prompts = [e.prompt for e in examples[:3]]
    calls = []
    real = estimators.sample_stepwise

    def counting(sampler_model, *a, draws=None, **k):
        calls.append((sampler_model is ref, draws is not None))
        return real(sampler_model, *a, draws=draws, **k)

    monkeypatch.setattr(estimators, "sample_stepwise", counting)
    monkeypatch.setattr(estimators, "_REF_DRAWS", {})
    fresh = forgetting_kl(policy, ref, tok, prompts, 4, MAX_NEW_TOKENS, TEMPERATURE)
    reused = forgetting_kl(policy, ref, tok, prompts, 4, MAX_NEW_TOKENS, TEMPERATURE)
    assert calls == [(False, False), (True, False), (False, False), (True, True)]
    assert reused == fresh
    with torch.no_grad():
        p = next(ref.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf")))
    forgetting_kl(policy, ref, tok, prompts, 4, MAX_NEW_TOKENS, TEMPERATURE)
    assert calls[-1] == (True, False)


@pytest.mark.parametrize("beta", [0.001, 0.1, 0.5, 3.0])
def test_log_z_of_masses_is_log_z_estimate_on_samples_with_those_shares(beta):
    """K = 16 samples at rewards 0 (x 5), 0.5 (x 3) and 1 (x 8): the reward-class form gives the sample form's log Ẑ,
    and its variance is the sample variance of W with divisor K instead of K − 1, over K Ẑ² (the delta method)."""
    rewards = torch.tensor([0.0] * 5 + [0.5] * 3 + [1.0] * 8)
    k = rewards.numel()
    masses = [(0.0, 5 / 16), (0.5, 3 / 16), (1.0, 8 / 16)]
    log_z, var = log_z_of_masses(masses, beta, k)
    want = log_z_estimate(rewards, beta, (0.0, 1.0))
    # both are a log-sum-exp of three terms in float64: a few ulps of log Z (|log Z| ≤ 1/β = 1000 here)
    assert log_z == pytest.approx(want["log_z"], rel=1e-13, abs=1e-13)
    assert var == pytest.approx(want["log_z_se"] ** 2 * (k - 1) / k, rel=1e-9)  # e^{±1/β} ratios: 1e-9 is ample
    if beta >= 0.1:  # the naive sum does not overflow there: the formula itself
        assert log_z == pytest.approx(math.log(sum(m * math.exp(r / beta) for r, m in masses)), rel=1e-12)
