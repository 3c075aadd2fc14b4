"""A small ``klgrad train`` config on the shipped tiny reference (``configs/tiny_add.yaml``, read from the
repository root): 3 steps of 4 prompts x 4 samples, for the tests that run the trainer (CPU and GPU)."""

from __future__ import annotations

from pathlib import Path

from klgrad.config import Config, load_config


def small(tmp_path: Path, **over) -> Config:
    """``configs/tiny_add.yaml`` made small, writing under ``tmp_path / "run"``; ``over``: dotted overrides on top."""
    base = {
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "data.n_eval": 8,
        "data.n_train": 200,
        "train.steps": 3,
        "train.eval_every": 2,
        "train.save_every": 2,
        "train.out_dir": str(tmp_path / "run"),
        "train.tensorboard": False,
        "algo.micro_batch_size": 8,
        "train.threads": 2,  # pinned, as the shipped config was before 'auto': runs compared bit for bit must not
        # change their thread count with the machine's load
    }
    return load_config("configs/tiny_add.yaml", {**base, **over})


SMALL_GRID = {
    "data.n_eval": 8,
    "data.n_train": 200,
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "algo.micro_batch_size": 16,
    "train.eval_objective_prompts": 3,
}
"""A ``klgrad compare`` grid's overrides of ``configs/tiny_add.yaml`` made small (its ``extra_overrides``)."""
