"""A run's setup: data, models, sampler, optimizer and schedule, resumed state; everything the loop holds.

Nothing here writes into the run directory except :func:`setup_run` (which runs under the directory's lock).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from klgrad.config import Config, ConfigError, KLConfig, load_config, to_dict
from klgrad.data.example import Example
from klgrad.data.loaders import load_examples
from klgrad.data.tasks import make_splits
from klgrad.distributed import Dist, this_process_placement
from klgrad.kl import KLHead
from klgrad.logprobs import logprobs_and_next_kl
from klgrad.models import disable_dropout, load_model_and_tokenizer
from klgrad.models.lora import apply_lora, base_view, trainable_parameters
from klgrad.objective import KLTermHead, ObjectiveSpec
from klgrad.rewards import RewardSpec
from klgrad.rollout.batch import Sampler
from klgrad.rollout.encoding import uses_chat
from klgrad.rollout.samplers import make_sampler
from klgrad.schedule import lr_factor
from klgrad.trainer.checkpoints import latest_checkpoint, load_checkpoint, load_stale_snapshots
from klgrad.trainer.faults import Hooks
from klgrad.trainer.record import RunRecord, read_jsonl, write_run_files
from klgrad.trainer.staleness import Snapshot, StaleSnapshots
from klgrad.trainer.update import LogprobFn, PolicyLogprobs, make_logprob_fn


def load_data(cfg: Config) -> tuple[list[Example], list[Example]]:
    """(training prompts, held-out prompts): the synthetic task's splits, or a data file's rows (the first
    ``min(data.n_eval, rows / 5)`` held out)."""
    if cfg.data.task == "file":
        res = load_examples(
            cfg.data.path,
            prompt_column=cfg.data.prompt_column,
            answer_column=cfg.data.answer_column,
            skip_bad_rows=cfg.data.skip_bad_rows,
        )
        examples = [
            dataclasses.replace(e, meta={**e.meta, "task": cfg.data.response_format}) for e in res.examples
        ]  # the format reward reads its pattern from the task column
        n_eval = min(cfg.data.n_eval, max(1, len(examples) // 5))
        return examples[n_eval:] or examples, examples[:n_eval]
    train, heldout = make_splits(cfg.data.task, cfg.data.n_train, cfg.data.n_eval, cfg.data.seed, cfg.data.digits)
    return train, heldout


def kl_head(cfg: Config) -> KLHead | KLTermHead:
    """``kl.head``: a built-in, a registered head or a user's ``module:name``, imported now (before anything is
    written), or the KL term config load made of a framework preset id. Raises :class:`ConfigError` naming
    ``kl.head`` when it cannot be loaded (a preset id in a config not made by ``load_config``: with the fix)."""
    spec = ObjectiveSpec(cfg.kl, cfg.algo)
    try:
        return spec.term_head or spec.head
    except ValueError as e:
        raise ConfigError(f"kl.head: {e}") from None


def reward_specs(cfg: Config) -> list[RewardSpec]:
    """Built-in names (accuracy, format) or ``module:function`` (TRL signature), weighted."""
    return [RewardSpec.load(f.name, f.weight) for f in cfg.reward.functions]


def resolve_device(setting: str, world: int) -> torch.device:
    """``model.device`` of this process in a run of ``world`` processes (:func:`~klgrad.distributed.process_placement`,
    the rule :meth:`Dist.from_env` places the accelerator by): one process: auto = cuda when torch sees a GPU, else
    cpu; several: ``cuda:LOCAL_RANK`` (NCCL) when torch sees GPUs and the setting is auto or cuda, else cpu (gloo).
    Raises :class:`ConfigError` naming ``model.device`` when the setting cannot work here."""
    return torch.device(this_process_placement(setting, world).device)


def sampler_options(cfg: Config) -> dict:
    """The rollout engine's own options from the config."""
    if cfg.rollout.engine == "klgrad":
        dtype = cfg.rollout.sampler_dtype
        return {"fast_forward": cfg.model.fast_forward, "dtype": None if dtype is None else getattr(torch, dtype)}
    if cfg.rollout.engine == "vllm":
        return {"seed": cfg.train.seed}
    return {}


