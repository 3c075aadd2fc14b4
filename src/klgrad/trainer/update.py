"""The update: ``ppo_epochs`` × ``mini_batches`` optimizer steps on one step's rollout.

A step's rows are split into mini-batches of whole groups (mini-batch k holds groups k, k+M, k+2M, ...), each
accumulated over micro-batches whose normalisers are the global mini-batch's (counted before splitting), so the
micro-batch size never changes the gradient. Advantages come from the whole step's batch. Under ``accelerate
launch`` the collectives are :class:`~klgrad.distributed.Dist`'s; the math (:mod:`klgrad.objective`,
:mod:`klgrad.kl`, :mod:`klgrad.advantages`) never sees them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from klgrad.config import AlgoConfig, Config, KLConfig
from klgrad.distributed import Dist
from klgrad.logprobs import sequence_logprobs
from klgrad.objective import (
    ObjectiveSpec,
    combined_advantages,
    decoupled_advantages,
    objective_diagnostics,
    policy_objective,
)
from klgrad.trainer.faults import NO_HOOKS, Hooks

LogprobFn = Callable[[torch.nn.Module, Tensor, Tensor, int, bool], tuple[Tensor, Tensor | None]]
"""``fn(model, input_ids, attention_mask, response_start, with_entropy) -> (logp, entropy)``, (n, T) each."""

SINGLE = Dist()
"""One process: every collective is the identity."""


@dataclass
class Batch:
    """This process's rows of one step's rollout, everything the update needs; (n, T) response-aligned tensors.

    In a single process these are all the step's rows; under ``accelerate launch`` the rank's contiguous
    whole groups, with T the width of the whole step's batch. L is the (left-padded) prompt width.
    """

    input_ids: Tensor
    """(n, L + T) prompt and response token ids."""
    attention_mask: Tensor
    """(n, L + T) 1 at real tokens."""
    response_start: int
    """L: the column where responses start."""
    mask: Tensor
    """(n, T) bool, True at response tokens (up to and including EOS)."""
    rewards: Tensor
    """(n,) total reward of each response."""
    ref_logp: Tensor
    """(n, T) reference log-probs (no grad)."""
    old_logp: Tensor | None
    """(n, T) behaviour log-probs of the rollout policy from the trainer's forward; None when on-policy."""
    mismatch_weights: Tensor | None = None
    """(n, T) IS weights for a sampler whose log-probs differ from the trainer's (vLLM, sampler_dtype), or None."""
    trainer_logp: Tensor | None = None
    """(n, T) the trainer's log-probs of the rollout before the update, kept to measure the sampler's mismatch
    (``rollout.sampler_dtype`` or a correction; the record's ``mismatch/*``), or None. The update ignores it."""


@dataclass
class UpdateStats:
    """Means over the step's optimizer updates of statistics of each update's global mini-batch, and how many
    updates a non-finite value skipped. Every statistic is of the whole mini-batch, whatever its split into
    micro-batches and processes: token fractions and means are weighted by tokens, the maximum is a maximum."""

    policy_loss: float = 0.0
    kl_loss: float = 0.0
    entropy: float = 0.0
    """Mean per-token entropy of the policy over the mini-batch's response tokens."""
    clip_frac: float = 0.0
    """Fraction of response tokens whose reward-head gradient the PPO clip removed."""
    kl_clip_frac: float = 0.0
    """Fraction of response tokens whose KL-head gradient the KL clip removed (decoupled, off-policy)."""
    ratio_mean: float = 0.0
    """Mean importance ratio over response tokens."""
    ratio_max: float = 0.0
    """Largest importance ratio of a response token."""
    grad_norm: float = 0.0
    """Global gradient norm before clipping."""
    skipped_updates: int = 0


SHARED_STATS = ("policy_loss", "kl_loss", "entropy", "clip_frac", "kl_clip_frac", "ratio_mean")
"""The :class:`UpdateStats` fields each rank holds a share of (summed over ranks; the grad norm is global, the
ratio maximum a maximum over ranks)."""


