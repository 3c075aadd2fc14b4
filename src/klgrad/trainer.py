"""The RL loop, top to bottom: rollout -> rewards -> reference log-probs -> advantages -> updates -> log.

Algorithm per step (SPEC §6-§10):
  1. draw ``prompts_per_step`` prompts (seeded by (seed, step), so a resumed run draws the same ones);
  2. sample G responses each with the current policy (KV-cache sampler; prompt prefilled once per group);
  3. rewards from the configured functions (failures isolated and counted);
  4. reference log-probs (no grad); behaviour log-probs only when the update is off-policy
     (ppo_epochs > 1 or mini_batches > 1), from the trainer's own forward pass;
  5. advantages: decoupled A = shape(R), or combined A = shape(R - β·C) recomputed from the current policy
     at every epoch (the KL coefficient must use the current detached log-probs);
  6. ``ppo_epochs`` × ``mini_batches`` AdamW steps, each accumulating micro-batches whose normalisers are the
     mini-batch's (computed before splitting, so micro-batch size never changes the result);
  7. log every SPEC §9 metric (JSONL, TensorBoard), evaluate every ``eval_every`` steps, checkpoint
     atomically.
Deviations from the paper: none in the default config (paper: one on-policy update per batch).
Record convention: ``step`` = optimizer updates done; the record with step 0 holds the reference's evaluation.

Randomness: prompt i of step s is answered with uniforms from its own generator seeded by (seed, s, i), and
mini-batch k of an epoch holds the groups k, k+M, k+2M, ... of the step. Neither depends on how the batch is
split, so ``accelerate launch`` with W processes (each owning P/W whole groups, klgrad.distributed) trains on
the same global batches as one process: advantages and loss normalisers come from the whole batch, the loss
is scaled by W against DDP's gradient average, and only rank 0 writes (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_model, save_model
from torch import Tensor
from tqdm.auto import tqdm

from klgrad.advantages import shape_rewards
from klgrad.config import Config, ConfigError, to_dict
from klgrad.data.example import Example, examples_to_columns
from klgrad.data.loaders import load_examples
from klgrad.data.tasks import make_splits
from klgrad.distributed import Dist, check_config
from klgrad.experiments.exact_objective import exact_objective
from klgrad.kl import get_kl_head
from klgrad.logprobs import sequence_logprobs
from klgrad.models import disable_dropout, load_model_and_tokenizer
from klgrad.objective import (
    ObjectiveSpec,
    combined_advantages,
    decoupled_advantages,
    objective_diagnostics,
    policy_objective,
)
from klgrad.rewards import RewardResult, RewardSpec, compute_rewards
from klgrad.rollout.encoding import decode_responses, encode_prompts
from klgrad.rollout.mismatch import mismatch_weights
from klgrad.rollout.samplers import Rollout, make_sampler
from klgrad.runlock import RunLockedError, run_lock

EMBEDDED_DIR = Path(__file__).parent / "assets"
"""Shipped tiny reference checkpoints (``tiny_addition``, ``tiny_addition_discovery``, ``tiny_scratchpad``), made
by ``klgrad sft``."""


def objective_spec(cfg: Config) -> ObjectiveSpec:
    """The loss, from the config."""
    return ObjectiveSpec(
        kl_head=cfg.kl.head,
        beta=cfg.kl.beta,
        kl_level=cfg.kl.level,
        form=cfg.kl.form,
        clip_eps_low=cfg.algo.clip_eps_low,
        clip_eps_high=cfg.algo.clip_eps_high,
        dual_clip=cfg.algo.dual_clip,
        ratio_level=cfg.algo.ratio_level,
        kl_clip_eps=cfg.kl.clip_eps,
        kl_ratio_level=cfg.kl.ratio_level,
        kl_is_correction=cfg.kl.is_correction,
        aggregation=cfg.algo.aggregation,
        entropy_coef=cfg.algo.entropy_coef,
    )


def adaptive_beta(beta: float, kl: float, target: float, rate: float) -> float:
    """Proportional controller (Ziegler et al.): β ← β·(1 + rate·clip(KL/target - 1, -0.2, 0.2)/0.2)."""
    err = max(-0.2, min(0.2, kl / target - 1.0))
    return beta * (1.0 + rate * err / 0.2)


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up then constant / cosine / linear decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0


@dataclass
class Batch:
    """This process's rows of one step's rollout, everything the update needs; (n, T) response-aligned tensors.

    In a single process these are all the step's rows; under ``accelerate launch`` the rank's contiguous
    whole groups, with T the width of the whole step's batch.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_start: int
    mask: Tensor
    rewards: Tensor
    ref_logp: Tensor
    old_logp: Tensor | None
    behaviour_weights: Tensor | None = None
    """(n, T) truncated-IS weights for a sampler whose log-probs differ from the trainer's (vLLM), or None."""


SINGLE = Dist()
"""One process: every collective is the identity."""


