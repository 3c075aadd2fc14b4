"""klgrad.trainer.record: the step's metrics from a hand-built batch (closed forms), the sinks and the summary."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from klgrad.config import load_config, to_dict
from klgrad.rewards import RewardResult
from klgrad.trainer.record import (
    RunRecord,
    StepBatch,
    StepClock,
    finite_or_none,
    read_jsonl,
    step_record,
    summarize,
    wandb_init_kwargs,
    write_run_files,
)
from klgrad.trainer.update import UpdateStats


def batch(weights: torch.Tensor | None = None) -> StepBatch:
    """2 groups of 4 responses; response lengths 3, 1, 2, 3 | 3, 3, 1, 2."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    lengths = torch.tensor([3, 1, 2, 3, 3, 3, 1, 2])
    mask = torch.arange(3)[None, :] < lengths[:, None]  # (8, 3)
    logp = -torch.linspace(0.1, 2.4, 24).view(8, 3)
    ref_logp = logp - 0.1 * torch.arange(1, 25, dtype=torch.float32).view(8, 3) / 24  # u = l − r > 0
    scored = RewardResult(total=rewards.tolist(), per_function={"accuracy": rewards.tolist()}, failures={})
    truncated = lengths == 3
    return StepBatch(rewards, scored, mask, logp, ref_logp, truncated, weights)


def test_step_record_matches_closed_forms():
    cfg = load_config(None, {"rollout.group_size": 4, "rollout.prompts_per_step": 2})
    b = batch()
    stats = UpdateStats(policy_loss=0.25, kl_loss=0.5, entropy=1.5, clip_frac=0.125, grad_norm=2.0)
    clock = StepClock()
    for phase in ("rollout", "reward", "ref", "update"):
        clock.mark(phase)
    record = step_record(3, cfg, b, stats, lr=1e-4, clock=clock)
    u = torch.where(b.mask, b.sampler_logp - b.ref_logp, 0.0).sum(-1).double()  # (8,) written out here
    assert record["step"] == 3
    assert record["reward/mean"] == 0.375
    assert record["reward/std_in_group"] == pytest.approx(0.25)  # stds 0.5 (unbiased, 3 of 4) and 0
    assert record["reward/zero_std_groups"] == 1
    assert record["reward/accuracy"] == 0.375
    assert record["kl/k1"] == pytest.approx(float(u.mean()), rel=1e-6)
    assert record["kl/k2"] == pytest.approx(float((0.5 * u**2).mean()), rel=1e-6)
    assert record["kl/k3"] == pytest.approx(float((torch.exp(-u) - 1 + u).mean()), rel=1e-5)
    tokens = int(b.mask.sum())
    assert record["kl/logp_gap"] == pytest.approx(float(u.sum()) / tokens, rel=1e-6)
    assert record["response/length"] == 2.25
    assert record["response/truncated"] == 0.5
    assert (record["loss/policy"], record["loss/kl"], record["entropy"]) == (0.25, 0.5, 1.5)
    assert (record["clip/frac"], record["grad_norm"], record["beta"], record["lr"]) == (0.125, 2.0, 0.5, 1e-4)
    assert {"time/rollout", "time/reward", "time/ref", "time/update", "time/step"} <= set(record)
    assert all(record[f"time/{p}"] >= 0 for p in ("rollout", "reward", "ref", "update"))
    assert not any(k.startswith("mismatch/") for k in record)


def test_mismatch_metrics_are_over_response_tokens_only():
    cfg = load_config(None, {"rollout.group_size": 4, "rollout.prompts_per_step": 2, "rollout.mismatch_cap": 2.0})
    weights = torch.full((8, 3), 1000.0)  # padding: must never count
    b = batch()
    weights[b.mask] = torch.linspace(0.5, 2.0, int(b.mask.sum()))
    b = batch(weights)
    record = step_record(1, cfg, b, UpdateStats(), lr=1.0, clock=StepClock())
    assert record["mismatch/weight_mean"] == pytest.approx(1.25)
    assert record["mismatch/weight_max"] == 2.0
    assert record["mismatch/capped_frac"] == pytest.approx(1 / int(b.mask.sum()))


