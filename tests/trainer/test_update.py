"""klgrad.trainer.update: the optimizer steps on one rollout, checked against autograd of the loss written out
on the whole batch, on a float64 1-layer Llama (tests/helpers/tiny_llama.py).

With SGD at learning rate 1 and no gradient clipping, one optimizer step moves every weight by exactly minus its
gradient, so the weights after :func:`update` expose the gradient it accumulated. Splitting a mini-batch into
micro-batches must not change it: the normalisers (sequences and tokens of the global mini-batch) are counted
before the split.

Tolerances: float64 throughout (sdpa attention keeps softmax in float64). Two evaluations of the same gradient
that differ only in how rows are grouped differ by the rounding of the per-row sums and the accumulation over
micro-batches: network_tol(2·depth, width 32, max |g|, float64) ≈ 1e-13·max |g|, far below any error a wrong
normaliser (a factor m/N) or a dropped micro-batch would make.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from klgrad.config import load_config
from klgrad.objective import ObjectiveSpec, combined_advantages, decoupled_advantages, policy_objective
from klgrad.trainer import Batch, UpdateStats, make_logprob_fn, mini_batch_rows, update
from klgrad.trainer.faults import Hooks
from tests.helpers.tiny_llama import tiny_llama64
from tests.helpers.tolerances import llama_depth, network_tol, unit_roundoff
from tests.helpers.update_batch import F64, G, L, N, P, make_batch


def config(**over):
    base = {
        "rollout.prompts_per_step": P,
        "rollout.group_size": G,
        "kl.head": "k3_as_loss",
        "kl.level": "token",
        "kl.beta": 0.3,
        "algo.micro_batch_size": N,
        "optim.grad_clip": None,
    }
    return load_config(None, {**base, **over})


def step_with_sgd(cfg, batch: Batch) -> tuple[dict[str, torch.Tensor], UpdateStats]:
    """Weights after :func:`update` with SGD(lr=1) from the policy of seed 10, and the update's statistics."""
    policy = tiny_llama64(seed=10, attn="sdpa").train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    stats = update(policy, optimizer, batch, cfg, make_logprob_fn(1.0, fast_forward=False))
    return {k: v.detach().clone() for k, v in policy.named_parameters()}, stats


def tol(reference: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    scale = max(float((reference[k] - start[k]).abs().max()) for k in reference)
    return network_tol(2 * llama_depth(1), 32, max(scale, 1.0), F64)


def test_one_update_moves_the_weights_by_the_gradient_of_the_whole_batch_loss():
    """Independent path: the loss of the whole batch, with its own advantages and normalisers, differentiated
    by autograd; update() with micro-batches of 1, 4 and 6 rows must land on start − gradient."""
    cfg, batch = config(), make_batch()
    policy = tiny_llama64(seed=10, attn="sdpa")
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    logp, entropy = make_logprob_fn(1.0, fast_forward=False)(policy, batch.input_ids, batch.attention_mask, L, True)
    adv = decoupled_advantages(batch.rewards, batch.mask, G, "grpo")  # (N, T)
    spec = ObjectiveSpec.from_config(cfg)
    loss = policy_objective(logp, batch.ref_logp, batch.mask, adv, spec, entropy=entropy).loss
    grads = torch.autograd.grad(loss, list(policy.parameters()))
    expected = {k: start[k] - g for (k, _), g in zip(policy.named_parameters(), grads, strict=True)}
    bound = tol(expected, start)
    for size in (1, 4, N):
        got, stats = step_with_sgd(config(**{"algo.micro_batch_size": size}), batch)
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], rtol=0, atol=bound, msg=f"micro-batch {size}: {k}")
        assert stats.skipped_updates == 0
        assert stats.kl_loss == pytest.approx(
            float(policy_objective(logp, batch.ref_logp, batch.mask, adv, spec).kl_loss), rel=1e-12
        )