class PolicyLogprobs(torch.nn.Module):
    """The policy's response log-probs (and entropies) as a module: what the training forward differentiates.

    Under accelerate this module is what DDP wraps, so the ranks run the very computation of one process
    (``logprob_fn`` on the plain model, with its fast paths: shared-prompt forward, ``logits_to_keep``) and
    DDP's hooks on the policy's parameters all-reduce their gradients.
    """

    def __init__(self, policy: torch.nn.Module, logprob_fn) -> None:
        super().__init__()
        self.policy = policy
        self.logprob_fn = logprob_fn

    def forward(self, input_ids: Tensor, attention_mask: Tensor, response_start: int, with_entropy: bool):
        return self.logprob_fn(self.policy, input_ids, attention_mask, response_start, with_entropy)


def mini_batch_rows(n: int, group_size: int, mini_batches: int) -> list[Tensor]:
    """Rows of each mini-batch among ``n`` rows of whole groups: mini-batch k holds groups k, k+M, k+2M, ...

    The rule does not depend on how the step's batch is split over processes: a rank owning P/W contiguous
    groups (P/W divisible by M) contributes exactly its groups of mini-batch k, so the union over ranks is the
    single-process mini-batch.
    """
    groups = torch.arange(n).view(-1, group_size)  # (n / G, G)
    return [groups[k::mini_batches].reshape(-1) for k in range(mini_batches)]


def step_advantages(batch: Batch, cur_logp: Tensor | None, cfg: Config, spec: ObjectiveSpec, dist: Dist) -> Tensor:
    """(n, T) advantages of this rank's rows, from the whole step's batch (batch-level shaping and the combined
    form's statistics are global; each rank gathers the batch and keeps its rows)."""
    rewards, mask = dist.gather(batch.rewards), dist.gather(batch.mask)  # (N,), (N, T)
    if spec.form == "combined":
        adv = combined_advantages(
            rewards,
            get_kl_head(cfg.kl.head),
            dist.gather(cur_logp),
            dist.gather(batch.ref_logp),
            mask,
            beta=spec.beta,
            level=cfg.kl.level,
            group_size=cfg.rollout.group_size,
            method=cfg.algo.shaping,
            std_min=cfg.algo.std_min,
            std_max=cfg.algo.std_max,
        )  # (N, T) recomputed every epoch from the current policy
    else:
        adv = decoupled_advantages(
            rewards, mask, cfg.rollout.group_size, cfg.algo.shaping, cfg.algo.std_min, cfg.algo.std_max
        )  # (N, T)
    return dist.local_rows(adv)  # (n, T)


def update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: Config,
    spec: ObjectiveSpec,
    logprob_fn,
    record_step: int = 0,
    dist: Dist = SINGLE,
    train_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """``ppo_epochs`` × ``mini_batches`` optimizer steps on one rollout batch; returns mean metrics.

    A non-finite loss or gradient norm (on any rank) skips that optimizer step: gradients are dropped, weights
    and AdamW state stay untouched, and ``skipped_updates`` counts it.

    ``policy`` is the plain model (no-grad passes); ``train_model`` the :class:`PolicyLogprobs` the loss is
    differentiated through (DDP-wrapped under accelerate; default: of ``policy``). Normalisers are the global
    mini-batch's, and the loss is scaled by the world size W because DDP averages gradients over ranks: the
    summed gradient equals the single-process one. Metrics are summed over ranks (grad norm: already global).
    ``logprob_fn(model, input_ids, attention_mask, response_start, with_entropy)`` -> (logp, entropy).
    """
    train_model = PolicyLogprobs(policy, logprob_fn) if train_model is None else train_model
    n = batch.mask.shape[0]
    mini = mini_batch_rows(n, cfg.rollout.group_size, cfg.algo.mini_batches)
    n_seq = n * dist.world // cfg.algo.mini_batches  # sequences per global mini-batch
    tokens = [int(t) for t in dist.sum([float(batch.mask[rows].sum()) for rows in mini])]  # per global mini-batch
    mbs = cfg.algo.micro_batch_size
    sums: dict[str, float] = {}
    count = skipped = 0
    inject_nan = _nan_injected(record_step)
    for _epoch in range(cfg.algo.ppo_epochs):
        cur = None
        if spec.form == "combined":
            with torch.no_grad():
                cur, _ = logprob_fn(policy, batch.input_ids, batch.attention_mask, batch.response_start, False)
        adv_all = step_advantages(batch, cur, cfg, spec, dist)  # (n, T)
        for rows, n_tok in zip(mini, tokens, strict=True):
            optimizer.zero_grad(set_to_none=True)
            finite = True
            starts = range(0, rows.numel(), mbs)
            for ms in starts:
                r = rows[ms : ms + mbs]  # (m,) row indices of this micro-batch
                with dist.no_sync(train_model, sync=ms == starts[-1]):  # DDP all-reduces after the last one
                    logp, ent = train_model(batch.input_ids[r], batch.attention_mask[r], batch.response_start, True)
                    terms = policy_objective(
                        logp,
                        batch.ref_logp[r],
                        batch.mask[r],
                        adv_all[r],
                        spec,
                        old_logp=None if batch.old_logp is None else batch.old_logp[r],
                        entropy=ent,
                        num_sequences=n_seq,
                        num_tokens=n_tok,
                        behaviour_weights=None if batch.behaviour_weights is None else batch.behaviour_weights[r],
                    )
                    loss = terms.loss * float("nan") if inject_nan else terms.loss
                    finite = finite and bool(torch.isfinite(loss))
                    (loss * dist.world).backward()
                m = batch.mask[r]
                ent_mean = float(torch.where(m, ent.detach(), 0.0).sum()) / max(n_tok, 1)
                for k, v in (
                    ("policy_loss", terms.policy_loss),
                    ("kl_loss", terms.kl_loss),
                    ("entropy", ent_mean),
                ):
                    sums[k] = sums.get(k, 0.0) + float(v)
                diag = objective_diagnostics(
                    logp,
                    batch.ref_logp[r],
                    m,
                    adv_all[r],
                    spec,
                    old_logp=None if batch.old_logp is None else batch.old_logp[r],
                )
                for k in ("clip_frac", "kl_clip_frac", "ratio_mean", "ratio_max"):
                    sums[k] = sums.get(k, 0.0) + diag[k] * r.numel() / n_seq
            finite = dist.all_true(finite)
            total = dist.clip_grad_norm_(train_model, cfg.optim.grad_clip or float("inf"))
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(total)
            count += 1
            if not (finite and math.isfinite(float(total))):
                optimizer.zero_grad(set_to_none=True)  # skip: weights and optimizer state untouched
                skipped += 1
                continue
            optimizer.step()
            if count == 1:
                _fault("update", record_step)
    summed = [k for k in sums if k != "grad_norm"]  # each rank holds its share; the grad norm is global
    sums.update(zip(summed, dist.sum([sums[k] for k in summed]), strict=True))
    out = {k: v / count for k, v in sums.items()}
    out["skipped_updates"] = skipped
    return out


