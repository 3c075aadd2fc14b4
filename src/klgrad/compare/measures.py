"""The built-in final measurements (:mod:`klgrad.compare.measurements` registers them): each a function of a
run's :class:`~klgrad.compare.context.FinalContext` returning the keys it adds to final.json."""

from __future__ import annotations

import json
import subprocess
import sys

from klgrad.compare.context import FinalContext


def exact_kl(ctx: FinalContext) -> dict:
    """KL(π‖π_ref) on the held-out prompts by enumerating every response (short answers only), with the mass the
    enumeration pruned and its node count; with β > 0 also ``objective``: the exact J_β, J* and KL(π‖π*)."""
    if not ctx.short:
        return {}
    e = ctx.enumeration()
    if ctx.objective_cfg.kl.beta > 0:
        return {
            "exact_kl": e["kl"],
            "exact_kl_pruned_mass": e["pruned_mass_max"],
            "exact_kl_nodes": e["nodes"],
            "objective": e,
        }
    return {"exact_kl": e["kl"], "exact_kl_pruned_mass": e["pruned_mass"], "exact_kl_nodes": e["nodes"]}


def sampled_kl(ctx: FinalContext) -> dict:
    """The sampled k1, k2, k3 estimates of KL(π‖π_ref) on ``samples`` policy samples per held-out prompt."""
    from klgrad.exact.kl import sampled_kl_estimates

    return {f"sampled_{k}": v for k, v in sampled_kl_estimates(ctx.policy_samples()[1]).items()}


def stepwise_kl(ctx: FinalContext) -> dict:
    """KL(π‖π_ref) too long to enumerate: exact next-token KLs summed along the policy samples
    (:func:`klgrad.exact.kl.stepwise_kl`), its prompt-clustered standard error, each prompt's mean (for
    ``klgrad regime``'s per-prompt fixed points) and the sampled k1's clustered standard error."""
    import torch

    from klgrad.exact.kl import clustered_mean_se
    from klgrad.exact.kl import stepwise_kl as stepwise

    if ctx.short:
        return {}
    policy, ref, _ = ctx.models()
    ids, _ = ctx.encoded()
    sampled, log_ratios = ctx.policy_samples()
    steps = stepwise(
        policy,
        ref,
        sampled.input_ids,
        sampled.attention_mask,
        ids.shape[1],
        sampled.response_mask,
        ctx.cfg.rollout.temperature,
    )  # (P·samples,)
    prompt_of = torch.arange(ids.shape[0]).repeat_interleave(ctx.samples)  # groups are contiguous
    mean, se = clustered_mean_se(steps, prompt_of)
    return {
        "stepwise_kl": mean,
        "stepwise_kl_se": se,
        "stepwise_kl_per_prompt": steps.view(ids.shape[0], ctx.samples).mean(1).tolist(),  # prompt order
        "sampled_k1_se": clustered_mean_se(log_ratios.double(), prompt_of)[1],
    }


def forward_kl(ctx: FinalContext) -> dict:
    """KL(π_ref‖π): from the enumeration for short answers, else the stepwise sum along ``samples`` reference
    samples per prompt with its standard error (``forward_kl_se``)."""
    from klgrad.exact.estimators import stepwise_mean_se

    if ctx.short:
        e = ctx.enumeration()
        return {"forward_kl": e["kl_forward"] if ctx.objective_cfg.kl.beta > 0 else e["forward_kl"]}
    policy, ref, tok = ctx.models()
    ids, mask = ctx.encoded()
    cfg = ctx.cfg
    fwd = stepwise_mean_se(
        ref, policy, tok, ids, mask, ctx.samples, cfg.rollout.max_new_tokens, cfg.rollout.temperature, seed=54321
    )
    return {"forward_kl": fwd[0], "forward_kl_se": fwd[1]}


