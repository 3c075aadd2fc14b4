"""The RL trainer: ``train(cfg)`` runs the loop of :mod:`klgrad.trainer.loop`.

One concern per module: :mod:`~klgrad.trainer.loop` (the algorithm, top to bottom), :mod:`~klgrad.trainer.stages`
(its optional passes, chosen at setup), :mod:`~klgrad.trainer.setup` (models, data, optimizer, resumed state),
:mod:`~klgrad.trainer.draws` (each step's prompts and sampling uniforms), :mod:`~klgrad.trainer.update` (the
optimizer steps on one rollout), :mod:`~klgrad.trainer.evaluation` (held-out metrics), :mod:`~klgrad.trainer.record`
(metrics and their sinks), :mod:`~klgrad.trainer.checkpoints`, :mod:`~klgrad.trainer.staleness` (stale rollouts) and
:mod:`~klgrad.trainer.faults` (the reliability tests' hooks).
"""

from klgrad.kl import adaptive_beta
from klgrad.models.sources import EMBEDDED_DIR, reference_path
from klgrad.rewards import merge_rewards
from klgrad.schedule import lr_factor
from klgrad.trainer.checkpoints import checkpoint_is_valid, latest_checkpoint, load_checkpoint, save_checkpoint
from klgrad.trainer.draws import (
    draw_prompts,
    pad_responses,
    prompt_indices,
    prompt_seed,
    rollout_uniforms,
    step_generator,
)
from klgrad.trainer.evaluation import eval_objective_prompts, evaluate, objective_metrics
from klgrad.trainer.loop import hold_run_dir, train
from klgrad.trainer.record import CURVES, git_revision, plot_curves, read_jsonl, summarize, write_jsonl
from klgrad.trainer.setup import load_data, resolve_device, reward_specs
from klgrad.trainer.update import (
    SINGLE,
    Batch,
    PolicyLogprobs,
    UpdateStats,
    make_logprob_fn,
    mini_batch_rows,
    step_advantages,
    update,
)

__all__ = [
    "CURVES",
    "EMBEDDED_DIR",
    "SINGLE",
    "Batch",
    "PolicyLogprobs",
    "UpdateStats",
    "adaptive_beta",
    "checkpoint_is_valid",
    "draw_prompts",
    "eval_objective_prompts",
    "evaluate",
    "git_revision",
    "hold_run_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "load_data",
    "lr_factor",
    "make_logprob_fn",
    "merge_rewards",
    "mini_batch_rows",
    "objective_metrics",
    "pad_responses",
    "plot_curves",
    "prompt_indices",
    "prompt_seed",
    "read_jsonl",
    "reference_path",
    "resolve_device",
    "reward_specs",
    "rollout_uniforms",
    "save_checkpoint",
    "step_advantages",
    "step_generator",
    "summarize",
    "train",
    "update",
    "write_jsonl",
]