# ----------------------------------------------------------------------------------------------------------
# prompts, log-probs, rewards


def make_logprob_fn(temperature: float, shared_prompts: bool = True):
    """``fn(model, input_ids, attention_mask, response_start, with_entropy) -> (logp, entropy)``."""

    def fn(model, input_ids, attention_mask, response_start, with_entropy):
        return sequence_logprobs(
            model,
            input_ids,
            attention_mask,
            response_start,
            temperature,
            with_entropy=with_entropy,
            shared_prompts=shared_prompts,
        )

    return fn


def reward_specs(cfg: Config) -> list[RewardSpec]:
    """Built-in names (accuracy, format) or ``module:function`` (TRL signature), weighted."""
    return [RewardSpec.load(f.name, f.weight) for f in cfg.reward.functions]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of ``step``: it draws the step's prompts (and seeds engines with their own RNG)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def prompt_indices(seed: int, step: int, n_train: int, n_prompts: int) -> list[int]:
    """Indices into the training set of the ``n_prompts`` prompts of ``step``: a function of (seed, step) only.

    Together with :func:`rollout_uniforms` this makes runs of one seed a block: whatever their KL head, level,
    form or β, they answer the same prompts with the same sampling uniforms (common random numbers), which is
    what lets ``klgrad compare`` pair its runs by seed.
    """
    return draw_prompts(step_generator(seed, step), n_train, n_prompts)


def draw_prompts(gen: torch.Generator, n_train: int, n_prompts: int) -> list[int]:
    """``n_prompts`` training-set indices drawn with ``gen`` (uniform, with replacement)."""
    return torch.randint(n_train, (n_prompts,), generator=gen).tolist()


