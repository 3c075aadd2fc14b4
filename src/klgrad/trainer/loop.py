"""The RL loop, top to bottom. Each step (docs/math.md for the objective, docs/metrics.md for the record):

  1. draw ``prompts_per_step`` prompts, a function of (seed, step), so a resumed run draws the same ones;
  2. sample G responses each with the behaviour policy (the prompt prefilled once per group): the current policy,
     or with ``rollout.staleness`` k the policy of k updates back (:mod:`klgrad.trainer.staleness`); behaviour
     log-probs, from the trainer's own forward of that same policy, only when the update is off-policy
     (ppo_epochs > 1, mini_batches > 1 or k > 0) or the sampler's log-probs need a mismatch correction;
  3. score them with the configured reward functions (failures isolated and counted);
  4. reference log-probs (no grad); the behaviour log-probs of step 2 also serve a mismatch correction or
     measurement (``rollout.sampler_dtype``: a sampler in other arithmetic than the trainer's);
  5. update: ``ppo_epochs`` × ``mini_batches`` AdamW steps on advantages from the whole batch, decoupled
     A = shape(R), or combined A = shape(R − β·C) recomputed from the current policy at every epoch
     (:mod:`klgrad.trainer.update`);
  6. record the step's metrics (metrics.jsonl, TensorBoard, W&B), adapt β, reset the reference when due,
     evaluate every ``eval_every`` steps, checkpoint atomically every ``save_every``.
Deviations from the paper: none in the default config (paper: one on-policy update per batch).

Randomness: prompt i of step s is answered with uniforms from its own generator seeded by (seed, s, i), and
mini-batch k of an epoch holds the groups k, k+M, k+2M, ... of the step. Neither depends on how the batch is
split, so ``accelerate launch`` with W processes (each owning P/W whole groups, :mod:`klgrad.distributed`)
trains on the same global batches as one process: advantages and loss normalisers come from the whole batch,
the loss is scaled by W against DDP's gradient average, and only rank 0 writes (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from klgrad.rewards import RewardResult, compute_rewards, merge_rewards
from klgrad.rollout.batch import Rollout
from klgrad.rollout.encoding import decode_responses, encode_prompts
from klgrad.rollout.mismatch import mismatch_weights
from klgrad.rollout.samplers import KlgradSampler
from klgrad.runlock import RunLockedError, run_lock
from klgrad.stopping import StopRule, parse_stop_rule, stop_point
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
from klgrad.trainer.staleness import behaviour_weights
from klgrad.trainer.update import Batch, UpdateStats, update


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
        summary = run_steps(run, progress, stop_after, cpu)
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


def run_steps(run: Run, progress: bool, stop_after: int | None, cpu: CpuShare | None = None) -> dict:
    """Steps ``run.start + 1 .. train.steps`` (or ``stop_after`` of them), then the summary and curves. With
    ``cpu`` (``train.threads: auto``) the thread count is re-decided before every step and recorded
    (``cpu/threads``)."""
    cfg, dist = run.cfg, run.dist
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
    rule = parse_stop_rule(cfg.train.stop_when) if cfg.train.stop_when else None
    history = stop_history(read_jsonl(run.record.metrics_path), rule) if rule and dist.is_main else []
    for step in bar:
        threads = adapt_threads(cpu)
        record, stats = train_step(run, step)
        record["cpu/threads"] = threads
        stopped = end_of_step(run, step + 1, record, rule, history)
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
    summary = finish_run(cfg, run.run_dir) if dist.is_main else None
    dist.barrier()  # the other ranks return rank 0's summary
    return summary if dist.is_main else summarize(read_jsonl(run.record.metrics_path))  # rank 0's records


def train_step(run: Run, step: int) -> tuple[dict, UpdateStats]:
    """One step of the algorithm; returns its record (before evaluation) and the update's statistics."""
    cfg, dist = run.cfg, run.dist
    clock = StepClock()
    gen = step_generator(cfg.train.seed, step)  # the step's prompts, then the RNG of engines that need one
    examples = [run.train_set[i] for i in draw_prompts(gen, len(run.train_set), cfg.rollout.prompts_per_step)]
    with behaviour_weights(run.policy, run.stale):  # π_{t−k} with rollout.staleness k, else the current policy
        rollout, prompt_len, my_examples = sample_responses(run, step, examples, gen)
        behaviour_logp = behaviour_logprobs(run, rollout, prompt_len)
        stepwise = batch_stepwise_kl(run, rollout, prompt_len) if cfg.train.log_stepwise_kl else None
    clock.mark("rollout")  # with the stepwise KL's two passes when it is logged
    rewards, scored = score_responses(run, step, my_examples, rollout)
    clock.mark("reward")
    batch = with_reference_logprobs(run, rollout, prompt_len, rewards, behaviour_logp)
    clock.mark("ref")
    stats = update(
        run.policy,
        run.optimizer,
        batch,
        cfg,
        run.logprob_fn,
        record_step=step + 1,
        dist=dist,
        train_model=run.train_model,
        hooks=run.hooks,
    )
    for _ in range(run.updates_per_step):
        run.scheduler.step()
    run.sampler.sync_weights(run.policy)  # an engine with its own copy of the weights (vLLM) reloads them
    clock.mark("update")
    whole_batch = StepBatch(
        rewards=torch.tensor(scored.total, dtype=torch.float32, device=run.device),
        scored=scored,
        mask=dist.gather(rollout.response_mask),
        sampler_logp=dist.gather(rollout.logp),
        ref_logp=dist.gather(batch.ref_logp),
        truncated=dist.gather(rollout.truncated),
        mismatch_weights=None if batch.mismatch_weights is None else dist.gather(batch.mismatch_weights),
        trainer_logp=None if batch.trainer_logp is None else dist.gather(batch.trainer_logp),
        stepwise_kl=None if stepwise is None else dist.gather(stepwise),
    )
    lr = run.scheduler.get_last_lr()[0]
    return step_record(step + 1, cfg, whole_batch, stats, lr=lr, clock=clock), stats


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