class PolicyLogprobs(torch.nn.Module):
    """The policy's response log-probs (and entropies) as a module: what the training forward differentiates.

    Under accelerate this module is what DDP wraps, so the ranks run the very computation of one process
    (``logprob_fn`` on the plain model, with its fast paths: shared-prompt forward, ``logits_to_keep``) and
    DDP's hooks on the policy's parameters all-reduce their gradients.
    """

    def __init__(self, policy: torch.nn.Module, logprob_fn: LogprobFn, analytic_fn: Callable | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.logprob_fn = logprob_fn
        self.analytic_fn = analytic_fn
        """``analytic_fn(policy, input_ids, attention_mask, response_start) -> (logp, entropy, KL_t)`` for a head that
        reads next-token distributions (:func:`klgrad.logprobs.logprobs_and_next_kl`); None: (logp, entropy)."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor, response_start: int, with_entropy: bool):
        if self.analytic_fn is not None:
            return self.analytic_fn(self.policy, input_ids, attention_mask, response_start)
        return self.logprob_fn(self.policy, input_ids, attention_mask, response_start, with_entropy)


def make_logprob_fn(temperature: float, fast_forward: bool = True, packing: bool = True) -> LogprobFn:
    """The :data:`LogprobFn` at ``temperature``; ``fast_forward`` (``model.fast_forward``) lets Llama-family models
    forward each group's shared prompt once, ``packing`` (``train.packing``) computes real response positions
    only (:func:`klgrad.logprobs.sequence_logprobs`)."""

    def fn(model, input_ids, attention_mask, response_start, with_entropy):
        return sequence_logprobs(
            model,
            input_ids,
            attention_mask,
            response_start,
            temperature,
            with_entropy=with_entropy,
            fast_forward=fast_forward,
            packing=packing,
        )

    return fn


def mini_batch_rows(n: int, group_size: int, mini_batches: int) -> list[Tensor]:
    """Rows of each mini-batch among ``n`` rows of whole groups: mini-batch k holds groups k, k+M, k+2M, ...

    The rule does not depend on how the step's batch is split over processes: a rank owning P/W contiguous
    groups (P/W divisible by M) contributes exactly its groups of mini-batch k, so the union over ranks is the
    single-process mini-batch.
    """
    groups = torch.arange(n).view(-1, group_size)  # (n / G, G)
    return [groups[k::mini_batches].reshape(-1) for k in range(mini_batches)]


def loss_spec(
    kl: KLConfig, algo: AlgoConfig, batch: Batch, policy: torch.nn.Module, logprob_fn: LogprobFn, dist: Dist = SINGLE
) -> ObjectiveSpec:
    """The loss the records describe, ``ObjectiveSpec(kl, algo)``; for a term head that takes a batch baseline
    (:attr:`~klgrad.objective.KLTermHead.baseline_sums`, a framework preset's), with the baseline: its sums over the
    step's whole batch (every rank), from the behaviour log-probs ``batch.old_logp``, or on-policy a no-grad forward
    of ``policy``."""
    spec = ObjectiveSpec(kl, algo)
    sums = spec.term_head.baseline_sums if spec.term_head is not None else None
    if sums is None:
        return spec
    behaviour = batch.old_logp
    if behaviour is None:
        with torch.no_grad():
            behaviour, _ = logprob_fn(policy, batch.input_ids, batch.attention_mask, batch.response_start, False)
    total, tokens = dist.sum(list(sums(behaviour, batch.ref_logp, batch.mask)))
    return dataclasses.replace(spec, kl_baseline=total / max(tokens, 1.0))


def step_advantages(
    rewards: Tensor,
    mask: Tensor,
    ref_logp: Tensor,
    cur_logp: Tensor | None,
    cfg: Config,
    spec: ObjectiveSpec,
    dist: Dist,
) -> Tensor:
    """(n, T) advantages of this rank's rows, from the whole step's batch: ``rewards`` (N,), ``mask`` and ``ref_logp``
    (N, T) hold every rank's rows, ``cur_logp`` (n, T) this rank's (the combined form's; gathered here). The KL term
    and the shaping are ``spec``'s records; ``cfg`` gives only the group size."""
    kl, pg, g = spec.kl, spec.pg, cfg.rollout.group_size
    if kl.form == "combined":
        adv = combined_advantages(
            rewards,
            spec.head,
            dist.gather(cur_logp),
            ref_logp,
            mask,
            beta=kl.beta,
            level=kl.level,
            group_size=g,
            method=pg.shaping,
            std_min=pg.std_min,
            std_max=pg.std_max,
        )  # (N, T) recomputed every epoch from the current policy
    else:
        adv = decoupled_advantages(rewards, mask, g, pg.shaping, pg.std_min, pg.std_max)  # (N, T)
    return dist.local_rows(adv)  # (n, T)


Advantages = Callable[[], Tensor]
"""``advantages()``: this rank's (n, T) advantages for the next epoch (:func:`epoch_advantages`)."""


def epoch_advantages(
    batch: Batch,
    rewards: Tensor,
    mask: Tensor,
    ref_logp: Tensor,
    cfg: Config,
    spec: ObjectiveSpec,
    logprob_fn: LogprobFn,
    policy: torch.nn.Module,
    dist: Dist = SINGLE,
) -> Advantages:
    """Each epoch's advantages (:func:`step_advantages`; ``rewards``, ``mask``, ``ref_logp``: the whole batch's):
    decoupled A = shape(R), the same at every epoch, computed now; combined A = shape(R − β·C), whose coefficient
    reads the current policy: recomputed from a no-grad forward of ``policy`` at every call."""
    if spec.kl.form != "combined":
        adv = step_advantages(rewards, mask, ref_logp, None, cfg, spec, dist)  # (n, T)
        return lambda: adv

    def current() -> Tensor:
        with torch.no_grad():
            cur_logp, _ = logprob_fn(policy, batch.input_ids, batch.attention_mask, batch.response_start, False)
        return step_advantages(rewards, mask, ref_logp, cur_logp, cfg, spec, dist)

    return current


def _rows(x: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if x is None else x[rows]


def accumulate_micro_batch(
    train_model: torch.nn.Module,
    batch: Batch,
    rows: Tensor,
    adv: Tensor,
    spec: ObjectiveSpec,
    *,
    num_sequences: int,
    num_tokens: int,
    scale: float,
    nan: bool,
    totals: UpdateStats,
) -> tuple[bool, float]:
    """Forward and backward of micro-batch ``rows`` (m,) with the global normalisers; gradients accumulate in
    the parameters, the micro-batch's shares of the statistics in ``totals``. Returns whether its loss is
    finite and its largest importance ratio. ``scale``: the world size W (DDP averages gradients over ranks);
    ``nan``: make the loss NaN (:attr:`klgrad.trainer.faults.Hooks.nan`)."""
    logp, entropy, *next_kl = train_model(batch.input_ids[rows], batch.attention_mask[rows], batch.response_start, True)
    mask = batch.mask[rows]
    old_logp = _rows(batch.old_logp, rows)
    terms = policy_objective(
        logp,
        batch.ref_logp[rows],
        mask,
        adv[rows],
        spec,
        old_logp=old_logp,
        entropy=entropy,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        mismatch_weights=_rows(batch.mismatch_weights, rows),
        next_token_kl=next_kl[0] if next_kl else None,
    )
    loss = terms.loss * float("nan") if nan else terms.loss
    finite = bool(torch.isfinite(loss))
    (loss * scale).backward()
    totals.policy_loss += float(terms.policy_loss)
    totals.kl_loss += float(terms.kl_loss)
    totals.entropy += float(torch.where(mask, entropy.detach(), 0.0).sum()) / max(num_tokens, 1)
    diag = objective_diagnostics(logp, batch.ref_logp[rows], mask, adv[rows], spec, old_logp=old_logp)
    share = float(mask.sum()) / max(num_tokens, 1)  # the micro-batch's share of the mini-batch's tokens
    totals.clip_frac += diag["clip_frac"] * share
    totals.kl_clip_frac += diag["kl_clip_frac"] * share
    totals.ratio_mean += diag["ratio_mean"] * share
    return finite, diag["ratio_max"]


def update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: Config,
    logprob_fn: LogprobFn,
    record_step: int = 0,
    dist: Dist = SINGLE,
    train_model: torch.nn.Module | None = None,
    hooks: Hooks = NO_HOOKS,
    beta: float | None = None,
    advantages: Advantages | None = None,
) -> UpdateStats:
    """``ppo_epochs`` × ``mini_batches`` optimizer steps on one rollout batch; returns the mean statistics. The loss
    is the one ``cfg``'s records describe: ``ObjectiveSpec(cfg.kl, cfg.algo)`` at ``beta``, the β in force (the run's
    state; default ``cfg.kl.beta``), with a term head's batch baseline (:func:`loss_spec`).

    A non-finite loss or gradient norm (on any rank) skips that optimizer step: gradients are dropped, weights
    and AdamW state stay untouched, and ``skipped_updates`` counts it.

    ``policy`` is the plain model (no-grad passes); ``train_model`` the :class:`PolicyLogprobs` the loss is
    differentiated through (DDP-wrapped under accelerate; default: of ``policy``). Normalisers are the global
    mini-batch's, and the loss is scaled by the world size W because DDP averages gradients over ranks: the
    summed gradient equals the single-process one. Statistics are summed over ranks (grad norm: already global).
    ``hooks``: the fault-injection seam (:mod:`klgrad.trainer.faults`; default: none). ``advantages``: each epoch's
    (the loop's advantages stage); default :func:`epoch_advantages` of ``batch``, gathered here.
    """
    kl = cfg.kl if beta is None else dataclasses.replace(cfg.kl, beta=beta)  # the β in force: the record's field
    spec = loss_spec(kl, cfg.algo, batch, policy, logprob_fn, dist)  # the config's own records, as they are
    train_model = PolicyLogprobs(policy, logprob_fn) if train_model is None else train_model
    n = batch.mask.shape[0]
    mini_batches = mini_batch_rows(n, cfg.rollout.group_size, cfg.algo.mini_batches)
    n_seq = n * dist.world // cfg.algo.mini_batches  # sequences per global mini-batch
    tokens = [int(t) for t in dist.sum([float(batch.mask[rows].sum()) for rows in mini_batches])]  # per global one
    size = cfg.algo.micro_batch_size
    totals = UpdateStats()
    updates = 0
    inject_nan = hooks.nan(record_step)
    if advantages is None:
        gathered = dist.gather(batch.rewards), dist.gather(batch.mask), dist.gather(batch.ref_logp)
        advantages = epoch_advantages(batch, *gathered, cfg, spec, logprob_fn, policy, dist)
    for _epoch in range(cfg.algo.ppo_epochs):
        adv = advantages()  # (n, T); the combined form's from the current policy
        for rows, n_tok in zip(mini_batches, tokens, strict=True):
            optimizer.zero_grad(set_to_none=True)
            finite, ratio_max = True, -math.inf
            starts = range(0, rows.numel(), size)
            for start in starts:
                with dist.no_sync(train_model, sync=start == starts[-1]):  # DDP all-reduces after the last one
                    micro_finite, micro_ratio_max = accumulate_micro_batch(
                        train_model,
                        batch,
                        rows[start : start + size],
                        adv,
                        spec,
                        num_sequences=n_seq,
                        num_tokens=n_tok,
                        scale=dist.world,
                        nan=inject_nan,
                        totals=totals,
                    )
                finite, ratio_max = finite and micro_finite, max(ratio_max, micro_ratio_max)
            finite = dist.all_true(finite)
            totals.ratio_max += dist.max(ratio_max)
            grad_norm = dist.clip_grad_norm_(train_model, cfg.optim.grad_clip or float("inf"))
            totals.grad_norm += float(grad_norm)
            updates += 1
            if not (finite and math.isfinite(float(grad_norm))):
                optimizer.zero_grad(set_to_none=True)  # skip: weights and optimizer state untouched
                totals.skipped_updates += 1
                continue
            optimizer.step()
            if updates == 1:
                hooks.at("update", record_step)
    shared = dist.sum([getattr(totals, name) for name in SHARED_STATS])  # each rank holds its share
    totals = dataclasses.replace(totals, **dict(zip(SHARED_STATS, shared, strict=True)))
    means = {name: getattr(totals, name) / updates for name in (*SHARED_STATS, "ratio_max", "grad_norm")}
    return dataclasses.replace(totals, **means)
