"""The RL loop, top to bottom. Each step (:func:`train_step`; docs/math.md for the objective, docs/metrics.md for
the record):

  1. draw ``prompts_per_step`` prompts, a function of (seed, step), so a resumed run draws the same ones;
  2. sample G responses each with the behaviour policy (the prompt prefilled once per group): the current policy,
     or with ``rollout.staleness`` k the policy of k updates back (:mod:`klgrad.trainer.staleness`);
  3. score them with the configured reward functions (failures isolated and counted);
  4. reference log-probs (no grad);
  5. advantages from the whole batch: decoupled A = shape(R), or combined A = shape(R − β·C) recomputed from the
     current policy at every epoch;
  6. update: ``ppo_epochs`` × ``mini_batches`` AdamW steps (:mod:`klgrad.trainer.update`);
  7. record the step's metrics (metrics.jsonl, TensorBoard, W&B); then (:func:`end_of_step`) adapt β, reset the
     reference when due, evaluate every ``eval_every`` steps, checkpoint atomically every ``save_every``.
The optional passes are stages chosen once, at setup (:func:`choose_stages`, :mod:`klgrad.trainer.stages`): the
behaviour log-probs (the trainer's own forward of the behaviour policy, when the update is off-policy: ppo_epochs
> 1, mini_batches > 1 or k > 0, or when the sampler's log-probs are corrected or measured: ``rollout.sampler_dtype``,
``rollout.mismatch_correction``), the stepwise KL, the mismatch weights, adaptive β, the reference reset and
``train.stop_when``. Deviations from the paper: none in the default config (paper: one on-policy update per batch).

Randomness: prompt i of step s is answered with uniforms from its own generator seeded by (seed, s, i), and
mini-batch k of an epoch holds the groups k, k+M, k+2M, ... of the step. Neither depends on how the batch is
split, so ``accelerate launch`` with W processes (each owning P/W whole groups, :mod:`klgrad.distributed`)
trains on the same global batches as one process: advantages and loss normalisers come from the whole batch,
the loss is scaled by W against DDP's gradient average, and only rank 0 writes (docs/distributed.md). The step's
batch crosses ranks in one place, :func:`gather_batch` (rewards, masks, log-probs, every rank's rows); besides it
the sampler agrees on the response width, the update reduces each optimizer step's statistics and gradient norm
(and gathers the combined form's current log-probs per epoch), and rank 0's stop and lock decisions are shared.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from klgrad.choices import ResolvedHead
from klgrad.config import Config
from klgrad.data.example import Example, examples_to_columns
from klgrad.distributed import Dist, check_config
from klgrad.kl import adaptive_beta
from klgrad.models.sources import reference_path
from klgrad.objective import ObjectiveSpec
from klgrad.rewards import RewardResult, compute_rewards, merge_rewards
from klgrad.rollout.batch import Rollout
from klgrad.rollout.encoding import decode_responses, encode_prompts
from klgrad.rollout.mismatch import mismatch_weights
from klgrad.rollout.samplers import KlgradSampler
from klgrad.runlock import RunLockedError, run_lock
from klgrad.stopping import parse_stop_rule
from klgrad.threads import CpuShare, adapt_threads, training_threads
from klgrad.trainer.checkpoints import prune_checkpoints, save_checkpoint
from klgrad.trainer.draws import draw_prompts, pad_responses, rollout_uniforms, step_generator
from klgrad.trainer.evaluation import evaluate
from klgrad.trainer.faults import Hooks
from klgrad.trainer.record import (
    StepBatch,
    StepClock,
    finish_run,
    finite_or_none,
    read_jsonl,
    step_record,
    summarize,
)
from klgrad.trainer.record import require_wandb as _require_wandb
from klgrad.trainer.setup import (
    Run,
    check_resume,
    kl_head,
    load_data,
    resolve_device,
    reward_specs,
    setup_run,
)
from klgrad.trainer.stages import NEVER, Stages, StopWhen, current_policy, skip, stop_history
from klgrad.trainer.staleness import behaviour_weights
from klgrad.trainer.update import Advantages, Batch, UpdateStats, epoch_advantages, update


def train(
    cfg: Config,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    hooks: Hooks | None = None,
) -> dict:
    """Run (or resume) RL training as configured; returns the summary dict (also written to summary.json).

    ``cfg`` is as :func:`~klgrad.config.load_config` made it: a framework preset id is already its KL term, with the
    preset's ``kl.level``, ``kl.form`` and ``kl.aggregation`` (config.yaml records them); a line on stderr says
    what the preset set and overrode (the term's note).

    A resume refuses a config that differs from the run's recorded one outside
    :data:`~klgrad.trainer.setup.RESUMABLE` (:func:`~klgrad.trainer.setup.check_resume`), before anything is
    loaded or written. ``hooks``: the fault-injection seam (:mod:`klgrad.trainer.faults`; default: from the
    ``KLGRAD_KILL_AT`` / ``KLGRAD_NAN_AT`` variables, no-ops when unset).

    ``stop_after`` ends the process-level run after that many steps of this call (tests use it to simulate an
    interruption; the run directory is then resumable).

    Under ``accelerate launch`` every process runs this function: each samples, scores and differentiates its
    share of the global batch; rank 0 alone evaluates and writes (metrics, TensorBoard, W&B, config, run.json,
    checkpoints, curves, summary, progress bar). Every rank returns the summary.

    One writer per run directory: after validating the configuration (which touches nothing) and before
    anything in ``train.out_dir`` is read or written, rank 0 takes the directory's lock (:mod:`klgrad.runlock`)
    and holds it until every rank is done; if another process holds it, every rank raises
    :class:`~klgrad.runlock.RunLockedError` and nothing in the directory is touched.
    """
    dist = Dist.from_env(cfg.model.device)  # the accelerator's placement: the same rule as resolve_device
    if isinstance(cfg.kl.head, ResolvedHead) and cfg.kl.head.note and dist.is_main:
        print(cfg.kl.head.note, file=sys.stderr, flush=True)
    check_config(cfg, dist.world)
    if resume:
        check_resume(cfg, Path(cfg.train.out_dir))
    data = load_data(cfg)  # fails before anything is written
    if cfg.train.wandb:
        _require_wandb()
    specs = reward_specs(cfg)
    kl_head(cfg)  # a user's module:name head is imported here, before anything is written
    model_dir = reference_path(cfg)
    device = resolve_device(cfg.model.device, dist.world)
    with hold_run_dir(Path(cfg.train.out_dir), dist), training_threads(cfg.train.threads) as cpu:
        hooks = Hooks.from_env(os.environ) if hooks is None else hooks
        run = setup_run(cfg, dist, data, specs, model_dir, device, resume, hooks)
        summary = run_steps(run, progress, stop_after, cpu, choose_stages(run))
        dist.barrier()  # every rank has read what it returns before rank 0 lets another writer in
    return summary


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, dist: Dist) -> Iterator[None]:
    """Rank 0 holds ``run_dir``'s lock for the block; no rank enters it unless rank 0 got the lock.

    Rank 0's outcome (None, or the exception it got: :class:`RunLockedError` or an ``OSError``) goes to every
    rank before any of them goes on, so a refused launch fails on every rank at once instead of leaving the
    other ranks waiting in a collective. In one process the exchange is the identity.
    """
    with contextlib.ExitStack() as held:
        outcome: BaseException | None = None
        if dist.is_main:
            try:
                held.enter_context(run_lock(run_dir))
            except (RunLockedError, OSError) as e:
                outcome = e
        shared = dist.gather_objects(outcome)[0]  # rank 0's outcome, on every rank
        if outcome is not None:
            raise outcome
        if shared is not None:
            raise shared
        yield


def choose_stages(run: Run) -> Stages:
    """The run's optional passes (:class:`~klgrad.trainer.stages.Stages`), each chosen here once from the config;
    a pass the config leaves out is a no-op."""
    cfg = run.cfg
    mismatch = cfg.rollout.mismatch_correction != "none" or cfg.rollout.sampler_dtype is not None
    rule = parse_stop_rule(cfg.train.stop_when) if cfg.train.stop_when else None
    history = stop_history(read_jsonl(run.record.metrics_path), rule) if rule and run.dist.is_main else []
    return Stages(
        behaviour_policy=(lambda: behaviour_weights(run.policy, run.stale)) if run.stale.k else current_policy,
        behaviour_logprobs=behaviour_logprobs if run.off_policy or mismatch else skip,
        stepwise_kl=batch_stepwise_kl if cfg.train.log_stepwise_kl else skip,
        mismatch_weights=correct_mismatch if cfg.rollout.mismatch_correction != "none" else skip,
        adapt_beta=adapt_beta if cfg.kl.target_kl is not None else skip,
        reset_reference=reset_reference if cfg.kl.reset_ref_every else skip,
        stop=NEVER if rule is None else StopWhen(rule, run.dist, history),
        keeps_old_logp=run.off_policy,
        keeps_trainer_logp=mismatch,
    )


def run_steps(
    run: Run, progress: bool, stop_after: int | None, cpu: CpuShare | None = None, stages: Stages | None = None
) -> dict:
    """Steps ``run.start + 1 .. train.steps`` (or ``stop_after`` of them), then the summary and curves. With
    ``cpu`` (``train.threads: auto``) the thread count is re-decided before every step and recorded
    (``cpu/threads``). ``stages``: the run's optional passes (default :func:`choose_stages`)."""
    cfg, dist = run.cfg, run.dist
    stages = choose_stages(run) if stages is None else stages
    has_reference_eval = dist.is_main and any(r["step"] == 0 for r in read_jsonl(run.record.metrics_path))
    if dist.is_main and run.start == 0 and not has_reference_eval:  # the reference's own evaluation, step 0
        run.record.write({"step": 0, **evaluate_policy(run)})
    bar = tqdm(
        range(run.start, cfg.train.steps),
        initial=run.start,
        total=cfg.train.steps,
        disable=not (progress and dist.is_main),
        desc="klgrad train",
        dynamic_ncols=True,
    )
    steps_done = consecutive_skips = 0
    for step in bar:
        threads = adapt_threads(cpu)
        record, stats = train_step(run, step, stages)
        record["cpu/threads"] = threads
        stopped = end_of_step(run, step + 1, record, stages)
        bar.set_postfix(
            reward=f"{record['reward/mean']:.3f}",
            kl=f"{record['kl/k1']:.3f}",
            acc=f"{record.get('eval/greedy_accuracy', float('nan')):.2f}",
        )
        consecutive_skips = consecutive_skips + 1 if stats.skipped_updates else 0
        stop_if_not_finite(run, step + 1, stats, consecutive_skips)
        steps_done += 1
        if stopped or (stop_after is not None and steps_done >= stop_after):
            break
    bar.close()
    run.record.close()
    summary = finish_run(cfg, run.run_dir, beta=run.beta) if dist.is_main else None
    dist.barrier()  # the other ranks return rank 0's summary
    return summary if dist.is_main else summarize(read_jsonl(run.record.metrics_path))  # rank 0's records


def train_step(run: Run, step: int, stages: Stages) -> tuple[dict, UpdateStats]:
    """One step of the algorithm, each line a stage; returns its record (before evaluation) and the update's
    statistics. ``step`` counts the steps done before it (its record is step + 1)."""
    clock = StepClock()
    examples, gen = draw(run, step)  # 1. this step's prompts, and the RNG of engines that need one
    with stages.behaviour_policy():  # π_{t−k} with rollout.staleness k, else the current policy
        rollout, prompt_len, mine = sample_responses(run, step, examples, gen)  # 2. this rank's share
        behaviour_logp = stages.behaviour_logprobs(run, rollout, prompt_len)  # (n, T) or None
        stepwise = stages.stepwise_kl(run, rollout, prompt_len)  # (n,) or None
    clock.mark("rollout")  # with the stepwise KL's two passes when it is logged
    rewards, scores = score_responses(run, mine, rollout)  # 3. (n,) and this rank's reward result
    clock.mark("reward")
    batch = with_reference_logprobs(run, rollout, prompt_len, rewards, behaviour_logp, stages)  # 4.
    clock.mark("ref")
    whole = gather_batch(run, step, rollout, batch, scores, stepwise)  # every rank's rows, N of them
    advantages = batch_advantages(run, batch, whole)  # 5.
    stats = update_policy(run, step, batch, advantages)  # 6.
    clock.mark("update")
    lr = run.scheduler.get_last_lr()[0]
    return step_record(step + 1, run.cfg, whole, stats, lr=lr, clock=clock, beta=run.beta), stats  # 7.


def draw(run: Run, step: int) -> tuple[list[Example], torch.Generator]:
    """The step's prompts, a function of (seed, step), and the step's generator (drawn from after them)."""
    gen = step_generator(run.cfg.train.seed, step)
    return [run.train_set[i] for i in draw_prompts(gen, len(run.train_set), run.cfg.rollout.prompts_per_step)], gen


def batch_advantages(run: Run, batch: Batch, whole: StepBatch) -> Advantages:
    """Each epoch's advantages of this rank's rows, from the whole batch, at the β in force
    (:func:`~klgrad.trainer.update.epoch_advantages`)."""
    spec = ObjectiveSpec(run.kl, run.cfg.algo)
    gathered = (whole.rewards, whole.mask, whole.ref_logp)  # (N,), (N, T), (N, T)
    return epoch_advantages(batch, *gathered, run.cfg, spec, run.logprob_fn, run.policy, run.dist)


def update_policy(run: Run, step: int, batch: Batch, advantages: Advantages) -> UpdateStats:
    """The update, then the learning-rate schedule's steps and the sampler's copy of the weights."""
    stats = update(
        run.policy,
        run.optimizer,
        batch,
        run.cfg,
        run.logprob_fn,
        record_step=step + 1,
        dist=run.dist,
        train_model=run.train_model,
        hooks=run.hooks,
        beta=run.beta,
        advantages=advantages,
    )
    for _ in range(run.updates_per_step):
        run.scheduler.step()
    run.sampler.sync_weights(run.policy)  # an engine with its own copy of the weights (vLLM) reloads them
    return stats


def gather_batch(
    run: Run, step: int, rollout: Rollout, batch: Batch, scores: RewardResult, stepwise: Tensor | None
) -> StepBatch:
    """The whole step's batch, every rank's rows in prompt order: the one place the step's batch crosses ranks (in
    one process every gather is the identity). Raises when the step's reward failures exceed their budget
    (:func:`refuse_failed_rewards`)."""
    dist = run.dist
    scored = merge_rewards(dist.gather_objects(scores))  # every rank's rows, in prompt order
    refuse_failed_rewards(run, step, scored)
    gather = lambda x: None if x is None else dist.gather(x)  # noqa: E731 (an optional stage's output)
    return StepBatch(
        rewards=torch.tensor(scored.total, dtype=torch.float32, device=run.device),  # (N,)
        scored=scored,
        mask=dist.gather(rollout.response_mask),  # (N, T)
        sampler_logp=dist.gather(rollout.logp),  # (N, T)
        ref_logp=dist.gather(batch.ref_logp),  # (N, T)
        truncated=dist.gather(rollout.truncated),  # (N,)
        mismatch_weights=gather(batch.mismatch_weights),  # (N, T) or None
        trainer_logp=gather(batch.trainer_logp),  # (N, T) or None
        stepwise_kl=gather(stepwise),  # (N,) or None
    )


def sample_responses(run: Run, step: int, examples: list[Example], gen: torch.Generator):
    """G responses to each of this rank's prompts, groups contiguous; returns the rollout, the prompt width L
    (where responses start) and this rank's examples.

    All P prompts are encoded, so the left padding is the single-process one; this rank answers its shard with
    its prompts' own uniforms, and its responses are padded to the width of the whole step's batch.
    """
    cfg, dist = run.cfg, run.dist
    prompt_ids, prompt_mask = (
        x.to(run.device) for x in encode_prompts(run.tokenizer, [e.prompt for e in examples], chat=run.chat)
    )
    shard = dist.shard(cfg.rollout.prompts_per_step)  # this rank's prompts (all of them in one process)
    g = cfg.rollout.group_size
    if cfg.rollout.engine == "klgrad":
        randomness = {"uniforms": rollout_uniforms(cfg.train.seed, step, shard, g, cfg.rollout.max_new_tokens)}
    else:  # engines with their own RNG, seeded from ours (single process only)
        randomness = {"generator": gen}
    run.policy.eval()
    rollout = run.sampler.generate(
        run.policy,
        prompt_ids[shard],
        prompt_mask[shard],
        group_size=g,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        **randomness,
    )
    run.policy.train()
    rollout = pad_responses(rollout, dist.max_int(rollout.response_ids.shape[1]), run.tokenizer.pad_token_id)
    run.hooks.at("rollout", step + 1)
    return rollout, prompt_ids.shape[1], examples[shard]


def batch_stepwise_kl(run: Run, rollout: Rollout, prompt_len: int) -> Tensor:
    """(n,) per response, S(y) = Σ_t KL(π(·|x, y_{<t}) ‖ π_ref(·|x, y_{<t})) at the sampling temperature, π the
    policy that drew the rollout (call it with the behaviour weights in place): the batch's sequence KL with each
    token's log-ratio replaced by its exact expectation given the prefix (:func:`klgrad.exact.kl.stepwise_kl`;
    unbiased for KL(π‖π_ref) like ``kl/k1``, whose per-sequence variance it removes most of on sampled LM
    responses). Two no-grad forward passes over the batch with the full vocabulary."""
    from klgrad.exact.kl import stepwise_kl

    run.policy.eval()  # as it sampled
    try:
        kl = stepwise_kl(
            run.policy,
            run.ref,
            rollout.input_ids,
            rollout.attention_mask,
            prompt_len,
            rollout.response_mask,
            run.cfg.rollout.temperature,
        )
    finally:
        run.policy.train()
    return kl.to(device=run.device, dtype=torch.float32)


def refuse_failed_rewards(run: Run, step: int, scored: RewardResult) -> None:
    """Raise when reward-function failures exceed ``reward.max_failure_fraction`` of the step's samples."""
    failed, budget = sum(scored.failures.values()), run.cfg.reward.max_failure_fraction
    if budget is not None and failed > budget * len(scored.total):
        raise RuntimeError(
            f"step {step + 1}: {failed} reward-function failures out of {len(scored.total)} samples exceed "
            f"reward.max_failure_fraction = {budget}; errors: {dict(scored.errors)}"
        )


def score_responses(run: Run, examples: list[Example], rollout: Rollout) -> tuple[Tensor, RewardResult]:
    """(n,) rewards of this rank's rows and their reward result (per-function rewards, failures)."""
    cfg = run.cfg
    repeated = [e for e in examples for _ in range(cfg.rollout.group_size)]
    mine = compute_rewards(
        run.specs,
        [e.prompt for e in repeated],
        decode_responses(run.tokenizer, rollout),
        examples_to_columns(repeated),
        failure_value=cfg.reward.failure_value,
        timeout_s=cfg.reward.timeout_s,
    )
    return torch.tensor(mine.total, dtype=torch.float32, device=run.device), mine  # (n,)


@torch.no_grad()
def behaviour_logprobs(run: Run, rollout: Rollout, prompt_len: int) -> Tensor:
    """(n, T) log-probs of the sampled tokens under the policy that drew them, from the trainer's own forward (call
    it with the behaviour weights in place): the stage of an off-policy update or a corrected or measured sampler
    mismatch."""
    logp, _ = run.logprob_fn(run.policy, rollout.input_ids, rollout.attention_mask, prompt_len, False)
    return logp


@torch.no_grad()
def with_reference_logprobs(
    run: Run, rollout: Rollout, prompt_len: int, rewards: Tensor, behaviour_logp: Tensor | None, stages: Stages
) -> Batch:
    """The update's :class:`Batch`: reference log-probs, and the behaviour log-probs (:func:`behaviour_logprobs`)
    as ``old_logp`` when the update is off-policy and as the trainer's side of the mismatch (its weights, when the
    stage corrects it, and the record's measure)."""
    ref_logp, _ = run.logprob_fn(run.ref, rollout.input_ids, rollout.attention_mask, prompt_len, False)
    return Batch(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        response_start=prompt_len,
        mask=rollout.response_mask,
        rewards=rewards,
        ref_logp=ref_logp,
        old_logp=behaviour_logp if stages.keeps_old_logp else None,
        mismatch_weights=stages.mismatch_weights(run, rollout, behaviour_logp),
        trainer_logp=behaviour_logp if stages.keeps_trainer_logp else None,
    )


def correct_mismatch(run: Run, rollout: Rollout, trainer_logp: Tensor) -> Tensor:
    """(n, T) truncated or masked IS weights for a sampler (vLLM, a ``rollout.sampler_dtype`` copy) whose log-probs
    differ from the trainer's (``rollout.mismatch_correction``)."""
    r = run.cfg.rollout
    return mismatch_weights(trainer_logp, rollout.logp, rollout.response_mask, r.mismatch_correction, r.mismatch_cap)


def evaluate_policy(run: Run) -> dict:
    """Held-out evaluation of the current policy (rank 0), in eval mode."""
    run.policy.eval()
    cfg = run.cfg  # J_β at the configured β, also under an adaptive β: one objective for every evaluation
    # the trained policy in its own arithmetic, not a rollout.sampler_dtype copy of it
    sampler = run.sampler.in_model_dtype() if isinstance(run.sampler, KlgradSampler) else run.sampler
    out = evaluate(run.policy, run.ref, run.tokenizer, run.eval_set, cfg, run.specs, sampler, seed=cfg.train.seed)
    run.policy.train()
    return out


def end_of_step(run: Run, step: int, record: dict, stages: Stages) -> bool:
    """After the update of record step ``step``: adapt β, reset the reference when due, evaluate when due,
    write the record, checkpoint when due. Returns True when ``train.stop_when`` (:attr:`Stages.stop`) stops the
    run here: that step is then evaluated and saved like the last."""
    cfg = run.cfg
    stages.adapt_beta(run, record)
    stages.reset_reference(run, step)
    stop = stages.stop.before_evaluation(finite_or_none(record), step)  # a batch metric: a stop evaluates
    last = step == cfg.train.steps or stop
    if run.dist.is_main and ((cfg.train.eval_every and step % cfg.train.eval_every == 0) or last):
        record.update(evaluate_policy(run))
    record.update(finite_or_none(record))
    stop = stages.stop.after_evaluation(record, step, stop)  # an eval/ metric; rank 0's decision on every rank
    run.record.write(record)
    run.hooks.at("log", step)
    if step % cfg.train.save_every == 0 or last or stop:
        checkpoint(run, step)
    return stop


def adapt_beta(run: Run, record: dict) -> None:
    """``kl.target_kl``: the β in force moved by the step's KL (:func:`klgrad.kl.adaptive_beta`); the config keeps
    the configured β."""
    kl = run.cfg.kl
    run.beta = adaptive_beta(run.beta, record["kl/k1"], kl.target_kl, kl.adapt_rate)


def reset_reference(run: Run, step: int) -> None:
    """``kl.reset_ref_every`` N (ProRL): after every N-th step, π_ref := π (the policy's weights copied into the
    reference)."""
    if step % run.cfg.kl.reset_ref_every == 0:
        run.ref.load_state_dict(run.policy.state_dict())


def checkpoint(run: Run, step: int) -> Path:
    """Rank 0 writes (the weights and AdamW state are the same on every rank); every rank returns the path."""
    if run.dist.is_main:
        cfg = run.cfg
        path = save_checkpoint(
            run.run_dir,
            step,
            run.policy,
            run.ref,
            run.optimizer,
            run.scheduler,
            run.beta,  # the β in force (an adaptive β resumes from it)
            cfg,
            save_ref=cfg.kl.reset_ref_every is not None,
            hooks=run.hooks,
            stale=run.stale.to_save(),
        )
        if run.cfg.train.keep_checkpoints:  # the new one is complete: older ones may go
            prune_checkpoints(run.run_dir, run.cfg.train.keep_checkpoints)
    else:
        path = run.run_dir / "checkpoints" / f"step_{step:06d}"
    run.dist.barrier()  # nobody moves on (or exits) while rank 0 writes
    return path


def stop_if_not_finite(run: Run, step: int, stats: UpdateStats, consecutive_skips: int) -> None:
    """Report skipped updates; after ``train.max_skipped_steps`` steps in a row, save the (untouched, last good)
    weights and stop with a message saying how to resume."""
    if stats.skipped_updates and run.dist.is_main:
        tqdm.write(
            f"klgrad train: step {step}: non-finite loss or gradient, {stats.skipped_updates} "
            "update(s) skipped (weights and optimizer state untouched)",
            file=sys.stderr,
        )
    if consecutive_skips >= run.cfg.train.max_skipped_steps:
        ckpt = checkpoint(run, step)
        raise RuntimeError(
            f"non-finite loss or gradient in {consecutive_skips} consecutive steps (up to step {step}); "
            f"stopped. The last good weights are in {ckpt}; continue with --resume {run.run_dir}"
        )