def score_responses(run: Run, step: int, examples: list[Example], rollout: Rollout) -> tuple[Tensor, RewardResult]:
    """(n,) rewards of this rank's rows and every rank's reward result (prompt order); raises when reward-function
    failures exceed ``reward.max_failure_fraction`` of the step's samples."""
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
    rewards = torch.tensor(mine.total, dtype=torch.float32, device=run.device)  # (n,)
    scored = merge_rewards(run.dist.gather_objects(mine))  # every rank's rows, in prompt order
    failed, budget = sum(scored.failures.values()), cfg.reward.max_failure_fraction
    if budget is not None and failed > budget * len(scored.total):
        raise RuntimeError(
            f"step {step + 1}: {failed} reward-function failures out of {len(scored.total)} samples exceed "
            f"reward.max_failure_fraction = {budget}; errors: {dict(scored.errors)}"
        )
    return rewards, scored


@torch.no_grad()
def behaviour_logprobs(run: Run, rollout: Rollout, prompt_len: int) -> Tensor | None:
    """(n, T) log-probs of the sampled tokens under the policy that drew them, from the trainer's own forward (call
    it with the behaviour weights in place), when the update is off-policy or the sampler's log-probs need a
    mismatch correction; otherwise None."""
    if not (run.off_policy or measures_mismatch(run.cfg)):
        return None
    logp, _ = run.logprob_fn(run.policy, rollout.input_ids, rollout.attention_mask, prompt_len, False)
    return logp


@torch.no_grad()
def with_reference_logprobs(
    run: Run, rollout: Rollout, prompt_len: int, rewards: Tensor, behaviour_logp: Tensor | None
) -> Batch:
    """The update's :class:`Batch`: reference log-probs, and the behaviour log-probs (:func:`behaviour_logprobs`)
    as ``old_logp`` when the update is off-policy and as the trainer's side of the mismatch weights when the
    sampler's log-probs need a correction."""
    cfg = run.cfg
    ref_logp, _ = run.logprob_fn(run.ref, rollout.input_ids, rollout.attention_mask, prompt_len, False)
    weights = None
    if cfg.rollout.mismatch_correction != "none":  # truncated IS for a sampler (vLLM) whose log-probs differ
        weights = mismatch_weights(
            behaviour_logp,
            rollout.logp,
            rollout.response_mask,
            cfg.rollout.mismatch_correction,
            cfg.rollout.mismatch_cap,
        )  # (n, T)
    return Batch(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        response_start=prompt_len,
        mask=rollout.response_mask,
        rewards=rewards,
        ref_logp=ref_logp,
        old_logp=behaviour_logp if run.off_policy else None,
        mismatch_weights=weights,
        trainer_logp=behaviour_logp if measures_mismatch(cfg) else None,
    )


