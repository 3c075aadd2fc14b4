"""klgrad.trainer.staleness: stale rollouts (``rollout.staleness`` k) sample with π_{t−k}, and the loss's behaviour
log-probs are that policy's; a resumed stale run is the uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import klgrad.trainer.loop as loop
from klgrad.models import load_model_and_tokenizer
from klgrad.rollout.samplers import make_sampler
from klgrad.trainer import EMBEDDED_DIR, read_jsonl, train
from klgrad.trainer.checkpoints import load_stale_snapshots
from klgrad.trainer.draws import rollout_uniforms
from klgrad.trainer.staleness import (
    STALE_FILE,
    StaleSnapshots,
    behaviour_weights,
    load_snapshot,
    load_stale,
    save_stale,
    snapshot,
)
from klgrad.trainer.update import make_logprob_fn
from tests.helpers.extras import needs_extras
from tests.helpers.tiny_runs import small


def _bump(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_behaviour_weights_hold_the_policy_k_pushes_back_and_restore_the_current_one():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0, 10.0]]))  # integers: sums of them are exact
    model.bias.requires_grad_(False)  # frozen: not snapshotted (LoRA's base weights)
    stale = StaleSnapshots(2)
    seen = []
    for t in range(5):  # the weight after t updates is w0 + t
        with behaviour_weights(model, stale):
            seen.append(model.weight.detach().clone())
        assert len(stale.queue) == min(t + 1, 3)
        _bump(model, 1.0)
    w0 = seen[0]
    for t in range(5):  # step t sampled with the policy of max(t − 2, 0) updates
        torch.testing.assert_close(seen[t], w0 + max(t - 2, 0), rtol=0, atol=0)
    torch.testing.assert_close(model.weight.detach(), w0 + 5, rtol=0, atol=0)  # restored, then one more update
    assert set(stale.current) == {"weight"}
    # after step 4 the queue holds π_2, π_3, π_4; a checkpoint keeps π_3, π_4 (step 5 samples with π_3)
    assert [s["weight"].tolist() for s in stale.to_save()] == [[[3.0, 13.0]], [[4.0, 14.0]]]


def test_staleness_zero_copies_nothing():
    model = torch.nn.Linear(2, 1)
    stale = StaleSnapshots(0)
    with behaviour_weights(model, stale):
        pass
    assert len(stale.queue) == 0
    assert stale.to_save() == []


def test_stale_snapshots_round_trip_and_a_checkpoint_without_them_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    snaps = [snapshot(model)]
    _bump(model, 0.5)
    snaps.append(snapshot(model))
    save_stale(snaps, tmp_path / STALE_FILE)
    back = load_stale(tmp_path / STALE_FILE)
    assert [sorted(s) for s in back] == [sorted(s) for s in snaps]
    for a, b in zip(back, snaps, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name])
    assert load_stale_snapshots(tmp_path, 0, "cpu") == []
    assert len(load_stale_snapshots(tmp_path, 2, "cpu")) == 2
    with pytest.raises(ValueError, match=r"rollout\.staleness = 2"):
        load_stale_snapshots(tmp_path / "elsewhere", 2, "cpu")


@pytest.mark.slow
@pytest.mark.numerics
def test_step_t_samples_what_the_policy_of_step_t_minus_k_draws_and_its_logprobs_are_the_behaviour(
    tmp_path, monkeypatch
):
    """staleness k = 2, 5 steps at lr 1e-3 (each update moves the policy measurably). At every step the batch the
    update receives is regenerated from scratch: the weights the policy had before update t − k (recorded at that
    update), the klgrad sampler and step t's uniforms give exactly the batch's tokens, and the trainer's forward of
    those weights gives exactly the batch's old_logp. The current policy's log-probs differ from them by far more
    than rounding from step 2 on, so a loss fed the current policy's log-probs would fail here."""
    k, steps = 2, 5
    cfg = small(tmp_path, **{"rollout.staleness": k, "train.steps": steps, "optim.lr": 1e-3, "train.eval_every": 0})
    seen: list[tuple[dict, object]] = []  # (π_t's weights before update t, the batch of step t)
    real_update = loop.update

    def spy(policy, optimizer, batch, *args, **kwargs):
        seen.append((snapshot(policy), batch))
        return real_update(policy, optimizer, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "update", spy)
    train(cfg, progress=False)
    assert len(seen) == steps
    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    sampler = make_sampler("klgrad", tok.eos_token_id, tok.pad_token_id)
    logprob_fn = make_logprob_fn(cfg.rollout.temperature)
    g, p, n_new = cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens
    gaps = []
    for t, (_, batch) in enumerate(seen):
        assert batch.old_logp is not None  # stale: an off-policy batch
        load_snapshot(model, seen[max(t - k, 0)][0])
        model.eval()
        prompts, prompt_mask = (
            batch.input_ids[::g, : batch.response_start],
            batch.attention_mask[::g, : batch.response_start],
        )
        with torch.no_grad():
            again = sampler.generate(
                model,
                prompts,
                prompt_mask,
                group_size=g,
                max_new_tokens=n_new,
                temperature=cfg.rollout.temperature,
                uniforms=rollout_uniforms(cfg.train.seed, t, slice(0, p), g, n_new),
            )
        model.train()
        assert torch.equal(again.input_ids, batch.input_ids), t  # the very samples π_{t−k} draws
        with torch.no_grad():
            old, _ = logprob_fn(model, batch.input_ids, batch.attention_mask, batch.response_start, False)
            load_snapshot(model, seen[t][0])  # the current policy π_t
            cur, _ = logprob_fn(model, batch.input_ids, batch.attention_mask, batch.response_start, False)
        assert torch.equal(old, batch.old_logp), t  # the behaviour log-probs are π_{t−k}'s
        gaps.append(float((cur - batch.old_logp).abs().max()))
    assert gaps[0] == 0.0  # step 0: π_0 is the current policy
    # from step 2 (t − k = 0 while π_2 has two updates of lr 1e-3) the current log-probs are O(1e-2) away
    # (measured 0.05-0.3); two float32 forwards of one network agree to ~1e-6
    assert all(gap > 1e-3 for gap in gaps[2:]), gaps