def test_records_round_trip_and_a_torn_last_line_is_dropped(tmp_path):
    cfg = load_config(None, {"train.tensorboard": True})
    sink = RunRecord(cfg, tmp_path, active=True)
    sink.write(finite_or_none({"step": 0, "eval/greedy_accuracy": 0.5, "eval/kl_k1": float("nan")}))
    sink.write({"step": 1, "reward/mean": 0.25, "time/step": 0.1})
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward/me')  # a kill mid-write
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert records == [
        {"step": 0, "eval/greedy_accuracy": 0.5, "eval/kl_k1": None},
        {"step": 1, "reward/mean": 0.25, "time/step": 0.1},
    ]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard got the numbers
    silent = RunRecord(cfg, tmp_path / "other", active=False)  # ranks other than 0 write nothing
    silent.write({"step": 1})
    assert not (tmp_path / "other").exists()


def test_summary_is_first_and_last_evaluation_and_the_last_ten_steps():
    records = [{"step": 0, "eval/greedy_reward": 0.1, "eval/greedy_accuracy": 0.1}]
    records += [
        {"step": s, "reward/mean": float(s), "kl/k1": None if s == 12 else 1.0, "time/step": 0.5} for s in range(1, 13)
    ]
    records[-1].update({"eval/greedy_reward": 0.9, "eval/greedy_accuracy": 0.8})
    summary = summarize(records)
    assert summary["steps"] == 12
    assert summary["eval_first"] == {"step": 0, "eval/greedy_reward": 0.1, "eval/greedy_accuracy": 0.1}
    assert summary["eval_last"] == {"step": 12, "eval/greedy_reward": 0.9, "eval/greedy_accuracy": 0.8}
    assert summary["last10_mean"]["reward/mean"] == sum(range(3, 13)) / 10
    assert summary["last10_mean"]["kl/k1"] == 1.0  # a missing (non-finite) value is left out, not counted 0
    assert math.isclose(summary["mean_step_time_s"], 0.5)
    json.dumps(summary)


WANDB_ENV = {
    "WANDB_PROJECT": "my-project",
    "WANDB_ENTITY": "my-team",
    "WANDB_NAME": "my-run",
    "WANDB_RUN_GROUP": "sweep-1",
    "WANDB_TAGS": "a,b",
    "WANDB_MODE": "offline",
    "WANDB_DIR": "/tmp/wandb-files",
}


def test_wandb_defaults_apply_only_where_the_environment_is_silent(tmp_path):
    """An argument to ``wandb.init`` beats its environment variable, so klgrad passes its defaults (project
    klgrad, the run directory's name and folder) only where the variable is unset or empty."""
    cfg = load_config()
    run_dir = tmp_path / "seed_3"
    assert wandb_init_kwargs(cfg, run_dir, {}) == {
        "project": "klgrad",
        "name": "seed_3",
        "dir": str(run_dir),
        "config": to_dict(cfg),
    }
    assert wandb_init_kwargs(cfg, run_dir, WANDB_ENV) == {"config": to_dict(cfg)}  # wandb reads the rest itself
    some = {"WANDB_PROJECT": "p", "WANDB_NAME": "", "WANDB_ENTITY": "e"}
    assert wandb_init_kwargs(cfg, run_dir, some) == {"name": "seed_3", "dir": str(run_dir), "config": to_dict(cfg)}


def test_train_wandb_passes_the_environment_through(tmp_path, monkeypatch):
    """With ``train.wandb`` the run starts from :func:`wandb_init_kwargs` of the process environment (a stand-in
    wandb module: wandb is not needed)."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for key in WANDB_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    cfg = load_config(None, {"train.wandb": True, "train.tensorboard": False})
    RunRecord(cfg, tmp_path / "run", active=True).close()
    assert calls == [{"name": "run", "dir": str(tmp_path / "run"), "config": to_dict(cfg)}]


def test_saved_config_reads_back_identically(tmp_path):
    """config.yaml keeps a number-like string field a string (``'1e-6'``) and floats exact, for --resume and eval."""
    over = {"model.path": "1e-6", "data.prompt_column": "1.10", "optim.lr": 5e-7, "kl.beta": 1e-3}
    cfg = load_config(None, over)
    write_run_files(cfg, tmp_path, Path("model"), 1)
    assert load_config(tmp_path / "config.yaml") == cfg