def measures_mismatch(cfg: Config) -> bool:
    """The trainer recomputes the rollout's log-probs to correct or measure the sampler's mismatch: with
    ``rollout.mismatch_correction`` or a ``rollout.sampler_dtype`` (a sampler in other arithmetic)."""
    return cfg.rollout.mismatch_correction != "none" or cfg.rollout.sampler_dtype is not None


def evaluate_policy(run: Run) -> dict:
    """Held-out evaluation of the current policy (rank 0), in eval mode."""
    run.policy.eval()
    cfg = run.configured  # J_β at the configured β, also under an adaptive β: one objective for every evaluation
    # the trained policy in its own arithmetic, not a rollout.sampler_dtype copy of it
    sampler = run.sampler.in_model_dtype() if isinstance(run.sampler, KlgradSampler) else run.sampler
    out = evaluate(run.policy, run.ref, run.tokenizer, run.eval_set, cfg, run.specs, sampler, seed=cfg.train.seed)
    run.policy.train()
    return out


def stop_history(records: list[dict], rule: StopRule | None) -> list[dict]:
    """The records a resumed run's ``train.stop_when`` continues from: step and metric of those logging it."""
    if rule is None:
        return []
    return [{"step": r["step"], rule.metric: r[rule.metric]} for r in records if rule.metric in r]


def stop_due(rule: StopRule | None, history: list[dict], record: dict, step: int) -> bool:
    """Append ``record``'s value of the rule's metric to ``history`` (when it logs it) and say whether the rule
    first holds at ``step`` (:func:`klgrad.stopping.stop_point`)."""
    if rule is None or rule.metric not in record:
        return False
    history.append({"step": step, rule.metric: record[rule.metric]})
    hit = stop_point(history, rule)
    return hit is not None and hit["step"] == step


def end_of_step(
    run: Run, step: int, record: dict, rule: StopRule | None = None, history: list[dict] | None = None
) -> bool:
    """After the update of record step ``step``: adapt β, reset the reference when due, evaluate when due,
    write the record, checkpoint when due. Returns True when ``train.stop_when`` (``rule``, its metric's
    logged values in ``history``) stops the run here: that step is then evaluated and saved like the last.
    A batch metric is checked before the evaluation (so a stop evaluates), an ``eval/`` one after it. Only rank 0
    holds the records, so its decision goes to every rank."""
    cfg = run.cfg
    history = [] if history is None else history
    if cfg.kl.target_kl is not None:  # the β in force: the run's kl record replaced, never a second β
        beta = adaptive_beta(cfg.kl.beta, record["kl/k1"], cfg.kl.target_kl, cfg.kl.adapt_rate)
        run.cfg = dataclasses.replace(cfg, kl=dataclasses.replace(cfg.kl, beta=beta))
    if cfg.kl.reset_ref_every and step % cfg.kl.reset_ref_every == 0:
        run.ref.load_state_dict(run.policy.state_dict())
    stop = False
    if run.dist.is_main and rule is not None and not rule.metric.startswith("eval/"):
        stop = stop_due(rule, history, finite_or_none(record), step)
    last = step == cfg.train.steps or stop
    if run.dist.is_main and ((cfg.train.eval_every and step % cfg.train.eval_every == 0) or last):
        record.update(evaluate_policy(run))
    record.update(finite_or_none(record))
    if run.dist.is_main and rule is not None and rule.metric.startswith("eval/"):
        stop = stop_due(rule, history, record, step)
    if rule is not None:
        stop = bool(run.dist.gather_objects(stop)[0])  # rank 0's decision, on every rank
    run.record.write(record)
    run.hooks.at("log", step)
    if step % cfg.train.save_every == 0 or last or stop:
        checkpoint(run, step)
    return stop


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
            cfg.kl.beta,  # the β in force (an adaptive β resumes from it)
            run.configured,
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