def prompt_seed(seed: int, step: int, prompt: int) -> int:
    """Seed of the sampling generator of global prompt ``prompt`` at ``step`` (63 bits of a sha256)."""
    digest = hashlib.sha256(f"klgrad-rollout:{seed}:{step}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rollout_uniforms(seed: int, step: int, prompts: slice, group_size: int, max_new_tokens: int) -> Tensor:
    """(len(prompts)·G, max_new_tokens) sampling uniforms of the global prompts ``prompts``, in prompt order.

    Prompt i's G rows come from their own generator seeded by (seed, step, i), and the sampler draws a row's
    tokens from its own logits and uniforms only, so every split of the step over processes samples the same
    responses as one process.
    """
    return torch.cat(
        [
            torch.rand(group_size, max_new_tokens, generator=torch.Generator().manual_seed(prompt_seed(seed, step, i)))
            for i in range(prompts.start, prompts.stop)
        ]
    )  # (n, max_new_tokens)


def pad_responses(rollout: Rollout, width: int, pad_id: int) -> Rollout:
    """Right-pad responses to ``width`` tokens (pad id, masked, log-prob 0): a rank whose responses all ended
    early gets the width of the whole step's batch, as in one process."""
    extra = width - rollout.response_ids.shape[1]
    if extra == 0:
        return rollout
    n = rollout.response_ids.shape[0]

    def pad(x: Tensor, value) -> Tensor:
        return torch.cat([x, torch.full((n, extra), value, dtype=x.dtype, device=x.device)], dim=1)  # (n, width)

    return dataclasses.replace(
        rollout,
        response_ids=pad(rollout.response_ids, pad_id),
        response_mask=pad(rollout.response_mask, False),
        logp=pad(rollout.logp, 0.0),
    )


def merge_rewards(parts: list[RewardResult]) -> RewardResult:
    """The reward results of consecutive row blocks (ranks, in order) as one result over all rows."""
    if len(parts) == 1:
        return parts[0]
    failing = {name for p in parts for name in p.failures}
    erring = {name for p in parts for name in p.errors}
    return RewardResult(
        total=[v for p in parts for v in p.total],
        per_function={name: [v for p in parts for v in p.per_function[name]] for name in parts[0].per_function},
        failures={name: sum(p.failures.get(name, 0) for p in parts) for name in failing},
        errors={name: [e for p in parts for e in p.errors.get(name, [])] for name in erring},
    )


# ----------------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(policy, ref, tokenizer, examples: list[Example], cfg: Config, specs, sampler, seed: int) -> dict:
    """Greedy accuracy, sampled reward and sequence KL to the reference on held-out prompts.

    The sampled reward is of the configured sampler (``rollout.top_p`` included). The KL estimates k1, k3 are of
    KL(π‖π_ref) between the full distributions, so they come from samples of the full policy: with
    ``top_p < 1`` (allowed only without a KL head) a second, untruncated sample is drawn for them, since the
    sampler's log-probs are of the full distribution and a truncated sample would make k1 estimate nothing.

    On the first :func:`eval_objective_prompts` prompts it also computes, by enumerating every response, the
    exact objective J_β = E_π[R] − β·KL(π‖π_ref) at β = ``kl.beta`` (the configured β, also under an adaptive β,
    so that every evaluation and every method of a comparison is judged on the same objective), its optimum J*,
    KL(π‖π*) = (J* − J_β)/β and KL(π‖π_ref), all against the reference in force (:func:`objective_metrics`).
    """
    prompts = [e.prompt for e in examples]
    device = next(policy.parameters()).device
    ids, mask = (x.to(device) for x in encode_prompts(tokenizer, prompts))
    columns = examples_to_columns(examples)
    out: dict[str, float] = {}
    greedy = sampler.generate(policy, ids, mask, group_size=1, max_new_tokens=cfg.rollout.max_new_tokens, greedy=True)
    greedy_res = compute_rewards(specs, prompts, decode_responses(tokenizer, greedy), columns)
    if "accuracy" in greedy_res.per_function:  # only a real accuracy reward is reported as accuracy
        acc = greedy_res.per_function["accuracy"]
        out["eval/greedy_accuracy"] = sum(a or 0.0 for a in acc) / len(acc)
    out["eval/greedy_reward"] = sum(greedy_res.total) / len(greedy_res.total)
    gen = torch.Generator().manual_seed(seed)

    def sample(top_p: float):
        return sampler.generate(
            policy,
            ids,
            mask,
            group_size=1,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=top_p,
            generator=gen,
        )

    sampled = sample(cfg.rollout.top_p)
    res = compute_rewards(specs, prompts, decode_responses(tokenizer, sampled), columns)
    out["eval/sampled_reward"] = sum(res.total) / len(res.total)
    if "accuracy" in res.per_function:
        out["eval/sampled_accuracy"] = sum(res.per_function["accuracy"]) / len(prompts)
    if cfg.rollout.top_p < 1.0:  # the KL estimates need a sample of the full distribution
        sampled = sample(1.0)
    ref_lp, _ = sequence_logprobs(ref, sampled.input_ids, sampled.attention_mask, ids.shape[1], cfg.rollout.temperature)
    u = torch.where(sampled.response_mask, sampled.logp - ref_lp, 0.0).sum(-1)  # (N,) sequence log-ratio
    out["eval/kl_k1"] = float(u.mean())
    out["eval/kl_k3"] = float((torch.expm1(-u) + u).mean())
    n_objective = eval_objective_prompts(cfg)
    if n_objective:
        obj = exact_objective(
            policy,
            ref,
            tokenizer,
            examples[:n_objective],
            specs,
            beta=cfg.kl.beta,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            reward_batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        )
        out.update(objective_metrics(obj))
    return out


def eval_objective_prompts(cfg: Config) -> int:
    """Held-out prompts of the exact objective at each evaluation: ``train.eval_objective_prompts``, or when
    null 20 for short answers (``rollout.max_new_tokens`` ≤ 10, small response trees) with ``kl.beta`` > 0 and
    ``rollout.top_p`` = 1, else 0."""
    if cfg.train.eval_objective_prompts is not None:
        return cfg.train.eval_objective_prompts
    short = cfg.rollout.max_new_tokens <= 10
    return 20 if short and cfg.kl.beta > 0 and cfg.rollout.top_p == 1.0 else 0


def objective_metrics(obj: dict) -> dict[str, float]:
    """The metrics-record keys of an :func:`~klgrad.experiments.exact_objective.exact_objective` result."""
    return {
        "eval/J": obj["J"],
        "eval/J_star": obj["J_star"],
        "eval/kl_to_optimum": obj["kl_to_optimum"],
        "eval/exact_kl": obj["kl"],
        "eval/objective_pruned_mass": obj["pruned_mass"],
        "eval/objective_pruned_mass_ref": obj["pruned_mass_ref"],
        "eval/objective_reward_error": obj["reward_error"],
        "eval/J_star_error": obj["J_star_error"],
        "time/eval_objective": obj["seconds"],
        "time/eval_objective_rewards": obj["seconds_rewards"],
    }


# ----------------------------------------------------------------------------------------------------------
# checkpoints (atomic: temporary folder + rename; "latest" pointer replaced atomically)


def _fault(point: str, step: int) -> None:
    """Test hook (documented in docs/reliability.md): ``KLGRAD_KILL_AT="<point>:<step>"`` SIGKILLs this process
    when the loop reaches ``point`` at record step ``step``. Unset in normal use: a dictionary lookup."""
    spec = os.environ.get("KLGRAD_KILL_AT")
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _nan_injected(step: int) -> bool:
    """Test hook: ``KLGRAD_NAN_AT="2,3"`` makes the loss of those record steps NaN (exercises the skip logic)."""
    spec = os.environ.get("KLGRAD_NAN_AT")
    return bool(spec) and str(step) in spec.split(",")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_is_valid(path: Path) -> bool:
    """True when every file listed in ``checksums.json`` exists with its recorded sha256."""
    try:
        sums = json.loads((path / "checksums.json").read_text())
        return bool(sums) and all(_sha256(path / name) == digest for name, digest in sums.items())
    except (OSError, ValueError):
        return False


def save_checkpoint(
    run_dir: Path, step: int, policy, ref, optimizer, scheduler, beta: float, cfg: Config, save_ref: bool
) -> Path:
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(policy, str(tmp / "policy.safetensors"))
    _fault("checkpoint_file", step)
    if save_ref:
        save_model(ref, str(tmp / "ref.safetensors"))
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        tmp / "optim.pt",
    )
    (tmp / "state.json").write_text(json.dumps({"step": step, "beta": beta, "config": to_dict(cfg)}, indent=1))
    sums = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
    (tmp / "checksums.json").write_text(json.dumps(sums, indent=1))  # written last: its presence = complete
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fault("checkpoint_rename", step)
    pointer = ckpt_root / "latest.tmp"
    pointer.write_text(final.name)
    pointer.replace(ckpt_root / "latest")
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose checksums verify; torn or corrupt ones are skipped (the ``latest`` pointer is
    only a hint for people: a kill between the folder rename and the pointer update leaves it one behind)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step_*"), reverse=True):
        if checkpoint_is_valid(path):
            return path
    return None


