"""The run record: the step's metrics, their sinks (metrics.jsonl, TensorBoard, W&B), the run's files
(config.yaml, run.json, summary.json, curves.png). Only rank 0 writes.

Record convention: ``step`` = optimizer-update steps done; the record with step 0 holds the reference's
evaluation. The keys are documented in docs/metrics.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klgrad.advantages import shape_rewards
from klgrad.config import Config, dump_yaml, to_dict
from klgrad.objective import ObjectiveSpec, objective_diagnostics
from klgrad.plotting import pyplot, save
from klgrad.rewards import RewardResult, accuracy_reward_name
from klgrad.rollout.mismatch import mismatch_stats
from klgrad.trainer.update import UpdateStats
from klgrad.version import __version__


@dataclass
class StepClock:
    """perf_counter stamps of one step's phases."""

    start: float = field(default_factory=time.perf_counter)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        """The phase ``phase`` ends now."""
        self.marks[phase] = time.perf_counter()

    def durations(self) -> dict[str, float]:
        """``time/<phase>``: each phase's seconds, from the previous mark (or the start)."""
        out, last = {}, self.start
        for phase, stamp in self.marks.items():
            out[f"time/{phase}"] = stamp - last
            last = stamp
        return out


@dataclass
class StepBatch:
    """The whole step's batch as the record sees it (all ranks' rows, prompt order); N rows, T response tokens."""

    rewards: Tensor
    """(N,) total rewards."""
    scored: RewardResult
    """Per-function rewards and failures of the N rows."""
    mask: Tensor
    """(N, T) response tokens."""
    sampler_logp: Tensor
    """(N, T) the sampler's log-probs of the pre-update policy."""
    ref_logp: Tensor
    """(N, T) reference log-probs."""
    truncated: Tensor
    """(N,) bool: the response hit ``max_new_tokens`` without EOS."""
    mismatch_weights: Tensor | None = None
    """(N, T) IS weights of the sampler/trainer mismatch, or None."""
    trainer_logp: Tensor | None = None
    """(N, T) the trainer's log-probs of the rollout (the mismatch measured against ``sampler_logp``), or None."""
    stepwise_kl: Tensor | None = None
    """(N,) each response's stepwise sequence KL (``train.log_stepwise_kl``), or None."""


def step_record(
    step: int,
    cfg: Config,
    batch: StepBatch,
    stats: UpdateStats,
    *,
    lr: float,
    clock: StepClock,
    beta: float | None = None,
) -> dict:
    """The metrics of one step (docs/metrics.md): rewards, sequence KL estimates of the pre-update policy,
    lengths, the update's statistics, the β the loss used (``beta``, the β in force; default ``cfg.kl.beta``),
    learning rate and timings.

    The KL estimates use the trainer's own log-probs of the rollout when it recomputed them (a sampler in other
    arithmetic: ``batch.trainer_logp``), else the sampler's: a mismatched engine's log-probs would add the
    sampler–trainer gap to KL(π‖π_ref) (a bf16 sampler's ~0.06 nats on SmolLM2 at step 1, where π = π_ref), and
    the adaptive β would chase it. The gap itself is recorded apart (``mismatch/*``)."""
    g = cfg.rollout.group_size
    rewards, mask = batch.rewards, batch.mask
    zeros, spec = torch.zeros_like(batch.ref_logp), ObjectiveSpec(cfg.kl, cfg.algo)
    policy_logp = batch.trainer_logp if batch.trainer_logp is not None else batch.sampler_logp  # (N, T)
    kl = objective_diagnostics(policy_logp, batch.ref_logp, mask, zeros, spec)
    _, shaping = shape_rewards(rewards, g, cfg.algo.shaping, cfg.algo.std_min, cfg.algo.std_max, return_stats=True)
    n_tok = int(mask.sum())
    record = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/std_in_group": float(rewards.view(-1, g).std(-1).mean()) if g > 1 else 0.0,
        "reward/zero_std_groups": shaping.zero_std_groups,
        **{f"reward/{name}": mean for name, mean in batch.scored.means().items()},  # over rows with an opinion
        "reward/failures": sum(batch.scored.failures.values()),
        "kl/k1": kl["kl_k1"],
        "kl/k2": kl["kl_k2"],
        "kl/k3": kl["kl_k3"],
        "kl/logp_gap": kl["logp_gap"],
        "kl/logp_gap_abs": kl["logp_gap_abs"],
        "response/length": float(mask.sum(-1).float().mean()),
        "response/truncated": float(batch.truncated.float().mean()),
        "entropy": stats.entropy,
        "loss/policy": stats.policy_loss,
        "loss/kl": stats.kl_loss,
        "clip/frac": stats.clip_frac,
        "clip/kl_frac": stats.kl_clip_frac,
        "ratio/mean": stats.ratio_mean,
        "ratio/max": stats.ratio_max,
        "grad_norm": stats.grad_norm,
        "skipped_updates": stats.skipped_updates,
        "beta": cfg.kl.beta if beta is None else beta,
        "lr": lr,
        **clock.durations(),
        "time/step": time.perf_counter() - clock.start,
        "tokens_per_s": n_tok / max(time.perf_counter() - clock.start, 1e-9),
    }
    if batch.stepwise_kl is not None:  # the same KL as kl/k1, each token's log-ratio replaced by its expectation
        record["kl/stepwise"] = float(batch.stepwise_kl.mean())
    if batch.mismatch_weights is not None:  # how far the sampler's log-probs are from the trainer's
        weights = batch.mismatch_weights[mask]
        record["mismatch/weight_mean"] = float(weights.mean()) if bool(mask.any()) else 1.0
        record["mismatch/weight_max"] = float(weights.max()) if bool(mask.any()) else 1.0
        record["mismatch/capped_frac"] = float((weights >= cfg.rollout.mismatch_cap).float().mean())
        record["mismatch/masked_frac"] = float((weights == 0).float().mean()) if bool(mask.any()) else 0.0
    if batch.trainer_logp is not None:  # the sampler's arithmetic against the trainer's, on the sampled tokens
        gap = mismatch_stats(batch.trainer_logp, batch.sampler_logp, mask)
        record["mismatch/logp_diff_abs"] = gap["logp_diff_abs"]
        record["mismatch/logp_diff_max"] = gap["logp_diff_max"]
        record["mismatch/kl_k1"] = gap["kl_k1"]
        record["mismatch/kl_k3"] = gap["kl_k3"]
    return record