@pytest.mark.parametrize(
    "over",
    [
        {"algo.ppo_epochs": 2, "algo.mini_batches": 3},
        {"algo.ppo_epochs": 2, "kl.form": "combined", "kl.head": "k1_in_reward", "kl.level": "token_to_go"},
        {"algo.mini_batches": 3, "algo.aggregation": "token_mean", "kl.level": "sequence", "algo.entropy_coef": 0.1},
    ],
)
def test_micro_batch_size_never_changes_the_update(over):
    """Several optimizer steps per rollout (off-policy: behaviour log-probs from another model), the combined
    form (advantages recomputed from the current policy each epoch) and token-mean aggregation: micro-batches
    of 1 row give the weights and statistics of micro-batches of a whole mini-batch."""
    batch = make_batch(seed=1, off_policy=True)
    start = {k: v.detach().clone() for k, v in tiny_llama64(seed=10, attn="sdpa").named_parameters()}
    whole, stats_whole = step_with_sgd(config(**over), batch)
    single, stats_single = step_with_sgd(config(**over, **{"algo.micro_batch_size": 1}), batch)
    bound = tol(whole, start)
    for k in whole:
        torch.testing.assert_close(single[k], whole[k], rtol=0, atol=bound, msg=k)
    # The statistics are of the whole mini-batch however it is split. objective_diagnostics returns each micro-batch's
    # token fractions and ratio means as float32 divisions (one rounding, u32 = 6e-8 relative each), summed over
    # ≤ N micro-batches with token shares: within 2·N·u32 relative. A per-micro-batch fraction weighted by its
    # sequences instead of its tokens was off by 4% here.
    rel = 2 * N * unit_roundoff(torch.float32)
    for field in dataclasses.fields(UpdateStats):
        a, b = getattr(stats_whole, field.name), getattr(stats_single, field.name)
        assert b == pytest.approx(a, rel=rel, abs=1e-12), field.name


def test_combined_form_uses_the_current_policy_for_the_kl_coefficient():
    """One epoch, combined form: the update's gradient is that of the reward head with A = shape(R − β·C), C from
    the policy's own detached log-probs, and no separate KL loss (``kl_loss`` is 0)."""
    over = {"kl.form": "combined", "kl.head": "k1_in_reward", "kl.level": "sequence"}
    cfg, batch = config(**over), make_batch(seed=2)
    policy = tiny_llama64(seed=10, attn="sdpa")
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    logp, _ = make_logprob_fn(1.0, fast_forward=False)(policy, batch.input_ids, batch.attention_mask, L, False)
    adv = combined_advantages(
        batch.rewards,
        "k1_in_reward",
        logp.detach(),
        batch.ref_logp,
        batch.mask,
        beta=0.3,
        level="sequence",
        group_size=G,
        method="grpo",
    )
    loss = policy_objective(logp, batch.ref_logp, batch.mask, adv, ObjectiveSpec.from_config(cfg)).loss
    grads = torch.autograd.grad(loss, list(policy.parameters()))
    expected = {k: start[k] - g for (k, _), g in zip(policy.named_parameters(), grads, strict=True)}
    got, stats = step_with_sgd(config(**over, **{"algo.micro_batch_size": 2}), batch)
    bound = tol(expected, start)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=bound, msg=k)
    assert stats.kl_loss == 0.0


def test_a_non_finite_loss_skips_the_step_and_leaves_weights_and_optimizer_state_untouched():
    cfg, batch = config(), make_batch()
    policy = tiny_llama64(seed=10, attn="sdpa").train()
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    stats = update(
        policy,
        optimizer,
        batch,
        cfg,
        make_logprob_fn(1.0, fast_forward=False),
        record_step=7,
        hooks=Hooks(nan=lambda step: step == 7),  # the fault-injection seam: step 7's loss is NaN
    )
    assert stats.skipped_updates == 1
    assert all(torch.equal(v, start[k]) for k, v in policy.named_parameters())
    assert optimizer.state_dict()["state"] == {}  # AdamW never stepped: no moments


def test_mini_batches_hold_every_m_th_group():
    rows = mini_batch_rows(12, 2, 3)  # 6 groups of 2 rows
    assert [r.tolist() for r in rows] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]


def test_mini_batches_take_the_same_groups_from_every_shard():
    n, g, m, world = 32, 4, 2, 2  # 8 groups, 2 mini-batches, 2 ranks of 4 groups each
    whole = mini_batch_rows(n, g, m)
    for k in range(m):
        union = torch.cat([r * (n // world) + mini_batch_rows(n // world, g, m)[k] for r in range(world)])
        assert torch.equal(union.sort().values, whole[k].sort().values)
    assert whole[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]  # groups 0, 2, 4, 6


def test_fault_hooks_are_no_ops_unless_installed():
    """The seam the reliability tests use: nothing happens by default; the variables install callbacks."""
    from klgrad.trainer.faults import NO_HOOKS

    quiet = Hooks.from_env({})
    assert quiet == NO_HOOKS
    assert not any(quiet.nan(step) for step in range(5))
    quiet.at("update", 1)  # no kill
    nan = Hooks.from_env({"KLGRAD_NAN_AT": "2,3"})
    assert [nan.nan(step) for step in range(5)] == [False, False, True, True, False]
    assert Hooks.from_env({"KLGRAD_KILL_AT": "log:9"}).nan(9) is False