def load_checkpoint(path: Path, policy, ref, optimizer, scheduler) -> tuple[int, float]:
    load_model(policy, str(path / "policy.safetensors"))
    if (path / "ref.safetensors").is_file():
        load_model(ref, str(path / "ref.safetensors"))
    try:  # weights_only: tensors and plain containers only, never arbitrary pickled objects
        state = torch.load(path / "optim.pt", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        # torch's message suggests weights_only=False: the wrong advice for a file we do not trust; omit it
        raise ValueError(
            f"{path / 'optim.pt'}: refused to load: it holds objects other than tensors and plain containers "
            f"({type(e).__name__}); klgrad never unpickles arbitrary objects. Delete this checkpoint to fall back."
        ) from e
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])  # per-step sampling uses its own (seed, step) generator
    meta = json.loads((path / "state.json").read_text())
    return int(meta["step"]), float(meta["beta"])


# ----------------------------------------------------------------------------------------------------------
# output


def write_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line and flush it (a killed run loses at most the line being written)."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a killed run
    return out


def git_revision() -> str | None:
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(13, 9.5))
    steps = [r["step"] for r in records if "reward/mean" in r]
    for ax, (key, label) in zip(axes.flat, CURVES, strict=True):
        ys = [r[key] if r.get(key) is not None else float("nan") for r in records if "reward/mean" in r]
        ax.plot(steps, ys, color="#1f5f8b", lw=1.2, label="train batch")
        if key == "reward/accuracy":
            ev = [(r["step"], r["eval/greedy_accuracy"]) for r in records if "eval/greedy_accuracy" in r]
            if ev:
                ax.plot(*zip(*ev, strict=True), "o-", color="#c0392b", ms=4, label="held-out greedy")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# the loop


def reference_path(cfg: Config) -> Path:
    """The model to start from: ``model.path`` or the embedded reference of the synthetic task."""
    if cfg.model.path:
        return Path(cfg.model.path)
    task = cfg.data.task if cfg.data.task != "file" else "addition"
    return EMBEDDED_DIR / f"tiny_{task}"


def load_data(cfg: Config) -> tuple[list[Example], list[Example]]:
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