def finite_or_none(record: dict) -> dict:
    """The record with non-finite floats as None (JSON has no NaN)."""
    return {k: (v if isinstance(v, int) or math.isfinite(v) else None) for k, v in record.items()}


# ----------------------------------------------------------------------------------------------------------
# sinks


def write_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line and flush it (a killed run loses at most the line being written)."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a metrics file; a torn last line (a killed run) ends the list."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a killed run
    return out


class RunRecord:
    """Where a run's records go: ``metrics.jsonl`` always, TensorBoard (``tb/``) and W&B when configured.

    Built on rank 0 only (``active=False`` elsewhere: every method is then a no-op)."""

    def __init__(self, cfg: Config, run_dir: Path, active: bool) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.active = active
        self.tensorboard = _tensorboard(run_dir) if cfg.train.tensorboard and active else None
        self.wandb = _wandb(cfg, run_dir) if cfg.train.wandb and active else None

    def write(self, record: dict) -> None:
        """Append ``record`` to metrics.jsonl; send its numbers (not timings) to TensorBoard and W&B."""
        if not self.active:
            return
        write_jsonl(self.metrics_path, record)
        step = record["step"]
        if self.tensorboard is not None:
            for k, v in record.items():
                if k != "step" and v is not None and not k.startswith("time/"):
                    self.tensorboard.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if v is not None}, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_run_files(cfg: Config, run_dir: Path, model_dir: Path, num_processes: int) -> None:
    """``config.yaml`` (the validated config) and ``run.json`` (git revision, model, version, processes)."""
    (run_dir / "config.yaml").write_text(dump_yaml(to_dict(cfg)), encoding="utf-8")
    (run_dir / "run.json").write_text(
        json.dumps(
            {
                "git_revision": git_revision(),
                "model": str(model_dir),
                "klgrad": __version__,
                "num_processes": num_processes,
            },
            indent=1,
        )
    )


def git_revision() -> str | None:
    """HEAD of the klgrad checkout this code runs from, or None outside git."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def require_wandb():
    """The wandb module, or a ValueError naming ``train.wandb``."""
    try:
        import wandb
    except ImportError as e:
        raise ValueError("train.wandb is true but the wandb package is not installed (pip install wandb)") from e
    return wandb


WANDB_DEFAULTS = {"project": "WANDB_PROJECT", "name": "WANDB_NAME", "dir": "WANDB_DIR"}
"""The ``wandb.init`` arguments klgrad sets a default for, and the environment variable that overrides each."""


def wandb_init_kwargs(cfg: Config, run_dir: Path, environ: Mapping[str, str]) -> dict[str, Any]:
    """``wandb.init``'s arguments: the config, and project ``klgrad``, the run directory's name and the run
    directory as defaults only where ``WANDB_PROJECT``, ``WANDB_NAME``, ``WANDB_DIR`` are unset (or empty): an
    argument would override the variable, and wandb reads the environment (WANDB_ENTITY, WANDB_RUN_GROUP,
    WANDB_TAGS, WANDB_MODE, ...) for everything not passed."""
    defaults = {"project": "klgrad", "name": run_dir.name, "dir": str(run_dir)}
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if not environ.get(WANDB_DEFAULTS[k])}
    kwargs["config"] = to_dict(cfg)
    return kwargs


def _wandb(cfg: Config, run_dir: Path):
    """A W&B run when ``train.wandb`` is set, configured by :func:`wandb_init_kwargs` and wandb's environment."""
    wandb = require_wandb()
    return wandb.init(**wandb_init_kwargs(cfg, run_dir, os.environ))


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL only
        return None
    return SummaryWriter(str(run_dir / "tb"))