@pytest.mark.slow
def test_a_stale_run_resumes_into_the_uninterrupted_run(tmp_path):
    """staleness 2: killed after step 3 (last checkpoint at step 2, holding π_1, π_2) and resumed, the run's records
    and final weights are the uninterrupted run's, bit for bit; the checkpoint holds the stale snapshots."""
    over = {"rollout.staleness": 2, "train.steps": 4, "optim.lr": 1e-3}
    full = small(tmp_path / "a", **over)
    train(full, progress=False)
    part = small(tmp_path / "b", **over)
    train(part, progress=False, stop_after=3)
    train(part, resume=True, progress=False)

    def strip(rs):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in rs]

    a = strip(read_jsonl(Path(full.train.out_dir) / "metrics.jsonl"))
    b = strip(read_jsonl(Path(part.train.out_dir) / "metrics.jsonl"))
    assert a == b
    assert any(r.get("ratio/max", 1.0) != 1.0 for r in a)  # the batches were off-policy
    ckpt = Path(part.train.out_dir) / "checkpoints"
    assert len(load_stale(ckpt / "step_000002" / STALE_FILE)) == 2
    wa = load_stale(Path(full.train.out_dir) / "checkpoints" / "step_000004" / STALE_FILE)
    wb = load_stale(ckpt / "step_000004" / STALE_FILE)
    for sa, sb in zip(wa, wb, strict=True):
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name


@needs_extras("peft")
@pytest.mark.slow
@pytest.mark.numerics
def test_a_lora_run_snapshots_the_adapter_only_and_samples_step_one_from_the_zero_adapter(tmp_path, monkeypatch):
    """LoRA, staleness 1, 2 steps: the snapshots (and the checkpoint's stale file) hold the adapter's A and B only,
    and step 1 samples with π_0, whose adapter is B = 0: its behaviour log-probs are the reference's (the base with
    the adapter off) up to the rounding of two forwards, while the current policy's, one update of lr 1e-2 later,
    are not."""
    cfg = small(
        tmp_path,
        **{"model.lora_rank": 4, "rollout.staleness": 1, "train.steps": 2, "optim.lr": 1e-2, "train.eval_every": 0},
    )
    seen = []
    real_update = loop.update
    logprob_fn = make_logprob_fn(cfg.rollout.temperature)

    def spy(policy, optimizer, batch, *args, **kwargs):
        with torch.no_grad():  # the current policy's log-probs of the batch
            cur, _ = logprob_fn(policy, batch.input_ids, batch.attention_mask, batch.response_start, False)
        seen.append((batch, cur))
        return real_update(policy, optimizer, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "update", spy)
    train(cfg, progress=False)
    (snap,) = load_stale(Path(cfg.train.out_dir) / "checkpoints" / "step_000002" / STALE_FILE)
    assert snap
    assert all("lora_A" in name or "lora_B" in name for name in snap), sorted(snap)
    batch, cur = seen[1]

    def gap(a, b):
        return float(torch.where(batch.mask, a - b, 0.0).abs().max())

    # float32 log-probs of a 4-layer model through two code paths (adapter off vs B = 0): ~1e-6 (network_tol)
    assert gap(batch.old_logp, batch.ref_logp) < 1e-4
    assert gap(cur, batch.old_logp) > 1e-3  # the current policy, one update on, is not the behaviour