def train(cfg: Config, *, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict:
    """Run (or resume) RL training as configured; returns the summary dict (also written to summary.json).

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
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    dist = Dist.from_env()
    check_config(cfg, dist.world)
    data = load_data(cfg)  # fails before anything is written
    if cfg.train.wandb:
        _require_wandb()
    specs = reward_specs(cfg)
    model_dir = reference_path(cfg)
    device = resolve_device(cfg.model.device, dist.world)
    with hold_run_dir(Path(cfg.train.out_dir), dist):
        summary = _train_locked(cfg, dist, data, specs, model_dir, device, resume, progress, stop_after)
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


def _train_locked(
    cfg: Config,
    dist: Dist,
    data: tuple[list[Example], list[Example]],
    specs: list[RewardSpec],
    model_dir: Path,
    device: torch.device,
    resume: bool,
    progress: bool,
    stop_after: int | None,
) -> dict:
    """:func:`train` once the configuration is validated and rank 0 holds the run directory's lock."""
    run_dir = Path(cfg.train.out_dir)
    train_set, eval_set = data
    load = dict(dtype=cfg.model.dtype, attn_implementation=_attn(cfg), device=device)
    policy, tokenizer = load_model_and_tokenizer(model_dir, **load)
    ref, _ = load_model_and_tokenizer(model_dir, **load)
    # dropout off in both: every log-prob klgrad compares (behaviour, current, reference) must be of one
    # deterministic policy, whether taken in train mode or eval mode, with the fast forward or transformers'
    disable_dropout(policy)
    disable_dropout(ref)
    ref.eval().requires_grad_(False)
    policy.train()
    sampler = make_sampler(cfg.rollout.engine, tokenizer.eos_token_id, tokenizer.pad_token_id, **_sampler_options(cfg))
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
    )
    updates_per_step = cfg.algo.ppo_epochs * cfg.algo.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda k: lr_factor(k // updates_per_step, cfg.train.steps, cfg.optim.warmup_steps, cfg.optim.schedule),
    )
    beta, start = cfg.kl.beta, 0
    metrics_path = run_dir / "metrics.jsonl"
    main = dist.is_main
    if resume:  # every rank loads the checkpoint; rank 0 alone repairs the pointer and the metrics
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            start, beta = load_checkpoint(ckpt, policy, ref, optimizer, scheduler)
        dist.barrier()  # every rank has read the checkpoint before rank 0 writes anything
        if main:
            if ckpt is not None:
                (ckpt.parent / "latest").write_text(ckpt.name)  # repair a pointer left behind by a kill
            kept = [r for r in read_jsonl(metrics_path) if r["step"] <= start]  # drop steps after the checkpoint
            run_dir.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    else:
        if metrics_path.exists():
            raise FileExistsError(f"{run_dir} already holds a run; use --resume or another train.out_dir")
        dist.barrier()  # every rank has checked before rank 0 creates the run
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
    # the training forward goes through the prepared (DDP) log-prob module; rollout, reference and eval use the
    # plain model
    logprob_fn = make_logprob_fn(cfg.rollout.temperature, shared_prompts=cfg.model.fast_forward)
    train_model, optimizer = dist.prepare(PolicyLogprobs(policy, logprob_fn), optimizer)
    if main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        (run_dir / "run.json").write_text(
            json.dumps(
                {
                    "git_revision": git_revision(),
                    "model": str(model_dir),
                    "klgrad": __import__("klgrad").__version__,
                    "num_processes": dist.world,
                },
                indent=1,
            )
        )
    writer = _tensorboard(run_dir) if cfg.train.tensorboard and main else None
    wandb_run = _wandb(cfg, run_dir) if cfg.train.wandb and main else None
    off_policy = updates_per_step > 1
    g = cfg.rollout.group_size
    n_prompts = cfg.rollout.prompts_per_step
    mine = dist.shard(n_prompts)  # this rank's prompts of every step (all of them in one process)
    bar = tqdm(
        range(start, cfg.train.steps),
        initial=start,
        total=cfg.train.steps,
        disable=not (progress and main),
        desc="klgrad train",
        dynamic_ncols=True,
    )
    done_here = consecutive_skips = 0

    def checkpoint(at_step: int) -> Path:
        """Rank 0 writes (the weights and AdamW state are the same on every rank); all return the path."""
        if main:
            save_ref = cfg.kl.reset_ref_every is not None
            path = save_checkpoint(run_dir, at_step, policy, ref, optimizer, scheduler, beta, cfg, save_ref=save_ref)
        else:
            path = run_dir / "checkpoints" / f"step_{at_step:06d}"
        dist.barrier()  # nobody moves on (or exits) while rank 0 writes
        return path

    has_reference_eval = main and any(r["step"] == 0 for r in read_jsonl(metrics_path))
    if main and start == 0 and not has_reference_eval:  # the reference's own held-out evaluation, before any update
        policy.eval()
        write_jsonl(
            metrics_path,
            {
                "step": 0,
                **evaluate(policy, ref, tokenizer, eval_set, cfg, specs, sampler, seed=cfg.train.seed),
            },
        )
        policy.train()
    for step in bar:
        t0 = time.perf_counter()
        gen = step_generator(cfg.train.seed, step)  # the step's prompts, then the RNG of engines that need one
        idx = draw_prompts(gen, len(train_set), n_prompts)  # = prompt_indices(seed, step, ...)
        examples = [train_set[i] for i in idx]  # the same P prompts on every rank
        # 1-2. rollout: G responses per prompt, groups contiguous. All P prompts are encoded, so the left
        # padding is the single-process one; this rank answers its shard with its prompts' own uniforms.
        prompt_ids, prompt_mask = (x.to(device) for x in encode_prompts(tokenizer, [e.prompt for e in examples]))
        examples = examples[mine]
        if cfg.rollout.engine == "klgrad":
            randomness = {"uniforms": rollout_uniforms(cfg.train.seed, step, mine, g, cfg.rollout.max_new_tokens)}
        else:  # engines with their own RNG, seeded from ours (single process only)
            randomness = {"generator": gen}
        policy.eval()
        rollout = sampler.generate(
            policy,
            prompt_ids[mine],
            prompt_mask[mine],
            group_size=g,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            **randomness,
        )
        policy.train()
        rollout = pad_responses(rollout, dist.max_int(rollout.response_ids.shape[1]), tokenizer.pad_token_id)
        _fault("rollout", step + 1)
        t_rollout = time.perf_counter()
        # 3. rewards (this rank's rows; the record and the failure budget use all of them)
        rep = [e for e in examples for _ in range(g)]
        completions = decode_responses(tokenizer, rollout)
        rres = compute_rewards(
            specs,
            [e.prompt for e in rep],
            completions,
            examples_to_columns(rep),
            failure_value=cfg.reward.failure_value,
            timeout_s=cfg.reward.timeout_s,
        )
        rewards = torch.tensor(rres.total, dtype=torch.float32, device=device)  # (n,)
        rres = merge_rewards(dist.gather_objects(rres))  # every rank's rows, in prompt order
        failed = sum(rres.failures.values())
        budget = cfg.reward.max_failure_fraction
        if budget is not None and failed > budget * len(rres.total):
            raise RuntimeError(
                f"step {step + 1}: {failed} reward-function failures out of {len(rres.total)} samples exceed "
                f"reward.max_failure_fraction = {budget}; errors: {dict(rres.errors)}"
            )
        t_reward = time.perf_counter()
        # 4. reference (and behaviour, when off-policy) log-probs
        p_len = prompt_ids.shape[1]
        correct_mismatch = cfg.rollout.mismatch_correction != "none"
        with torch.no_grad():
            ref_logp, _ = logprob_fn(ref, rollout.input_ids, rollout.attention_mask, p_len, False)
            trainer_logp = None  # the trainer's own log-probs of the rollout policy, when needed
            if off_policy or correct_mismatch:
                trainer_logp, _ = logprob_fn(policy, rollout.input_ids, rollout.attention_mask, p_len, False)
            old_logp = trainer_logp if off_policy else None
        weights = None
        if correct_mismatch:  # truncated IS for a sampler (vLLM) whose log-probs differ from the trainer's
            weights = mismatch_weights(
                trainer_logp,
                rollout.logp,
                rollout.response_mask,
                cfg.rollout.mismatch_correction,
                cfg.rollout.mismatch_cap,
            )  # (n, T)
        t_ref = time.perf_counter()
        batch = Batch(
            rollout.input_ids,
            rollout.attention_mask,
            p_len,
            rollout.response_mask,
            rewards,
            ref_logp,
            old_logp,
            weights,
        )
        # 5-6. advantages and updates
        spec = dataclasses.replace(objective_spec(cfg), beta=beta)
        upd = update(
            policy, optimizer, batch, cfg, spec, logprob_fn, record_step=step + 1, dist=dist, train_model=train_model
        )
        for _ in range(updates_per_step):
            scheduler.step()
        if hasattr(sampler, "sync_weights"):  # an engine holding its own copy of the weights (vLLM)
            sampler.sync_weights(policy)
        t_update = time.perf_counter()
        # 7. metrics (SPEC §9) of the whole step's batch: KL estimates from the sampler's log-probs of the
        # pre-update policy
        rewards_all = torch.tensor(rres.total, dtype=torch.float32, device=device)  # (N,)
        mask_all, ref_all = dist.gather(rollout.response_mask), dist.gather(ref_logp)  # (N, T)
        diag = objective_diagnostics(dist.gather(rollout.logp), ref_all, mask_all, torch.zeros_like(ref_all), spec)
        _, shaping_stats = shape_rewards(
            rewards_all, g, cfg.algo.shaping, cfg.algo.std_min, cfg.algo.std_max, return_stats=True
        )
        n_tok = int(mask_all.sum())
        rec = {
            "step": step + 1,
            "reward/mean": float(rewards_all.mean()),
            "reward/std_in_group": float(rewards_all.view(-1, g).std(-1).mean()) if g > 1 else 0.0,
            "reward/zero_std_groups": shaping_stats.zero_std_groups,
            **{f"reward/{name}": sum(v) / len(v) for name, v in rres.per_function.items()},
            "reward/failures": sum(rres.failures.values()),
            "kl/k1": diag["kl_k1"],
            "kl/k2": diag["kl_k2"],
            "kl/k3": diag["kl_k3"],
            "kl/logp_gap": diag["logp_gap"],
            "kl/logp_gap_abs": diag["logp_gap_abs"],
            "response/length": float(mask_all.sum(-1).float().mean()),
            "response/truncated": float(dist.gather(rollout.truncated).float().mean()),
            "entropy": upd.get("entropy", float("nan")),
            "loss/policy": upd["policy_loss"],
            "loss/kl": upd["kl_loss"],
            "clip/frac": upd["clip_frac"],
            "clip/kl_frac": upd["kl_clip_frac"],
            "ratio/mean": upd["ratio_mean"],
            "ratio/max": upd["ratio_max"],
            "grad_norm": upd["grad_norm"],
            "skipped_updates": upd["skipped_updates"],
            "beta": beta,
            "lr": scheduler.get_last_lr()[0],
            "time/rollout": t_rollout - t0,
            "time/reward": t_reward - t_rollout,
            "time/ref": t_ref - t_reward,
            "time/update": t_update - t_ref,
            "time/step": time.perf_counter() - t0,
            "tokens_per_s": n_tok / max(time.perf_counter() - t0, 1e-9),
        }
        if weights is not None:  # how far the sampler's log-probs are from the trainer's
            w_all, m_all = dist.gather(weights), mask_all
            rec["mismatch/weight_mean"] = float(w_all[m_all].mean()) if bool(m_all.any()) else 1.0
            rec["mismatch/weight_max"] = float(w_all[m_all].max()) if bool(m_all.any()) else 1.0
            rec["mismatch/capped_frac"] = float((w_all[m_all] >= cfg.rollout.mismatch_cap).float().mean())
        if cfg.kl.target_kl is not None:
            beta = adaptive_beta(beta, rec["kl/k1"], cfg.kl.target_kl, cfg.kl.adapt_rate)
        if cfg.kl.reset_ref_every and (step + 1) % cfg.kl.reset_ref_every == 0:
            ref.load_state_dict(policy.state_dict())
        last = step + 1 == cfg.train.steps
        if main and ((cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0) or last):
            policy.eval()
            rec.update(evaluate(policy, ref, tokenizer, eval_set, cfg, specs, sampler, seed=cfg.train.seed))
            policy.train()
        rec = {k: (v if isinstance(v, int) or math.isfinite(v) else None) for k, v in rec.items()}
        if main:
            write_jsonl(metrics_path, rec)
        _fault("log", step + 1)
        if writer is not None:
            for k, v in rec.items():
                if k != "step" and v is not None and not k.startswith("time/"):
                    writer.add_scalar(k, v, step + 1)
        if wandb_run is not None:
            wandb_run.log({k: v for k, v in rec.items() if v is not None}, step=step + 1)
        bar.set_postfix(
            reward=f"{rec['reward/mean']:.3f}",
            kl=f"{rec['kl/k1']:.3f}",
            acc=f"{rec.get('eval/greedy_accuracy', float('nan')):.2f}",
        )
        if (step + 1) % cfg.train.save_every == 0 or last:
            checkpoint(step + 1)
        if upd["skipped_updates"] and main:
            tqdm.write(
                f"klgrad train: step {step + 1}: non-finite loss or gradient, {upd['skipped_updates']} "
                "update(s) skipped (weights and optimizer state untouched)",
                file=sys.stderr,
            )
        consecutive_skips = consecutive_skips + 1 if upd["skipped_updates"] else 0
        if consecutive_skips >= cfg.train.max_skipped_steps:
            # skipped updates changed nothing, so the current weights are the last good ones: keep them
            ckpt = checkpoint(step + 1)
            raise RuntimeError(
                f"non-finite loss or gradient in {consecutive_skips} consecutive steps (up to step {step + 1}); "
                f"stopped. The last good weights are in {ckpt}; continue with --resume {run_dir}"
            )
        done_here += 1
        if stop_after is not None and done_here >= stop_after:
            break
    bar.close()
    if writer is not None:
        writer.close()
    if wandb_run is not None:
        wandb_run.finish()
    if main:
        records = read_jsonl(metrics_path)
        summary = summarize(records)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if records:
            plot_curves(
                records,
                run_dir / "curves.png",
                f"klgrad train — {cfg.data.task}, head {cfg.kl.head} ({cfg.kl.level}, {cfg.kl.form}), "
                f"β={cfg.kl.beta}, seed {cfg.train.seed}",
            )
    dist.barrier()  # the other ranks return rank 0's summary
    return summary if main else summarize(read_jsonl(metrics_path))


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