@dataclass
class Run:
    """Everything a run holds between steps."""

    cfg: Config
    """The run's one config, as given and recorded in config.yaml (evaluation's J_β is at its ``kl.beta``)."""
    beta: float
    """The β in force: ``kl.beta``, moved after every step by an adaptive β (``kl.target_kl``), or a resumed run's
    checkpoint value. The loss (:func:`~klgrad.trainer.update.update`), the record and the checkpoint read it here."""
    dist: Dist
    run_dir: Path
    policy: torch.nn.Module
    """The trained model (plain: rollout, no-grad passes, checkpoints); under LoRA the transformers model with
    peft's adapted layers in place."""
    ref: torch.nn.Module
    """The reference π_ref, frozen between resets: the policy's weights are copied into it every
    ``kl.reset_ref_every`` steps (:func:`~klgrad.trainer.loop.reset_reference`). Under LoRA the policy's base
    weights with the adapter off (:func:`~klgrad.models.lora.base_view`)."""
    tokenizer: object
    chat: bool
    """Prompts go through the tokenizer's chat template (``data.prompt_format``; :func:`uses_chat`)."""
    sampler: Sampler
    logprob_fn: LogprobFn
    train_model: torch.nn.Module
    """:class:`~klgrad.trainer.update.PolicyLogprobs` of the policy, DDP-wrapped under accelerate."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_set: list[Example]
    eval_set: list[Example]
    specs: list[RewardSpec]
    device: torch.device
    record: RunRecord
    start: int
    """Steps done before this call (a resumed run's checkpoint step)."""
    hooks: Hooks
    """The fault-injection seam (:mod:`klgrad.trainer.faults`): no-ops unless a test installs callbacks."""
    stale: StaleSnapshots
    """The old policies stale rollouts sample from (``rollout.staleness``; :mod:`klgrad.trainer.staleness`)."""

    @property
    def kl(self) -> KLConfig:
        """The ``kl`` record at the β in force (the record's field replaced, never a second β)."""
        return self.cfg.kl if self.beta == self.cfg.kl.beta else dataclasses.replace(self.cfg.kl, beta=self.beta)

    @property
    def updates_per_step(self) -> int:
        return self.cfg.algo.ppo_epochs * self.cfg.algo.mini_batches

    @property
    def off_policy(self) -> bool:
        """More than one optimizer step per rollout (every step after the first is off-policy), or stale rollouts
        (``rollout.staleness`` > 0: the samples are an older policy's)."""
        return self.updates_per_step > 1 or self.cfg.rollout.staleness > 0


def load_policy_and_reference(cfg: Config, model_dir: Path, device: torch.device):
    """(policy, reference, tokenizer), dropout off in both (every log-prob klgrad compares, behaviour, current
    and reference, must be of one deterministic policy, in train mode or eval mode, with the fast forward or
    transformers'); the reference frozen.

    Full fine-tuning (``model.lora_rank`` = 0): two copies of the starting model. LoRA: the starting model with a
    peft adapter on ``model.lora_targets`` (A drawn from a generator seeded with ``train.seed``, B = 0, so the
    policy starts equal to the reference; only A and B train), and as the reference
    :func:`~klgrad.models.lora.base_view`: the same base tensors with the adapter off, no second copy.
    """
    attn = None if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation
    load = dict(dtype=cfg.model.dtype, attn_implementation=attn, device=device)
    policy, tokenizer = load_model_and_tokenizer(model_dir, **load)
    if cfg.model.lora_rank:
        disable_dropout(policy)
        m = cfg.model
        policy = apply_lora(policy, m.lora_rank, m.lora_alpha, m.lora_targets, seed=cfg.train.seed).get_base_model()
        ref = base_view(policy)
    else:
        ref, _ = load_model_and_tokenizer(model_dir, **load)
        disable_dropout(policy)
        disable_dropout(ref)
    ref.eval().requires_grad_(False)
    policy.train()
    return policy, ref, tokenizer


def make_optimizer(cfg: Config, policy: torch.nn.Module):
    """AdamW over the policy's trainable parameters (all of them, or a LoRA adapter's A and B) and its
    learning-rate schedule, stepped once per optimizer update (``lr_factor`` of the step)."""
    optimizer = torch.optim.AdamW(
        trainable_parameters(policy), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
    )
    updates_per_step = cfg.algo.ppo_epochs * cfg.algo.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda k: lr_factor(k // updates_per_step, cfg.train.steps, cfg.optim.warmup_steps, cfg.optim.schedule),
    )
    return optimizer, scheduler


RESUMABLE: tuple[str, ...] = (
    "train.steps",
    "train.eval_every",
    "train.save_every",
    "train.tensorboard",
    "train.wandb",
    "train.threads",
    "train.max_skipped_steps",
    "train.out_dir",
    "model.device",
)
"""The fields ``--resume`` may change (docs/reliability.md, "What a resume may change"): how long the run goes on
(its learning-rate schedule follows ``train.steps``), how often it evaluates and saves, where its records go and
where it computes. The new values apply from the resumed step on and config.yaml records them; any other field is
refused."""


def changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted fields whose values differ between two nested config dicts."""
    out: list[str] = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def dotted_value(data: dict, dotted: str) -> object:
    """``data["kl"]["beta"]`` for ``"kl.beta"``."""
    return functools.reduce(lambda node, key: node[key], dotted.split("."), data)


def check_resume(cfg: Config, run_dir: Path) -> None:
    """Refuse to resume the run in ``run_dir`` with a config that differs from its recorded config.yaml in a field
    outside :data:`RESUMABLE`: a :class:`ConfigError` naming each such field (``klgrad train`` exits 2)."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return
    old, new = to_dict(load_config(saved)), to_dict(cfg)  # loaded: a field added since takes its default
    refused = [f for f in changed_fields(old, new) if f not in RESUMABLE]
    if refused:
        raise ConfigError(
            "\n".join(
                f"{f} cannot change on --resume: the run in {run_dir} was made with {dotted_value(old, f)!r}, asked "
                f"{dotted_value(new, f)!r} (a run's steps keep one config; start a new run for another; "
                "docs/reliability.md)"
                for f in refused
            )
        )


def follow_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Set the learning rates to the schedule's at the scheduler's update count, under this config's
    ``train.steps``: a resumed run that extends its steps goes on along its new schedule (same steps: the same
    values). ``step()`` recomputes ``base_lr · factor(count)`` after one step back."""
    scheduler.last_epoch -= 1
    scheduler.step()


def resume_or_create(
    run_dir: Path, dist: Dist, resume: bool, policy, ref, optimizer, scheduler, staleness: int = 0
) -> tuple[int, float | None, list[Snapshot]]:
    """(start step, the checkpoint's β or None, its stale snapshots): a resumed run's last valid checkpoint loaded
    on every rank (rank 0 repairs the pointer and drops metrics of steps after it), or a new run directory (refused
    when it already holds a run). A stale-rollout run (``staleness`` k > 0) resumes with the old policies its
    checkpoint kept, or is refused when it has none (:func:`~klgrad.trainer.checkpoints.load_stale_snapshots`)."""
    metrics_path = run_dir / "metrics.jsonl"
    if resume:
        ckpt = latest_checkpoint(run_dir)
        start, beta, stale = 0, None, []
        if ckpt is not None:
            start, beta = load_checkpoint(ckpt, policy, ref, optimizer, scheduler)  # a LoRA run: adapter only
            stale = load_stale_snapshots(ckpt, staleness, next(policy.parameters()).device)
            follow_schedule(scheduler)
        dist.barrier()  # every rank has read the checkpoint before rank 0 writes anything
        if dist.is_main:
            if ckpt is not None:
                (ckpt.parent / "latest").write_text(ckpt.name)  # repair a pointer left behind by a kill
            kept = [r for r in read_jsonl(metrics_path) if r["step"] <= start]  # drop steps after the checkpoint
            run_dir.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return start, beta, stale
    if metrics_path.exists():
        raise FileExistsError(f"{run_dir} already holds a run; use --resume or another train.out_dir")
    dist.barrier()  # every rank has checked before rank 0 creates the run
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    return 0, None, []


def setup_run(
    cfg: Config,
    dist: Dist,
    data: tuple[list[Example], list[Example]],
    specs: list[RewardSpec],
    model_dir: Path,
    device: torch.device,
    resume: bool,
    hooks: Hooks,
) -> Run:
    """Load the models, build the sampler and optimizer, resume or create the run directory, write the run's
    files and open its record. Called under the run directory's lock. A resumed adaptive-β run goes on with its
    checkpoint's β (:attr:`Run.beta`)."""
    run_dir = Path(cfg.train.out_dir)
    policy, ref, tokenizer = load_policy_and_reference(cfg, model_dir, device)
    sampler = make_sampler(cfg.rollout.engine, tokenizer.eos_token_id, tokenizer.pad_token_id, **sampler_options(cfg))
    optimizer, scheduler = make_optimizer(cfg, policy)
    k = cfg.rollout.staleness
    start, beta, kept = resume_or_create(run_dir, dist, resume, policy, ref, optimizer, scheduler, k)
    # the training forward goes through the prepared (DDP) log-prob module; rollout, reference and evaluation
    # use the plain model
    logprob_fn = make_logprob_fn(
        cfg.rollout.temperature, fast_forward=cfg.model.fast_forward, packing=cfg.train.packing
    )
    analytic_fn = None
    if getattr(kl_head(cfg), "style", None) == "analytic":  # it reads both models' next-token distributions
        analytic_fn = functools.partial(
            logprobs_and_next_kl, ref=ref, temperature=cfg.rollout.temperature, fast_forward=cfg.model.fast_forward
        )
    train_model, optimizer = dist.prepare(PolicyLogprobs(policy, logprob_fn, analytic_fn), optimizer)
    if dist.is_main:
        write_run_files(cfg, run_dir, model_dir, dist.world)
    return Run(
        cfg=cfg,
        beta=cfg.kl.beta if beta is None else beta,  # a resumed adaptive β goes on from its checkpoint's value
        dist=dist,
        run_dir=run_dir,
        policy=policy,
        ref=ref,
        tokenizer=tokenizer,
        chat=uses_chat(cfg.data.prompt_format, tokenizer),
        sampler=sampler,
        logprob_fn=logprob_fn,
        train_model=train_model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_set=data[0],
        eval_set=data[1],
        specs=specs,
        device=device,
        record=RunRecord(cfg, run_dir, active=dist.is_main),
        start=start,
        hooks=hooks,
        stale=StaleSnapshots(k, kept),
    )