# ----------------------------------------------------------------------------------------------------------
# the end of a run


def summarize(records: list[dict]) -> dict:
    """First and last held-out evaluation and the mean of the last 10 steps' batch metrics."""
    evals = [r for r in records if "eval/greedy_reward" in r]
    tail = [r for r in records if "reward/mean" in r][-10:]
    keys = [k for k in (tail[0] if tail else {}) if not k.startswith(("eval/", "time/")) and k != "step"]
    return {
        "steps": records[-1]["step"] if records else 0,
        "eval_first": {k: v for k, v in evals[0].items() if k.startswith("eval/") or k == "step"} if evals else {},
        "eval_last": {k: v for k, v in evals[-1].items() if k.startswith("eval/") or k == "step"} if evals else {},
        "last10_mean": {
            k: sum(r[k] for r in tail if r.get(k) is not None) / max(1, sum(r.get(k) is not None for r in tail))
            for k in keys
        },
        "mean_step_time_s": (
            sum(r["time/step"] for r in records if "time/step" in r) / max(1, sum("time/step" in r for r in records))
        ),
    }


CURVES = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "accuracy"),
    ("loss/kl", "KL loss"),
    ("kl/logp_gap", "log-prob diff  mean(l - r)"),
    ("response/length", "response length"),
    ("entropy", "entropy"),
    ("reward/std_in_group", "reward std within groups"),
    ("loss/policy", "policy loss"),
    ("kl/k1", "sequence KL (k1)"),
)


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    """The paper's panels (reward, accuracy, KL loss, log-prob diff, length, entropy, reward std, policy
    loss, sequence KL) against the step, with held-out greedy accuracy on the accuracy panel."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 3, figsize=(13, 9.5))
    steps = [r["step"] for r in records if "reward/mean" in r]
    logged = {k.removeprefix("reward/") for r in records for k in r}
    accuracy_key = "reward/" + (accuracy_reward_name(logged) or "accuracy")
    for ax, (key, label) in zip(axes.flat, CURVES, strict=True):
        key = accuracy_key if key == "reward/accuracy" else key
        ys = [r[key] if r.get(key) is not None else float("nan") for r in records if "reward/mean" in r]
        ax.plot(steps, ys, color="#1f5f8b", lw=1.2, label="train batch")
        if key == accuracy_key:
            ev = [(r["step"], r["eval/greedy_accuracy"]) for r in records if "eval/greedy_accuracy" in r]
            if ev:
                ax.plot(*zip(*ev, strict=True), "o-", color="#c0392b", ms=4, label="held-out greedy")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save(fig, path, dpi=110)


def stopped_at(records: list[dict], stop_when: str | None) -> dict | None:
    """``train.stop_when``'s stop (:func:`klgrad.stopping.stop_point`) when the run ends at it, else None (a run
    stopped there and resumed on past it did not stop)."""
    if not stop_when or not records:
        return None
    from klgrad.stopping import parse_stop_rule, stop_point

    hit = stop_point(records, parse_stop_rule(stop_when))
    return hit if hit is not None and hit["step"] == records[-1]["step"] else None


def finish_run(cfg: Config, run_dir: Path, beta: float | None = None) -> dict:
    """summary.json and curves.png from metrics.jsonl (its title with ``beta``, the β in force at the end, default
    ``kl.beta``); returns the summary (with ``stopped`` when ``train.stop_when`` ended the run)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    summary = summarize(records)
    stop = stopped_at(records, cfg.train.stop_when)
    if stop is not None:
        summary["stopped"] = stop
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if records:
        plot_curves(
            records,
            run_dir / "curves.png",
            f"klgrad train — {cfg.data.task}, head {cfg.kl.head} ({cfg.kl.level}, {cfg.kl.form}), "
            f"β={cfg.kl.beta if beta is None else beta}, seed {cfg.train.seed}",
        )
    return summary