def resolve_device(setting: str, world: int) -> torch.device:
    """``model.device``: auto = cuda when torch sees a GPU, else cpu. Several processes run on the CPU (the
    distributed path is verified with gloo on CPU only; a GPU run there is refused rather than untested)."""
    if world > 1:
        if setting not in ("auto", "cpu"):
            raise ConfigError(f"model.device {setting!r}: distributed runs are CPU-only for now (docs/distributed.md)")
        return torch.device("cpu")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def _sampler_options(cfg: Config) -> dict:
    if cfg.rollout.engine == "klgrad":
        return {"fast": cfg.model.fast_forward}
    if cfg.rollout.engine == "vllm":
        return {"seed": cfg.train.seed}
    return {}


def _attn(cfg: Config) -> str | None:
    return None if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation


def _require_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ValueError("train.wandb is true but the wandb package is not installed (pip install wandb)") from e
    return wandb


def _wandb(cfg: Config, run_dir: Path):
    """A W&B run when ``train.wandb`` is set (offline mode is wandb's own WANDB_MODE setting)."""
    wandb = _require_wandb()
    return wandb.init(project="klgrad", dir=str(run_dir), config=to_dict(cfg), name=run_dir.name)


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL only
        return None
    return SummaryWriter(str(run_dir / "tb"))