def kl_to_optimum(ctx: FinalContext, ref_samples: int = 256) -> dict:
    """KL(π‖π*) to the optimum of J_β estimated from ``samples`` policy samples, log Z from ``ref_samples``
    reference samples per held-out prompt, at the grid's β (nothing at β = 0)."""
    from klgrad.exact.estimators import estimate_kl_to_optimum
    from klgrad.rollout.encoding import uses_chat
    from klgrad.trainer import reward_specs

    cfg = ctx.objective_cfg
    if not cfg.kl.beta > 0:
        return {}
    policy, ref, tok = ctx.models()
    est = estimate_kl_to_optimum(
        policy,
        ref,
        tok,
        ctx.heldout(),
        reward_specs(cfg),
        beta=cfg.kl.beta,
        samples=ctx.samples,
        ref_samples=ref_samples,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        chat=uses_chat(cfg.data.prompt_format, tok),
        reward_batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        reward_timeout_s=cfg.reward.timeout_s,
        reward_failure_value=cfg.reward.failure_value,
    )
    return {"objective_sampled": est, "kl_to_optimum_sampled": est["kl_to_optimum"]}


def forgetting(ctx: FinalContext, samples: int = 4) -> dict:
    """Both KLs to the reference on the shipped general chat prompts, ``samples`` per prompt and direction,
    responses cut at 64 tokens, at the run's temperature (what the run cost the model away from its task)."""
    from klgrad.exact.estimators import FORGETTING_MAX_NEW_TOKENS, chat_prompts, forgetting_kl

    policy, ref, tok = ctx.models()
    f = forgetting_kl(policy, ref, tok, chat_prompts(), samples, FORGETTING_MAX_NEW_TOKENS, ctx.cfg.rollout.temperature)
    return {"forgetting": f, "forgetting_reverse_kl": f["reverse_kl"], "forgetting_forward_kl": f["forward_kl"]}


HARDER_EVAL = 50
"""Held-out problems of ``downstream``'s harder variant."""


def downstream(ctx: FinalContext, samples: int = 8, pinned: bool = True) -> dict:
    """``klgrad eval`` (a subprocess) of the run's newest checkpoint on two benchmark files written into
    ``RUN/downstream/``: the run's own held-out prompts, and the same task with one more digit per operand (50
    held-out pairs), the paper's "harder variant". Each problem greedily and ``samples`` times at the run's
    temperature and response cap, scored by its correctness reward (``final_number`` for the chat arithmetic
    tasks), on the GPU when there is one. ``pinned``: a pinned grid measured afterwards runs the eval of its pinned
    revision (:meth:`FinalContext.klgrad_source`), as its training did. Returns the eval command and its
    ``eval.json``."""
    import os

    from klgrad.data.tasks import make_splits

    cfg, out = ctx.cfg, ctx.run_dir / "downstream"
    out.mkdir(parents=True, exist_ok=True)
    d = cfg.data
    files = []
    for name, n_eval, digits in (("heldout", d.n_eval, d.digits), ("harder", HARDER_EVAL, d.digits + 1)):
        _, examples = make_splits(d.task, d.n_train, n_eval, d.seed, digits)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in examples))
        files.append(path)
    reward = "final_number" if "final_number" in [f.name for f in cfg.reward.functions] else "accuracy"
    cmd = [sys.executable, "-m", "klgrad", "eval", "--model", f"policy={ctx.run_dir}"]
    for f in files:
        cmd += ["--data", str(f)]
    cmd += [
        "--samples",
        str(samples),
        "--temperature",
        str(cfg.rollout.temperature),
        "--max-new-tokens",
        str(cfg.rollout.max_new_tokens),
        "--reward",
        reward,
        "--seed",
        "0",
        "--device",
        "auto",
        "--out",
        str(out / "eval"),
    ]
    env = dict(os.environ)
    src = ctx.klgrad_source() if pinned else None
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return {"command": " ".join(cmd[1:]), "eval": json.loads((out / "eval" / "eval.json").read_text())}
