"""``klgrad compare``: the paper's KL comparison as a grid of real training runs, with paired statistics.

Methods (everything else equal, β shared): ``none``, ``k1_as_loss``, ``k2_as_loss``, ``k3_as_loss`` (the
paper's four, decoupled form at the chosen level) and ``k1_in_reward`` (combined form; at level ``token`` it
uses ``token_to_go``, the per-token return form, since a combined coefficient must be a return). Each (method, β,
seed) is a ``klgrad train`` run in ``OUT/runs/``; finished runs are skipped and interrupted ones resumed.

Per run the final numbers are: held-out greedy accuracy (last evaluation), the exact KL(π‖π_ref) on held-out
prompts by prefix-tree enumeration (short-answer tasks; for longer answers the stepwise estimate
:func:`~klgrad.exact.kl.stepwise_kl`, exact next-token KLs summed along policy samples, with its
standard error), the sampled k1/k2/k3 estimates on the same prompts,
and the mean over the last 10 steps of the training-batch log-prob gap, reward std within groups and KL. For
short-answer tasks ``objective`` also gives, on the same prompts, the exact regularised objective J_β = E_π[R] −
β·KL(π‖π_ref) of the final policy, its optimum J* and the policy's distance to it, KL(π‖π*) = (J* − J_β)/β, so
methods are compared on the objective they all claim to optimise; each held-out evaluation during training
logs the same (``eval/J``, ``eval/J_star``, ``eval/kl_to_optimum``).

Design: runs of one seed draw the same prompts and the same sampling uniforms whatever their method
(:func:`klgrad.trainer.prompt_indices`, :func:`klgrad.trainer.rollout_uniforms`), so the seed is a block and every
prediction is decided on per-seed differences by a paired test, every tested hypothesis of one summary in one
Holm family (:mod:`klgrad.compare.stats`), never by eye.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from klgrad.audit.framework_head import find_preset, preset_settings
from klgrad.choices import is_preset_id
from klgrad.compare.beta_scale import BetaScale, beta_row, parse_beta_scale, settle_scale
from klgrad.compare.claims import Claim, parse_claim, same_claim
from klgrad.compare.convergence import ConvergenceCriterion, MethodRuns, converged, metric_series
from klgrad.compare.convergence_plot import plot_convergence
from klgrad.compare.design import (
    GRID_FILE,
    allowed_seeds,
    amend_seeds,
    now,
    read_grid,
    registered_seeds,
    settle_design,
    shared_config,
    write_json,
)
from klgrad.compare.provenance import Revision, check_pinned, machine_label, machine_record, source_revision
from klgrad.compare.stats import (
    FLIP_DRAWS,
    decide,
    mean_ci,
    paired_equivalent,
    paired_less,
    welch_equivalent,
    welch_less,
)
from klgrad.config import Config, load_config, to_dict
from klgrad.exact.estimators import optional_final_metrics, stepwise_mean_se
from klgrad.exact.kl import clustered_mean_se, sampled_kl_estimates, stepwise_kl, tree_kl
from klgrad.exact.objective import PRUNE
from klgrad.plotting import pyplot, save
from klgrad.rewards import accuracy_reward_name
from klgrad.runlock import run_lock
from klgrad.threads import cpu_threads
from klgrad.trainer import latest_checkpoint, load_data, read_jsonl, reference_path, reward_specs, train
from klgrad.trainer.setup import resolve_device

METHODS: tuple[str, ...] = ("none", "k1_as_loss", "k2_as_loss", "k3_as_loss", "k1_in_reward")
EQUIVALENCE_MARGIN = 0.1
"""δ of "k1_as_loss ≈ none" in nats of final KL(π‖π_ref), stated before any run (``--margin``). A margin taken from
the same runs, such as ½·|KL_none − KL_k2|, would judge runs by a margin they set: on the discovery task it comes
to ±1 nat, as wide as the effect regularisation has there."""


COLORS = {
    "none": "#555555",
    "k1_as_loss": "#9e9e9e",
    "k2_as_loss": "#808000",
    "k3_as_loss": "firebrick",
    "k1_in_reward": "royalblue",
}
FINAL_KEYS = (
    "greedy_accuracy",
    "sampled_accuracy",
    "exact_kl",
    "stepwise_kl",
    "sampled_k1",
    "sampled_k2",
    "sampled_k3",
    "logp_gap",
    "logp_gap_abs",
    "reward_std_in_group",
    "batch_kl_k1",
    "reward_mean",
    "J",
    "J_star",
    "kl_to_optimum",
    "forward_kl",
    "kl_to_optimum_sampled",
    "forgetting_reverse_kl",
    "forgetting_forward_kl",
)
KL_LABELS = {
    "exact_kl": "exact",
    "stepwise_kl": "sampled, stepwise (exact next-token KLs summed along samples)",
    "sampled_k1": "sampled k1",
}
KL_AXIS_LABELS = {"exact_kl": "exact", "stepwise_kl": "sampled, stepwise", "sampled_k1": "sampled k1"}
"""Short forms of :data:`KL_LABELS` for a figure's axis (the long ones do not fit its width)."""
OBJECTIVE_KEYS = ("J", "J_star", "kl_to_optimum")
"""Final metrics read from a run's ``objective`` dict."""


def final_value(run: dict, key: str):
    """A run's final metric ``key``: top level, or inside ``objective`` for :data:`OBJECTIVE_KEYS` (None if
    absent)."""
    if key in OBJECTIVE_KEYS:
        return (run.get("objective") or {}).get(key)
    return run.get(key)


def method_overrides(method: str, level: str, beta: float) -> dict:
    """Config overrides that make one method of the comparison: a klgrad head at ``level``, a user's
    ``package.module:name``, or a framework preset id (``trl/grpo-k3``), which brings its own ``kl.level``,
    ``kl.form`` and ``kl.aggregation`` (:func:`klgrad.audit.framework_head.preset_settings`; ``level`` does not
    apply)."""
    if is_preset_id(method):  # an unknown id: a ValueError with the close matches
        settings = preset_settings(find_preset(method))
        return {"kl.head": method, "kl.beta": beta, **{f"kl.{k}": v for k, v in settings.items()}}
    if method == "none":
        return {"kl.head": "none", "kl.beta": beta, "kl.form": "decoupled", "kl.level": level}
    if method == "k1_in_reward":
        return {
            "kl.head": "k1_in_reward",
            "kl.beta": beta,
            "kl.form": "combined",
            "kl.level": "token_to_go" if level == "token" else level,
        }
    if method in ("k1_as_loss", "k2_as_loss", "k3_as_loss"):
        return {"kl.head": method, "kl.beta": beta, "kl.form": "decoupled", "kl.level": level}
    if ":" in method:  # a user's head, package.module:name: in the reward when its style says so, else a loss
        from klgrad.kl import get_kl_head

        if get_kl_head(method).style == "in_reward":
            return {**method_overrides("k1_in_reward", level, beta), "kl.head": method}
        return {"kl.head": method, "kl.beta": beta, "kl.form": "decoupled", "kl.level": level}
    raise ValueError(
        f"unknown method {method!r}; choose from {METHODS}, a head's 'package.module:name' or a framework preset id"
    )


@torch.no_grad()
def final_kl(
    cfg: Config,
    run_dir: Path,
    n_prompts: int,
    samples: int,
    *,
    optimum_ref_samples: int = 0,
    forgetting_samples: int = 0,
) -> dict:
    """Exact KL (tree) and sampled k1/k2/k3 of the run's final policy vs its reference, held-out prompts.

    Longer answers are measured on the run's device (``model.device``: a GPU run's final numbers on its GPU);
    short ones, enumerated, on the CPU.

    The reference is the one the run was regularised towards at its end: the checkpoint's ``ref.safetensors``
    when the run resets its reference (``kl.reset_ref_every``; the trainer saves it then), else the starting
    model (a LoRA run's policy: the starting model with its final adapter merged). Both numbers are of
    KL(π‖π_ref) between the full distributions at the sampling temperature, so the sampled estimates draw from
    the full policy (no top-p); ``rollout.top_p < 1`` is refused with a KL head anyway
    (:class:`klgrad.config.Config`), and the tree KL has no notion of truncation.

    For short answers (``rollout.max_new_tokens`` ≤ 10) with β = ``kl.beta`` > 0 (every method of a comparison
    has the grid's β, ``none`` included), ``objective`` holds the exact J_β, J* and KL(π‖π*) of the final policy
    against the same reference on the same prompts (:func:`klgrad.exact.objective.exact_objective`;
    one enumeration gives it and the exact KL).

    For longer answers ``stepwise_kl_per_prompt`` holds each prompt's mean stepwise KL (the held-out prompts in
    order), for a per-prompt comparison with ``klgrad regime``'s predicted fixed points.

    ``forward_kl`` is KL(π_ref‖π) beside it: from the same enumeration for short answers, else the stepwise sum
    along ``samples`` reference samples per prompt (``forward_kl_se``). Optional, for long grids
    (:mod:`klgrad.exact.estimators`): ``optimum_ref_samples`` > 0 estimates KL(π‖π*) from samples with log Z from
    that many reference samples per prompt (``objective_sampled``, ``kl_to_optimum_sampled``);
    ``forgetting_samples`` > 0 measures both KLs on the shipped general chat prompts (``forgetting``).
    """
    from klgrad.models import load_model_and_tokenizer
    from klgrad.rollout.encoding import encode_prompts, uses_chat
    from klgrad.rollout.samplers import KlgradSampler
    from klgrad.trainer.checkpoints import latest_checkpoint, load_lora_policy, load_weights
    from klgrad.trainer.evaluation import objective_on, reference_log_ratios

    model_dir = reference_path(cfg)
    short = cfg.rollout.max_new_tokens <= 10  # short answers: the response tree is small
    device = torch.device("cpu") if short else resolve_device(cfg.model.device, 1)
    if cfg.model.lora_rank:  # a LoRA run: the base with the final adapter merged, against the base itself
        policy, tok = load_lora_policy(run_dir, cfg, device=device)
        ref, _ = load_model_and_tokenizer(model_dir, device=device)
    else:
        policy, tok = load_model_and_tokenizer(model_dir, device=device)
        ref, _ = load_model_and_tokenizer(model_dir, device=device)
        load_weights(latest_checkpoint(run_dir), policy, ref)  # the reference the run ended with
    policy.eval()
    ref.eval()
    _, heldout = load_data(cfg)
    prompts = [e.prompt for e in heldout[:n_prompts]]
    ids, mask = (x.to(device) for x in encode_prompts(tok, prompts, chat=uses_chat(cfg.data.prompt_format, tok)))
    out: dict = {}
    tau = cfg.rollout.temperature
    if short and cfg.kl.beta > 0:
        obj = objective_on(policy, ref, tok, heldout[:n_prompts], reward_specs(cfg), cfg)
        out.update(exact_kl=obj["kl"], exact_kl_pruned_mass=obj["pruned_mass_max"], exact_kl_nodes=obj["nodes"])
        out.update(objective=obj, forward_kl=obj["kl_forward"])
    elif short:  # β = 0: no objective to judge, the KL alone
        rows = [ids[i][mask[i]].tolist() for i in range(len(prompts))]
        tk = tree_kl(
            policy,
            ref,
            rows,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            prune=PRUNE,
        )
        out.update(exact_kl=tk["kl"], exact_kl_pruned_mass=tk["pruned_mass"], exact_kl_nodes=tk["nodes"])
        out["forward_kl"] = tk["forward_kl"]
    gen = torch.Generator().manual_seed(12345)
    sampled = KlgradSampler(tok.eos_token_id, tok.pad_token_id).generate(
        policy,
        ids,
        mask,
        group_size=samples,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        generator=gen,
    )
    log_ratios = reference_log_ratios(sampled, ref, ids.shape[1], cfg.rollout.temperature).cpu()  # (P·samples,)
    out.update({f"sampled_{k}": v for k, v in sampled_kl_estimates(log_ratios).items()})
    if "exact_kl" not in out:  # too long to enumerate: the stepwise estimate on the same samples
        steps = stepwise_kl(
            policy,
            ref,
            sampled.input_ids,
            sampled.attention_mask,
            ids.shape[1],
            sampled.response_mask,
            cfg.rollout.temperature,
        )  # (P·samples,)
        prompt_of = torch.arange(len(prompts)).repeat_interleave(samples)  # groups are contiguous
        mean, se = clustered_mean_se(steps, prompt_of)
        out.update(stepwise_kl=mean, stepwise_kl_se=se)
        out["stepwise_kl_per_prompt"] = steps.view(len(prompts), samples).mean(1).tolist()  # prompt order
        out["sampled_k1_se"] = clustered_mean_se(log_ratios.double(), prompt_of)[1]
        fwd = stepwise_mean_se(ref, policy, tok, ids, mask, samples, cfg.rollout.max_new_tokens, tau, seed=54321)
        out["forward_kl"], out["forward_kl_se"] = fwd  # KL(π_ref‖π) along reference samples
    examples, specs = heldout[:n_prompts], reward_specs(cfg)
    out.update(
        optional_final_metrics(policy, ref, tok, examples, specs, cfg, samples, optimum_ref_samples, forgetting_samples)
    )
    return out


def run_final_metrics(run_dir: Path) -> dict:
    """Final numbers of one finished run from its files (see module docstring)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    tail = [r for r in records if "reward/mean" in r][-10:]

    def tail_mean(k: str) -> float:
        return sum(r[k] for r in tail) / len(tail)

    return {
        "greedy_accuracy": evals[-1]["eval/greedy_accuracy"],
        "sampled_accuracy": evals[-1].get("eval/sampled_accuracy"),
        "reference_greedy_accuracy": evals[0]["eval/greedy_accuracy"],
        "logp_gap": tail_mean("kl/logp_gap"),
        "logp_gap_abs": tail_mean("kl/logp_gap_abs"),
        "reward_std_in_group": tail_mean("reward/std_in_group"),
        "batch_kl_k1": tail_mean("kl/k1"),
        "reward_mean": tail_mean("reward/mean"),
    }


FinalHook = Callable[[Config, Path], dict]
"""A downstream evaluation of a finished run, ``hook(cfg, run_dir) -> dict``: called while the run's weights
still exist (before ``--no-checkpoints`` deletes them), its dict stored in final.json under the hook's name."""


def run_steps_done(run_dir: Path) -> tuple[int, bool]:
    """(steps the run's summary.json records, whether ``train.stop_when`` stopped it); (0, False) when none."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return 0, False
    s = json.loads(path.read_text())
    return int(s.get("steps", 0)), bool(s.get("stopped"))


def append_provenance(run_dir: Path, entry: dict) -> None:
    """One line of ``run_dir/provenance.jsonl``: which machine and revision trained which steps of the run."""
    run_dir.mkdir(parents=True, exist_ok=True)  # a run's first call writes its line before training creates it
    with (run_dir / "provenance.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def close_provenance(run_dir: Path, to_step: int) -> None:
    """Set the last line's ``to_step`` (written as None when its call started training), atomically: a call killed
    mid-run, even by SIGKILL, leaves its line with ``to_step`` None, and the steps it kept end where the next
    line's ``from_step`` (the checkpoint it resumed from) begins."""
    path = run_dir / "provenance.jsonl"
    entries = read_jsonl(path)
    entries[-1] = {**entries[-1], "to_step": to_step, "done_at": now()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    os.replace(tmp, path)


def ran_on(run_dir: Path) -> list[str]:
    """The machines (:func:`~klgrad.compare.provenance.machine_label`) that trained the run, in order, once each."""
    labels = [machine_label(e["machine"]) for e in read_jsonl(run_dir / "provenance.jsonl")]
    return list(dict.fromkeys(labels))


def ensure_run(
    cfg: Config,
    steps: int,
    *,
    exact_prompts: int,
    estimate_samples: int,
    keep_checkpoints: bool,
    hooks: Mapping[str, FinalHook],
    provenance: dict,
    extras: dict | None = None,
    nominal_beta: float | None = None,
) -> dict:
    """Bring one run of the grid to ``steps`` and return its final.json (``extras``: :func:`final_kl`'s optional
    metrics; ``nominal_beta``: the grid's β the final objective J_β is measured at when the run trains at a scaled
    ``kl.beta``, :mod:`klgrad.compare.beta_scale`; final.json records the trained one as ``kl_beta``).

    A run finished at ``steps`` (or stopped by ``train.stop_when``) with final.json is read back. One finished at
    fewer steps is extended: its final.json is kept as ``final.stepN.json`` and training resumes from its last
    checkpoint with ``train.steps`` = ``steps`` (refused when ``--no-checkpoints`` deleted it). An interrupted run
    resumes from its newest periodic checkpoint. Then, in this order: the final metrics, each hook (weights still
    there), final.json (written atomically), and only then the checkpoints are deleted (``keep_checkpoints``
    False). ``provenance`` (machine, revision) is appended to the run's provenance.jsonl before training starts
    (``to_step`` None) and closed with the last step trained: a killed call's machine is on record too.
    """
    run_dir = Path(cfg.train.out_dir)
    done = run_dir / "final.json"
    before, stopped = run_steps_done(run_dir)
    finished = before >= steps or stopped
    if done.is_file() and finished:
        return json.loads(done.read_text())
    if done.is_file():  # finished at fewer steps: extend it
        if latest_checkpoint(run_dir) is None:
            raise ValueError(
                f"{run_dir}: cannot extend from {before} to {steps} steps: it has no checkpoint (deleted by "
                "--no-checkpoints); rerun it or keep checkpoints"
            )
        done.rename(run_dir / f"final.step{before}.json")
    if not finished:
        ckpt = latest_checkpoint(run_dir)
        start = 0 if ckpt is None else int(ckpt.name.removeprefix("step_"))  # where training resumes
        append_provenance(run_dir, {**provenance, "from_step": start, "to_step": None, "at": now()})
        train(cfg, resume=(run_dir / "metrics.jsonl").exists(), progress=False)
        close_provenance(run_dir, run_steps_done(run_dir)[0])
    measured = cfg if nominal_beta is None else with_beta(cfg, nominal_beta)  # J_β at the grid's β
    with cpu_threads(cfg.train.threads):  # as training shares the CPU with other klgrad processes, so do these
        final = {
            **run_final_metrics(run_dir),
            **final_kl(measured, run_dir, exact_prompts, estimate_samples, **(extras or {})),
        }
        for name, hook in hooks.items():  # downstream evaluations: the weights are still there
            final[name] = hook(cfg, run_dir)
    final["kl_beta"] = cfg.kl.beta
    final["steps"], stop = run_steps_done(run_dir)
    if stop:
        final["stopped"] = json.loads((run_dir / "summary.json").read_text())["stopped"]
    final["ran_on"] = ran_on(run_dir)
    final["final_on"] = machine_label(provenance["machine"])
    write_json(done, final)
    if not keep_checkpoints:  # its numbers are in final.json; a real model's weights are GBs a run
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return final


def with_beta(cfg: Config, beta: float) -> Config:
    """``cfg`` with ``kl.beta`` = ``beta``."""
    return dataclasses.replace(cfg, kl=dataclasses.replace(cfg.kl, beta=beta))


def extendable(run_dir: Path, steps: int) -> bool:
    """False only for a run whose final.json is of fewer than ``steps`` steps (not stopped by its criterion) and
    that has no checkpoint left to resume from."""
    if not (run_dir / "final.json").is_file():
        return True
    done, stopped = run_steps_done(run_dir)
    return done >= steps or stopped or latest_checkpoint(run_dir) is not None


def run_name(method: str, beta: float, seed: int) -> str:
    """The run's folder under ``runs/``: a preset id's ``/`` becomes ``+`` (one folder per run)."""
    return f"{method.replace('/', '+')}-beta{beta:g}-seed{seed}"


def grid_runs(record: dict) -> list[tuple[str, float, int]]:
    """Every (method, β, seed) of a grid's design (grid.json), in the grid's order."""
    return [(m, b, s) for b in record["betas"] for m in record["methods"] for s in range(record["seeds"])]


def collect_results(out_dir: Path, record: dict) -> list[dict]:
    """The final.json of every run of the design that is finished at the grid's steps (or stopped by its
    criterion), as summary rows ``{"method", "beta", "seed", **final}``; runs not there yet are left out."""
    results = []
    for m, b, s in grid_runs(record):
        path = out_dir / "runs" / run_name(m, b, s) / "final.json"
        if not path.is_file():
            continue
        final = json.loads(path.read_text())
        if final.get("steps", record["steps"]) >= record["steps"] or final.get("stopped"):
            results.append({"method": m, "beta": b, "seed": s, **final})
    return results


def claim_of(record: dict) -> Claim | None:
    p = record.get("primary")
    return None if p is None else Claim(p["a"], p["b"], p["kind"], p["metric"])


def convergence_series(out_dir: Path, record: dict, results: list[dict]) -> dict[str, MethodRuns]:
    """Method → its finished runs' series of the criterion's metric and of ``lr``, with their seeds, at the first
    β, for the primary hypothesis' two methods (every method without one)."""
    crit = ConvergenceCriterion(**record["convergence"])
    b = record["betas"][0]
    claim = claim_of(record)
    data = {}
    for m in [claim.a, claim.b] if claim else list(record["methods"]):
        seeds = sorted(r["seed"] for r in results if r["method"] == m and r["beta"] == b)
        runs = [read_jsonl(out_dir / "runs" / run_name(m, b, s) / "metrics.jsonl") for s in seeds]
        data[m] = MethodRuns(
            [metric_series(rs, crit.metric) for rs in runs], [metric_series(rs, "lr") for rs in runs], seeds
        )
    return data


def grid_convergence(data: dict[str, MethodRuns], record: dict) -> dict:
    """``summary.json``'s ``convergence``: the recorded criterion on :func:`convergence_series`'s runs (each
    method's record with its ``seeds``, the order of its ``deltas``); met when every method meets it.

    A grid whose seed count was amended decides the criterion once, at the amended count (``decided_at_seeds``):
    until every method has that many seeds ``met`` is None (not decided) and ``so_far`` holds the test on the
    seeds finished, ``{"met", "seeds"}``, an interim look that must not be read as the verdict (a criterion
    checked after every merge and declared met the first time it passes would be met by noise sooner or later).
    """
    crit = ConvergenceCriterion(**record["convergence"])
    by_method = {m: {**converged(d.series, d.lrs, crit), "seeds": d.seeds} for m, d in data.items()}
    met = bool(by_method) and all(v["met"] for v in by_method.values())
    out = {"criterion": crit.text(), "met": met, "steps": record["steps"], "parameters": crit.as_dict()}
    if record.get("amendments"):
        decide_at = allowed_seeds(record)
        seeds = min((len(d.seeds) for d in data.values()), default=0)
        out["decided_at_seeds"] = decide_at
        if seeds < decide_at:
            out["met"] = None
            out["so_far"] = {"met": met, "seeds": seeds}
    return {**out, "by_method": by_method}


def write_summary(out_dir: Path, record: dict) -> dict:
    """summary.json, summary.md and the figures of a grid from its record and its finished runs."""
    results = collect_results(out_dir, record)
    methods, betas = tuple(record["methods"]), tuple(record["betas"])
    seeds = len({r["seed"] for r in results})
    temperature = record["resolved_config"]["rollout"]["temperature"]
    summary = summarize(
        results,
        methods,
        betas,
        record["level"],
        record["steps"],
        seeds,
        record["margin"],
        temperature=temperature,
        primary=claim_of(record),
    )
    if record.get("amendments"):
        summary.update(amended_primary(summary, results, record))
    series = convergence_series(out_dir, record, results)
    summary["convergence"] = grid_convergence(series, record)
    summary["revision"] = record["revision"]["revision"]
    summary["registered_at"] = record["created"]
    summary["machines"] = sorted({m for r in results for m in r.get("ran_on", [])})
    if record.get("beta_scale") is not None:
        summary["beta_scale"] = record["beta_scale"]
        summary["effective_betas"] = effective_betas(record, results)
    write_json(out_dir / "summary.json", {**summary, "runs": results})
    (out_dir / "summary.md").write_text(summary_markdown(summary))
    present = [(r["method"], r["beta"], r["seed"]) for r in results]
    if present:
        plot_grid(out_dir, present, methods, betas, scaled=record.get("beta_scale") is not None)
        plot_frontier(results, out_dir / "frontier.png", methods)
        if any(d.series for d in series.values()):
            crit = ConvergenceCriterion(**record["convergence"])
            plot_convergence(series, summary["convergence"], crit, out_dir / "convergence.png", COLORS)
    return summary


def amended_primary(summary: dict, results: list[dict], record: dict) -> dict:
    """For a grid whose seed count was amended (:func:`klgrad.compare.design.amend_seeds`): its ``amendments``, the
    ``primary`` hypothesis decided on the registered seeds only (the registered test) and, as ``primary_all_seeds``,
    the same test on every seed (reported, not the verdict: it saw the seeds added after the registration), once an
    added seed has finished."""
    out: dict = {"amendments": record["amendments"], "registered_seeds": registered_seeds(record)}
    claim = claim_of(record)
    if claim is None or "primary" not in summary:
        return out
    registered = [r for r in results if r["seed"] < out["registered_seeds"]]
    if len(registered) == len(results):  # no added seed has finished: the summary's primary is the registered test
        return out
    b, margin = record["betas"][0], record["margin"]
    out["primary"] = primary_result(registered, claim, b, summary["kl_metric"], margin)
    out["primary_all_seeds"] = {
        **primary_result(results, claim, b, summary["kl_metric"], margin),
        "family": "every seed, after the amendments (reported; the verdict is the registered seeds')",
    }
    return out


def effective_betas(record: dict, results: list[dict]) -> dict[str, float]:
    """``{"method@β": β'}``: the ``kl.beta`` each (method, β) trained at, from its runs' final.json
    (``kl_beta``), else from grid.json's ``effective_betas`` (:mod:`klgrad.compare.beta_scale`)."""
    out = {f"{r['method']}@{r['beta']:g}": r["effective_beta"] for r in record.get("effective_betas", [])}
    for r in results:
        if r.get("kl_beta") is not None:
            out[f"{r['method']}@{r['beta']:g}"] = r["kl_beta"]
    return out


def beta_scale_markdown(summary: dict) -> list[str]:
    """The sentence under the table of a grid run with ``--beta-scale``: L̄ and what β' is, or nothing."""
    s = summary.get("beta_scale")
    if s is None:
        return []
    how = (
        f"measured once as the reference's mean response length over {s['samples']} samples of each of the first "
        f"{s['prompts']} training prompts (seed {s['seed']}, on the CPU)"
        if s.get("measured", True)
        else "given on the command line"
    )
    return [
        f"Same nominal strength (`--beta-scale {s['mode']}`): β' (the `kl.beta` a method trained at) = β·n_kl/n_pg, "
        "n = 1 for a token sum (`seq_mean_token_sum`, klgrad's sequence-level heads) and L̄ for a token mean "
        f"(`token_mean`, `seq_mean_token_mean`); L̄ = {s['mean_length']:.3f} tokens, {how}. J_β and KL to optimum "
        "are at the nominal β.",
        "",
    ]


def registration(record: dict) -> dict:
    """The summary.json a grid starts with, before any run: what it will decide and by which criterion."""
    crit = ConvergenceCriterion(**record["convergence"])
    return {
        "status": "registered; no result yet",
        "registered_at": record["created"],
        "revision": record["revision"]["revision"],
        "primary": record.get("primary"),
        "convergence": {
            "criterion": crit.text(),
            "met": None,
            "steps": record["steps"],
            "parameters": crit.as_dict(),
        },
        "runs": [],
    }


def check_claim(claim: Claim, methods: Sequence[str]) -> None:
    """A primary hypothesis must compare two of the grid's methods on ``kl`` or a final metric."""
    missing = [m for m in (claim.a, claim.b) if m not in methods]
    if missing or claim.a == claim.b:
        raise ValueError(f"--primary {claim.text}: needs two different methods of the grid {list(methods)}")
    if claim.metric != "kl" and claim.metric not in FINAL_KEYS:
        raise ValueError(f"--primary {claim.text}: metric {claim.metric!r} is not 'kl' or one of {list(FINAL_KEYS)}")


def run_compare(
    out_dir: Path,
    *,
    config: str | None = "configs/tiny_add.yaml",
    seeds: int = 5,
    steps: int = 60,
    betas: tuple[float, ...] = (0.5,),
    level: str = "token",
    methods: tuple[str, ...] = METHODS,
    exact_prompts: int = 20,
    estimate_samples: int = 16,
    progress: bool = True,
    extra_overrides: dict | None = None,
    keep_checkpoints: bool = True,
    margin: float = EQUIVALENCE_MARGIN,
    only_seeds: Sequence[int] | None = None,
    only_methods: Sequence[str] | None = None,
    primary: str | Claim | None = None,
    convergence: ConvergenceCriterion | None = None,
    final_hooks: Mapping[str, FinalHook] | None = None,
    revision: Revision | None = None,
    allow_dirty: bool = False,
    optimum_ref_samples: int = 0,
    forgetting_samples: int = 0,
    beta_scale: str | BetaScale | None = None,
) -> dict:
    """Run, resume or extend the grid, then write figure, frontier, summary.json and summary.md into ``out_dir``.

    Before any run, ``out_dir/grid.json`` records the design and the code revision
    (:mod:`klgrad.compare.design`; a continuation at another revision, or with another design, raises
    :class:`~klgrad.compare.design.GridMismatchError`), and a new grid gets a summary.json stating its
    ``primary`` hypothesis (``"A<B:METRIC"``, :mod:`klgrad.compare.claims`) and its convergence criterion
    (:mod:`klgrad.compare.convergence`) before any result. ``only_seeds`` runs that subset of ``range(seeds)``
    (seeds of one grid on several machines, merged by :func:`klgrad.compare.merge.merge_grids`); the summary
    covers every finished run of the design in ``out_dir``. ``only_methods`` likewise trains that subset of
    ``methods`` (the design, its record and every config's validation stay those of all ``methods``), so one
    seed's methods can run as separate processes on one machine and be merged.

    Runs checkpoint every max(1, steps // 10) steps (evaluate every max(1, steps // 3)) and keep only the newest
    checkpoint (``train.keep_checkpoints`` 1), so an interrupted run resumes mid-way; a larger ``steps`` than a
    finished grid's extends every run (:func:`ensure_run`; only ``train.steps`` changes: both periods stay those
    of the grid's first ``steps``, recorded as ``cadence_steps``); ``train.stop_when`` (a dotted override) stops
    a run on a stated criterion. ``final_hooks`` run on each finished run before its weights are deleted.

    Holds ``out_dir``'s lock (:mod:`klgrad.runlock`) from after the configs validate to the end, so a second
    compare into the same folder fails at once with :class:`~klgrad.runlock.RunLockedError`; each run then takes
    its own ``out_dir/runs/NAME`` lock inside :func:`~klgrad.trainer.train`. With ``keep_checkpoints=False`` a
    run's ``checkpoints/`` is deleted once its ``final.json`` is written (a finished run is then still skipped,
    but can no longer be extended). ``optimum_ref_samples``, ``forgetting_samples``: :func:`final_kl`'s optional
    metrics (0: off); a run whose ``final.json`` exists keeps the numbers it has.

    ``beta_scale`` (``"length"``, ``"length=L"`` or a :class:`~klgrad.compare.beta_scale.BetaScale`; None or
    ``"off"``: every run at β) trains each method at the same nominal strength, β' = β·n_kl/n_pg
    (:mod:`klgrad.compare.beta_scale`): L̄ is measured once (or reused from grid.json) and recorded there as
    ``beta_scale``, each (method, β)'s β' as ``effective_betas``; run folders and the summary keep the nominal β,
    the final objective J_β is measured at it, and the summary table states β'.
    """
    scale = parse_beta_scale(beta_scale) if isinstance(beta_scale, str) or beta_scale is None else beta_scale
    claim = parse_claim(primary) if isinstance(primary, str) else primary
    if claim is not None:
        check_claim(claim, methods)
    run_seeds = list(range(seeds)) if only_seeds is None else sorted(set(only_seeds))
    if not set(run_seeds) <= set(range(seeds)):
        raise ValueError(f"only_seeds {run_seeds} are not all among the grid's seeds 0..{seeds - 1}")
    run_methods = list(methods) if only_methods is None else [m for m in methods if m in set(only_methods)]
    if only_methods is not None and (not only_methods or not set(only_methods) <= set(methods)):
        raise ValueError(f"only_methods {list(only_methods)} are not all among the grid's methods {list(methods)}")
    grid = [(m, b, s) for b in betas for m in methods for s in run_seeds]
    cadence = (read_grid(out_dir) or {}).get("cadence_steps", steps)  # the first session's steps
    base = {
        "train.steps": steps,
        "train.eval_every": max(1, cadence // 3),
        "train.save_every": max(1, cadence // 10),
        "train.keep_checkpoints": 1,
        "train.tensorboard": False,
        **(extra_overrides or {}),
    }
    cfgs, run_overrides = {}, {}
    for m, b, s in grid:  # validate every config before running anything
        run_dir = out_dir / "runs" / run_name(m, b, s)
        run_overrides[(m, b, s)] = {
            **base,
            **method_overrides(m, level, b),
            "train.seed": s,
            "train.out_dir": str(run_dir),
        }
        cfgs[(m, b, s)] = load_config(config, run_overrides[(m, b, s)])
    sampling_temperature(list(cfgs.values()))  # one temperature, or refused before anything is written
    check_logged(convergence, list(cfgs.values()))
    stuck = [str(c.train.out_dir) for c in cfgs.values() if not extendable(Path(c.train.out_dir), steps)]
    if stuck:
        raise ValueError(
            f"cannot extend to {steps} steps: {', '.join(stuck)} finished earlier and has no checkpoint left "
            "(--no-checkpoints); rerun those runs or keep checkpoints"
        )
    revision = revision or source_revision()
    pinned = check_pinned(revision, allow_dirty)
    machine = machine_record()
    new = {
        "revision": revision.as_dict(),
        "pinned": pinned,
        "created": now(),
        "config": config,
        "resolved_config": shared_config(to_dict(load_config(config, base))),
        "methods": list(methods),
        "seeds": seeds,
        "betas": list(betas),
        "level": level,
        "steps": steps,
        "cadence_steps": cadence,
        "overrides": dict(extra_overrides or {}),
        "margin": margin,
        "exact_prompts": exact_prompts,
        "estimate_samples": estimate_samples,
        "primary": None if claim is None else claim.as_dict(),
        "convergence": None if convergence is None else convergence.as_dict(),
    }
    new = json.loads(json.dumps(new))  # as grid.json will hold it (tuples as lists), so records compare equal
    with run_lock(out_dir):  # one writer per output folder (creates it)
        old = read_grid(out_dir)
        scale = settle_scale(scale, (old or {}).get("beta_scale"), next(iter(cfgs.values())))
        rows: list[dict] = []
        if scale is not None:  # each method at the same nominal strength: β' per (method, β)
            new["beta_scale"] = scale.as_dict()
            rows = [beta_row(m, b, cfgs[(m, b, run_seeds[0])], scale.mean_length) for b in betas for m in methods]
            for (m, b, s), over in run_overrides.items():
                eff = next(r["effective_beta"] for r in rows if r["method"] == m and r["beta"] == b)
                cfgs[(m, b, s)] = load_config(config, {**over, "kl.beta": eff})
        new["machine"] = machine  # this session's; every session's is in "sessions"
        new["session"] = {
            "at": new["created"],
            "machine": machine,
            "revision": revision.name,
            "pinned": pinned,
            "steps": steps,
            "seeds": run_seeds,
            "methods": run_methods,
        }
        has_runs = any((out_dir / "runs").glob("*/metrics.jsonl"))
        record = settle_design(old, new, has_runs, str(out_dir), allow_dirty)
        del record["session"]
        if scale is not None:  # the recorded rows, this invocation's added or updated
            mine = {(r["method"], r["beta"]) for r in rows}
            kept = [r for r in (old or {}).get("effective_betas", []) if (r["method"], r["beta"]) not in mine]
            record["effective_betas"] = kept + rows
        if record["convergence"] is None:
            record["convergence"] = ConvergenceCriterion().as_dict()
        write_json(out_dir / GRID_FILE, record)  # before any run
        if not (out_dir / "summary.json").exists():
            write_json(out_dir / "summary.json", registration(record))
        provenance = {"machine": machine, "revision": revision.name}
        todo = [(m, b, s) for m, b, s in grid if m in run_methods]
        bar = tqdm(todo, desc="klgrad compare", disable=not progress, dynamic_ncols=True)
        for m, b, s in bar:
            bar.set_postfix(run=f"{m} β={b:g} seed {s}")
            ensure_run(
                cfgs[(m, b, s)],
                steps,
                exact_prompts=exact_prompts,
                estimate_samples=estimate_samples,
                keep_checkpoints=keep_checkpoints,
                hooks=final_hooks or {},
                provenance=provenance,
                extras={"optimum_ref_samples": optimum_ref_samples, "forgetting_samples": forgetting_samples},
                nominal_beta=None if scale is None else b,
            )
        bar.close()
        return write_summary(out_dir, record)


def started_seeds(out_dir: Path, record: dict) -> list[int]:
    """The seeds with a run folder of the grid's methods and βs in ``out_dir/runs`` (finished or not)."""
    prefixes = [run_name(m, b, 0)[:-1] for b in record["betas"] for m in record["methods"]]
    runs = out_dir / "runs"
    found = set()
    for d in runs.iterdir() if runs.is_dir() else ():
        for pre in prefixes:
            tail = d.name[len(pre) :]
            if d.is_dir() and d.name.startswith(pre) and tail.isdigit():
                found.add(int(tail))
    return sorted(found)


def amend_grid(out_dir: Path, seeds: int, reason: str, revision: Revision | None = None) -> dict:
    """Declare that the grid in ``out_dir`` runs ``seeds`` seeds (:func:`klgrad.compare.design.amend_seeds`):
    grid.json gains the amendment, and summary.json (rewritten from the finished runs, or the registration when
    there are none yet) records it. Trains nothing; returns the new record."""
    with run_lock(out_dir):
        record = read_grid(out_dir)
        if record is None:
            raise ValueError(f"{out_dir} holds no {GRID_FILE}: not a klgrad compare grid")
        started = started_seeds(out_dir, record)
        name = (revision or source_revision()).name
        record = amend_seeds(record, seeds, reason, started, name, now())
        write_json(out_dir / GRID_FILE, record)
        if collect_results(out_dir, record):
            write_summary(out_dir, record)
        else:
            write_json(out_dir / "summary.json", {**registration(record), "amendments": record["amendments"]})
    return record


def paired_values(results: list[dict], a: str, b: str, beta: float, key: str) -> tuple[list[float], list[float]]:
    """Values of ``key`` for methods ``a`` and ``b`` at ``beta``, paired by seed (seeds where both have one)."""

    def by_seed(m: str) -> dict[int, float]:
        return {
            r["seed"]: final_value(r, key)
            for r in results
            if r["method"] == m and r["beta"] == beta and final_value(r, key) is not None
        }

    va, vb = by_seed(a), by_seed(b)
    seeds = sorted(va.keys() & vb.keys())
    return [va[s] for s in seeds], [vb[s] for s in seeds]


PREDICTIONS: tuple[tuple[str, str, str, str, str], ...] = (
    # (claim, kind, a, b, metric): "less" claims mean(a) < mean(b); "equivalent" claims a ≈ b. Metric "kl" is
    # the summary's KL (exact when the tree can be enumerated, else the stepwise sampled estimate).
    ("k1_as_loss ≈ none (no regularisation) on final KL", "equivalent", "k1_as_loss", "none", "kl"),
    ("k2_as_loss keeps KL below k3_as_loss", "less", "k2_as_loss", "k3_as_loss", "kl"),
    ("k2_as_loss keeps the log-prob gap below k3_as_loss", "less", "k2_as_loss", "k3_as_loss", "logp_gap"),
    (
        "k2_as_loss has lower reward std within groups than k3_as_loss",
        "less",
        "k2_as_loss",
        "k3_as_loss",
        "reward_std_in_group",
    ),
    # beyond the paper: heads with the exact reverse-KL gradient end closer to the optimum π* ∝ π_ref·e^{R/β} of
    # J_β than the biased k3 surrogate and than no KL (exact KL(π‖π*) on held-out prompts)
    ("k1_in_reward ends closer to π* than k3_as_loss", "less", "k1_in_reward", "k3_as_loss", "kl_to_optimum"),
    ("k1_in_reward ends closer to π* than none", "less", "k1_in_reward", "none", "kl_to_optimum"),
    ("k2_as_loss ends closer to π* than k3_as_loss", "less", "k2_as_loss", "k3_as_loss", "kl_to_optimum"),
    ("k2_as_loss ends closer to π* than none", "less", "k2_as_loss", "none", "kl_to_optimum"),
)
"""The predictions ``klgrad compare`` decides: the paper's four, then ours on the distance to the optimum (for
k2_as_loss the exact reverse-KL gradient holds at sequence and token_to_go level only; at token level, GRPO's,
it is a per-step surrogate, so that claim is tested there too but is not the theory's)."""


def claim_test(
    results: list[dict], claim: str, kind: str, a: str, b: str, key: str, beta: float, margin: float
) -> dict | None:
    """The paired test of one claim on final metric ``key`` (the unpaired Welch test beside it, unadjusted), or
    None when fewer than 2 seeds pair up."""
    xa, xb = paired_values(results, a, b, beta, key)
    if len(xa) < 2:
        return None
    if kind == "equivalent":
        test = paired_equivalent(xa, xb, margin)
        welch = welch_equivalent(xa, xb, margin)
    else:
        test = paired_less(xa, xb)
        welch = welch_less(xa, xb)
    return {
        "claim": claim,
        "metric": key,
        "a": a,
        "b": b,
        **test,
        "welch": {
            "test": welch["test"],
            "p_value": welch["p_value"],
            "verdict": welch["verdict"],
            "adjusted": False,  # its own p at α: outside the Holm family, never the verdict
        },
    }


def prediction_tests(
    results: list[dict],
    methods,
    beta: float,
    kl_key: str,
    margin: float = EQUIVALENCE_MARGIN,
    exclude: Claim | None = None,
):
    """The paired test of each prediction whose methods are in the grid, with the unpaired Welch test beside it;
    ``exclude`` (the grid's primary hypothesis) is left out when it is one of them.

    The equivalence claim "k1_as_loss ≈ none" is a paired TOST with the stated ``margin`` δ (nats of KL):
    "k1_as_loss's final KL is within ±δ of no KL's".
    """
    tests = []
    for claim, kind, a, b, metric in PREDICTIONS:
        if not {a, b} <= set(methods):
            continue
        key = kl_key if metric == "kl" else metric
        if exclude is not None and same_claim(exclude, kind, a, b, key, kl_key):
            continue
        test = claim_test(results, claim, kind, a, b, key, beta, margin)
        if test is not None:
            tests.append(test)
    return tests


def primary_result(results: list[dict], claim: Claim, beta: float, kl_key: str, margin: float) -> dict:
    """The primary hypothesis decided alone (:func:`~klgrad.compare.stats.decide` on a family of its own: one
    hypothesis, two for an equivalence), with its statement; ``verdict`` says so when it could not be tested."""
    key = kl_key if claim.metric == "kl" else claim.metric
    test = claim_test(results, claim.sentence(), claim.kind, claim.a, claim.b, key, beta, margin)
    stated = {**claim.as_dict(), "family": "primary (tested alone)"}
    if test is None:
        return {**stated, "metric": key, "verdict": "not tested: fewer than 2 seeds with both methods"}
    return {**stated, **decide([test])[0]}


def kl_metric(results: list[dict]) -> str:
    """The summary's KL(π‖π_ref): ``exact_kl`` (tree enumeration) when every run has it, else ``stepwise_kl``
    (exact next-token KLs summed along samples) when every run has it, else the sampled k1."""
    for key in ("exact_kl", "stepwise_kl"):
        if results and all(r.get(key) is not None for r in results):
            return key
    return "sampled_k1"


LOGGED_BY = {"kl/stepwise": "train.log_stepwise_kl"}
"""Metrics a run logs only when a setting asks for it: the convergence criterion can be stated on them only then."""


def check_logged(convergence: ConvergenceCriterion | None, cfgs: list[Config]) -> None:
    """Refuse (before anything is written) a convergence criterion on a metric the runs will not log."""
    setting = None if convergence is None else LOGGED_BY.get(convergence.metric)
    if setting is None:
        return
    section, field = setting.split(".")
    if not all(getattr(getattr(c, section), field) for c in cfgs):
        raise ValueError(
            f"--converge-metric {convergence.metric} is logged only with {setting}: true; pass --{setting} true"
        )


def sampling_temperature(cfgs: list[Config]) -> float:
    """The one rollout temperature of a grid's runs: every KL of the summary is between the full distributions at
    it (:func:`final_kl`), so the summary states it; runs at different temperatures are not one grid."""
    temps = {c.rollout.temperature for c in cfgs}
    if len(temps) != 1:
        raise ValueError(f"a grid's runs must share rollout.temperature, got {sorted(temps)}")
    return temps.pop()


def summarize(
    results: list[dict],
    methods,
    betas,
    level: str,
    steps: int,
    seeds: int,
    margin: float = EQUIVALENCE_MARGIN,
    temperature: float | None = None,
    primary: Claim | None = None,
) -> dict:
    """Per (method, β): mean ± 95% CI of every final metric; the paper's predictions at the first β.
    ``temperature`` is the sampling temperature τ every KL is taken at (None: not recorded). With a ``primary``
    hypothesis, it is decided alone (``primary``) and the other predictions form the secondary Holm family
    (each marked ``"family": "secondary"``); without one every prediction is in one family."""
    table: dict = {}
    for b in betas:
        for m in methods:
            rows = [r for r in results if r["method"] == m and r["beta"] == b]
            table[f"{m}@{b:g}"] = {
                k: dict(zip(("mean", "ci95"), mean_ci([final_value(r, k) for r in rows]), strict=True))
                for k in FINAL_KEYS
                if rows and all(final_value(r, k) is not None for r in rows)
            }
    b = betas[0]
    kl_key = kl_metric(results)
    preds = decide(prediction_tests(results, methods, b, kl_key, margin, exclude=primary))
    out: dict = {}
    if primary is not None:
        out["primary"] = primary_result(results, primary, b, kl_key, margin)
        preds = [{**p, "family": "secondary"} for p in preds]
    return {
        **out,
        "level": level,
        "steps": steps,
        "seeds": seeds,
        "betas": list(betas),
        "kl_metric": kl_key,
        "temperature": temperature,
        "table": table,
        "predictions": preds,
    }


def plain_answer(summary: dict) -> list[str]:
    """A few plain sentences: how far each method ended from the reference, and what each prediction got."""
    b = summary["betas"][0]
    key = summary["kl_metric"]
    label = f"KL(π‖π_ref) {temperature_phrase(summary)}, {KL_LABELS[key]}"
    kls = []
    for name, row in summary["table"].items():
        method, beta = name.rsplit("@", 1)
        if float(beta) == b and key in row:
            kls.append((row[key]["mean"], method))
    opt = []
    for name, row in summary["table"].items():
        method, beta = name.rsplit("@", 1)
        if float(beta) == b and "kl_to_optimum" in row:
            opt.append((row["kl_to_optimum"]["mean"], method))
    out = []
    if kls:
        ranked = ", ".join(f"{m} {v:.3f}" for v, m in sorted(kls))
        out.append(
            f"**Distance to the reference** (final {label} on held-out prompts, mean over seeds, β = {b:g}, "
            f"closest first): {ranked}."
        )
    if opt:
        ranked = ", ".join(f"{m} {v:.3f}" for v, m in sorted(opt))
        out.append(
            f"**Distance to the optimum** π* ∝ π_ref·exp(R/β) of J_β = E[R] − β·KL (exact KL(π‖π*) "
            f"{temperature_phrase(summary)}, closest first): {ranked}."
        )
    out.append("")
    primary = [summary["primary"]] if "p_adjusted" in summary.get("primary", {}) else []
    for p in primary + summary["predictions"]:
        lo, hi = p["ci95"]
        d = (
            f"mean difference {p['mean_difference']:+.4f} [{lo:+.4f}, {hi:+.4f}], {p['a']} below {p['b']} in "
            f"{p['n_negative']} of {p['n_pairs']} seeds, paired p = {p['p_adjusted']:.3g} (Holm)"
        )
        if p["verdict"] == "opposite":
            what = (
                "**the opposite holds**: they differ"
                if p["kind"] == "equivalent"
                else f"**the opposite holds**: {p['b']} ends lower than {p['a']}"
            )
        elif p["verdict"] == "supported":
            what = "**supported**"
        else:
            what = "**not resolved at this sample size**"
        tag = "primary, tested alone" if p in primary else p["metric"]
        d = d.replace(" (Holm)", "") if p in primary else d
        out.append(f"- *{p['claim']}* ({tag}): {what}; {d}.")
    return out


def temperature_phrase(summary: dict) -> str:
    """ "at τ = 0.7" (the sampling temperature every KL of the summary is taken at), or that it was not recorded."""
    t = summary.get("temperature")
    return "at the sampling temperature (not recorded)" if t is None else f"at τ = {t:g}"


def holm_family_size(predictions: list[dict]) -> int:
    """m of the summary's Holm family (:func:`klgrad.compare.stats.decide`): one hypothesis per ordering claim,
    two per equivalence claim (TOST and difference)."""
    return sum(2 if p["kind"] == "equivalent" else 1 for p in predictions)


def family_word(summary: dict) -> str:
    """ "secondary " when the summary has a primary hypothesis (tested alone), else ""."""
    return "secondary " if "primary" in summary else ""


def primary_markdown(summary: dict) -> list[str]:
    """The pre-registered primary hypothesis and its verdict (decided alone), or nothing."""
    p = summary.get("primary")
    if p is None:
        return []
    lines = [
        "## The primary hypothesis (pre-registered, tested alone)",
        "",
        f"Stated before any run ({summary.get('registered_at', 'time not recorded')}): *{p['claim']}* "
        f"(`{p['text']}`, metric `{p['metric']}`). Decided by the paired test alone, not adjusted for the secondary "
        "claims below.",
        "",
    ]
    if "p_adjusted" not in p:
        return [*lines, f"**{p['verdict']}**.", "", *amendments_markdown(summary)]
    rows = [("registered seeds" if summary.get("amendments") else "all", p)]
    if "p_adjusted" in summary.get("primary_all_seeds", {}):
        rows.append(("every seed (not the verdict)", summary["primary_all_seeds"]))
    table = [
        "| seeds | claim | metric | mean d [95% CI] | d < 0 in | paired p | sign-flip p | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, q in rows:
        lo, hi = q["ci95"]
        table.append(
            f"| {label} | {q['claim']} | {q['metric']} | {q['mean_difference']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
            f"{q['n_negative']}/{q['n_pairs']} | {q['p_adjusted']:.3g} | {q['p_sign_flip']:.3g} | **{q['verdict']}** |"
        )
    return [*lines, *table, "", *amendments_markdown(summary)]


def amendments_markdown(summary: dict) -> list[str]:
    """The grid's seed-count amendments (when, from how many seeds to how many, which had started, why)."""
    amendments = summary.get("amendments") or []
    if not amendments:
        return []
    lines = [
        f"**Amendments** (the primary hypothesis is decided on the {summary['registered_seeds']} registered seeds):",
        "",
    ]
    for a in amendments:
        started = ", ".join(str(s) for s in a["seeds_started"]) or "none"
        lines.append(
            f"- {a['at']} (klgrad {a['revision']}): seeds {a['seeds_from']} → {a['seeds_to']}, declared when seeds "
            f"{started} had started. {a['reason']}"
        )
    return [*lines, ""]


def convergence_markdown(summary: dict) -> list[str]:
    """The convergence criterion and whether the grid met it, or nothing when the summary has no record."""
    c = summary.get("convergence")
    if c is None:
        return []
    met = {True: "**met**", False: "**not met**", None: "not decided yet"}[c["met"]]
    if c.get("so_far"):
        so_far = "passes" if c["so_far"]["met"] else "fails"
        met += (
            f" (decided once, at {c['decided_at_seeds']} seeds, as the grid's amendment states; on the "
            f"{c['so_far']['seeds']} seeds finished so far the test {so_far}, an interim look, not the verdict)"
        )
    lines = [
        "## Convergence",
        "",
        f"Criterion (stated before the runs): {c['criterion']}. At {c['steps']} steps: {met}.",
        "",
    ]
    by = c.get("by_method") or {}
    if by:
        lines += [
            "| method | seeds | moved | se | logged densely | lr decays | stopped before the decay (moved, se) | met "
            "| seeds the se bound needs (end; before the decay) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m, v in by.items():
            before = v.get("before_decay")
            early = (
                "—" if before is None else f"{before['met']} ({_num(before['moved'], '+.4g')}, {_num(before['se'])})"
            )
            need = _num(v.get("seeds_needed"), "d")
            if before is not None:
                need += f"; {_num(before.get('seeds_needed'), 'd')}"
            lines.append(
                f"| {m} | {v['n']} | {_num(v['moved'], '+.4g')} | {_num(v['se'])} | {v['dense']} | {v['lr_decays']} "
                f"| {early} | {v['met']} | {need} |"
            )
        lines += [
            "",
            "The last column projects the seeds at which the se would reach its bound if the seeds' spread stayed "
            "what these show (n·(se/bound)²; a planning figure, not a test). `convergence.png` shows each test.",
            "",
        ]
    return lines


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "—" if x is None else format(x, fmt)


def summary_markdown(summary: dict) -> str:
    preds = summary["predictions"]
    n_min = min((p["n_pairs"] for p in preds), default=0)
    normality = (
        f" With {n_min} seeds the exact sign-flip p cannot go below 2/2^{n_min} = {2 / 2**n_min:.3g} ≥ α, so a "
        "verdict here rests on the t-test's normality."
        if preds and 2 / 2**n_min >= preds[0].get("alpha", 0.05)
        else ""
    )
    lines = [
        f"# klgrad compare — level `{summary['level']}`, {summary['steps']} steps, {summary['seeds']} seeds",
        "",
        *plain_answer(summary),
        "",
        "## Final metrics",
        "",
        f"Mean ± 95% CI over seeds (t interval). Every KL (exact, stepwise, sampled k1 and k3, KL to optimum, the KL "
        f"in J_β) is between the full next-token distributions {temperature_phrase(summary)}, the sampling "
        "temperature of the runs.",
        "",
        "| method @ β | greedy acc. | exact KL | stepwise KL | forward KL | sampled k1 | sampled k3 | log-prob gap | "
        "reward std in group | "
        "J_β | KL to optimum |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(row: dict, k: str) -> str:
        if k not in row:
            return "—"
        m, h = row[k]["mean"], row[k]["ci95"]
        return f"{m:.4f} ± {h:.4f}"

    scaled = summary.get("effective_betas")
    if scaled is not None:  # one more column: the β each method trained at
        lines[-2] = lines[-2].replace("| method @ β |", "| method @ β | β' (kl.beta) |")
        lines[-1] += "---|"
    for name, row in summary["table"].items():
        eff = "" if scaled is None else (f" {scaled[name]:.4g} |" if name in scaled else " — |")
        lines.append(
            f"| {name} |{eff} {cell(row, 'greedy_accuracy')} | {cell(row, 'exact_kl')} | {cell(row, 'stepwise_kl')} | "
            f"{cell(row, 'forward_kl')} | "
            f"{cell(row, 'sampled_k1')} | {cell(row, 'sampled_k3')} | {cell(row, 'logp_gap')} | "
            f"{cell(row, 'reward_std_in_group')} | {cell(row, 'J')} | {cell(row, 'kl_to_optimum')} |"
        )
    lines += [
        "",
        "J_β = E_π[R] − β·KL(π‖π_ref) and KL to optimum = KL(π‖π*) = (J* − J_β)/β, exact on the held-out prompts "
        "(short answers; J* is the best J_β any policy reaches). Forward KL = KL(π_ref‖π) on the same prompts: exact "
        "where the exact KL is, else stepwise along reference samples.",
        "",
        *beta_scale_markdown(summary),
        *primary_markdown(summary),
        *convergence_markdown(summary),
        "## The predictions" + (" (secondary)" if "primary" in summary else ""),
        "",
        "Paired by seed (runs of one seed share prompts and sampling uniforms): d = a − b per seed, paired t-test "
        f"(two-sided; TOST for an equivalence claim), p Holm-adjusted in one {family_word(summary)}family of the "
        f"{holm_family_size(preds)} "
        f"tested hypotheses of {len(preds)} claims (an equivalence claim brings two: TOST and difference). Beside "
        "it, for comparison only: the sign-flip p (two-sided, unadjusted; exact up to 20 seeds, beyond it from "
        f"{FLIP_DRAWS} seeded random sign patterns) and the unpaired Welch p (one-sided, "
        "or Welch TOST; unadjusted, outside the Holm family, not used for any verdict)." + normality,
        "",
        "| claim | metric | mean d [95% CI] | d < 0 in | paired p (Holm) | sign-flip p (unadj.) | Welch p (unadj.) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        lo, hi = p["ci95"]
        margin = f" (margin ±{p['margin']:.3g})" if "margin" in p else ""
        lines.append(
            f"| {p['claim']}{margin} | {p['metric']} | {p['mean_difference']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
            f"{p['n_negative']}/{p['n_pairs']} | {p['p_adjusted']:.3g} | {p['p_sign_flip']:.3g} | "
            f"{p['welch']['p_value']:.3g} | **{p['verdict']}** |"
        )
    return "\n".join(lines) + "\n"


def rewrite_summary(out_dir: Path, temperature: float | None = None) -> str:
    """Rewrite ``out_dir/summary.md`` from ``out_dir/summary.json`` with the current :func:`summary_markdown`;
    nothing is trained or re-decided (the verdicts and p-values are the ones summary.json holds).

    ``temperature`` supplies the sampling temperature to a summary.json written before it was recorded and is
    then written into it (after ``kl_metric``), with each Welch record marked ``"adjusted": false``; a recorded
    temperature must agree. Returns the markdown.
    """
    path = out_dir / "summary.json"
    summary = json.loads(path.read_text())
    recorded = summary.get("temperature")
    if recorded is None and temperature is None:
        raise ValueError(f"{path} does not record the sampling temperature: pass the runs' rollout.temperature")
    if recorded is not None and temperature is not None and recorded != temperature:
        raise ValueError(f"{path} records temperature {recorded}, not {temperature}")
    if recorded is None:
        filled: dict = {}
        for k, v in summary.items():
            filled[k] = v
            if k == "kl_metric":
                filled["temperature"] = temperature
        for p in filled["predictions"]:
            p["welch"].setdefault("adjusted", False)
        path.write_text(json.dumps(filled, indent=1))
        summary = filled
    md = summary_markdown(summary)
    (out_dir / "summary.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    """``python -m klgrad.compare.grid --rewrite-summary DIR [DIR ...] [--temperature T]``: :func:`rewrite_summary`."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m klgrad.compare.grid",
        description="Rewrite summary.md of finished klgrad compare grids from their summary.json (no training).",
    )
    ap.add_argument("--rewrite-summary", nargs="+", metavar="DIR", required=True, type=Path)
    ap.add_argument("--temperature", type=float, default=None, help="the runs' rollout.temperature, if not recorded")
    args = ap.parse_args(argv)
    for d in args.rewrite_summary:
        rewrite_summary(d, args.temperature)
        print(f"wrote {d / 'summary.md'}")
    return 0


PANELS = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "accuracy"),
    ("loss/kl", "KL loss"),
    ("kl/logp_gap", "log-prob diff mean(l − r)"),
    ("response/length", "response length"),
    ("entropy", "entropy"),
    ("reward/std_in_group", "reward std within groups"),
    ("loss/policy", "policy loss"),
    ("kl/k1", "sequence KL (k1)"),
)


EVAL_PANELS = (
    ("eval/kl_to_optimum", "held-out KL(π‖π*) to the optimum of J_β (exact)"),
    ("eval/exact_kl", "held-out KL(π‖π_ref) (exact)"),
    ("eval/greedy_accuracy", "held-out greedy accuracy"),
)
"""Panels of the held-out evaluations (every ``train.eval_every`` steps), drawn as points joined by lines."""


SAMPLED_KL_PANEL = ("eval/kl_k1", "held-out KL(π‖π_ref) (sampled k1)")
"""The held-out KL panel of runs that logged no exact KL (a real model's vocabulary is not enumerable)."""


def held_out_kl_panel(records: Iterable[dict]) -> tuple[str, str]:
    """The held-out KL(π‖π_ref) panel: the exact KL when any of ``records`` logged it, else the evaluation's
    sampled k1 (:data:`SAMPLED_KL_PANEL`)."""
    exact = EVAL_PANELS[1]
    return exact if any(r.get(exact[0]) is not None for r in records) else SAMPLED_KL_PANEL


def _run_records(out_dir: Path, method: str, beta: float, seeds: list[int]) -> list[list[dict]]:
    return [read_jsonl(out_dir / "runs" / run_name(method, beta, s) / "metrics.jsonl") for s in seeds]


def plot_grid(out_dir: Path, grid, methods, betas, scaled: bool = False) -> None:
    """The paper's panel layout (training batches: mean over seeds with a ±1 sd band, one colour per method,
    first β) and a row of held-out evaluations: distance to the optimum π*, to the reference, accuracy.

    ``scaled`` (a ``--beta-scale`` grid): each run logged its distance to the optimum of J_β' at its own β', so
    that panel says so (only the final KL(π‖π*) of the summary is at the grid's β)."""
    plt = pyplot()
    import numpy as np

    eval_panels = EVAL_PANELS
    if scaled:
        eval_panels = (
            ("eval/kl_to_optimum", "held-out KL(π‖π*) of J_β' at each run's own β' (not comparable across β')"),
            *EVAL_PANELS[1:],
        )

    b = betas[0]
    records = {m: _run_records(out_dir, m, b, [s for mm, bb, s in grid if mm == m and bb == b]) for m in methods}
    kl_panel = held_out_kl_panel(r for rs in records.values() for run in rs for r in run)
    eval_panels = (eval_panels[0], kl_panel, eval_panels[2])
    fig, axes = plt.subplots(4, 3, figsize=(14, 13))
    drawn: set[int] = set()  # panels that got data
    for m in methods:
        runs = records[m]
        if not runs:
            continue
        series = [[r for r in rs if "reward/mean" in r] for rs in runs]
        n = min(len(s) for s in series)
        steps = [r["step"] for r in series[0][:n]]
        logged = {k.removeprefix("reward/") for r in series[0][:1] for k in r}
        accuracy_key = "reward/" + (accuracy_reward_name(logged) or "accuracy")  # the task's accuracy reward
        for i, (ax, (key, label)) in enumerate(zip(axes.flat[:9], PANELS, strict=True)):
            key = accuracy_key if key == "reward/accuracy" else key
            if any(r.get(key) is not None for s in series for r in s[:n]):
                drawn.add(i)
            y = np.array([[r[key] if r.get(key) is not None else np.nan for r in s[:n]] for s in series])
            k = max(1, n // 25)  # light smoothing for readability (moving average over k steps)
            kernel = np.ones(k) / k
            mean = np.convolve(np.nanmean(y, 0), kernel, mode="valid")
            sd = np.convolve(np.nanstd(y, 0), kernel, mode="valid")
            xs = steps[k - 1 :]
            ax.plot(xs, mean, color=COLORS.get(m), lw=1.6, label=m)
            ax.fill_between(xs, mean - sd, mean + sd, color=COLORS.get(m), alpha=0.15)
            ax.set_title(label, fontsize=10)
            ax.grid(alpha=0.3)
        for ax, (key, label) in zip(axes.flat[9:], eval_panels, strict=True):
            evals = [{r["step"]: r[key] for r in rs if r.get(key) is not None} for rs in runs]
            common = sorted(set.intersection(*(set(e) for e in evals))) if evals else []
            if common:
                drawn.add(9 + eval_panels.index((key, label)))
                y = np.array([[e[t] for t in common] for e in evals])  # (seeds, evals)
                ax.errorbar(
                    common, y.mean(0), yerr=y.std(0), color=COLORS.get(m), marker="o", ms=4, lw=1.4, capsize=3, label=m
                )
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
    for i, ax in enumerate(axes.flat):
        if i not in drawn:  # e.g. the exact panels of a model whose vocabulary is too large to enumerate
            ax.cla()
            ax.set_title(ax.get_title() or (PANELS + eval_panels)[i][1], fontsize=10)
            ax.text(0.5, 0.5, "not measured in these runs", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in (axes.flat[0], axes.flat[9]):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"klgrad compare — mean over seeds ± 1 sd (β = {b:g}); training panels smoothed by a moving average; "
        "bottom row: held-out evaluations",
        fontsize=11,
    )
    fig.tight_layout()
    save(fig, out_dir / "comparison.png", dpi=110)


def plot_frontier(results: list[dict], path: Path, methods) -> None:
    """Final KL to the reference vs final held-out greedy accuracy: one point per run."""
    plt = pyplot()

    key = kl_metric(results)
    markers = ["o", "s", "^", "D", "v", "P"]
    betas = sorted({r["beta"] for r in results})
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for m in methods:
        for j, b in enumerate(betas):
            rs = [r for r in results if r["method"] == m and r["beta"] == b]
            ax.scatter(
                [r[key] for r in rs],
                [r["greedy_accuracy"] for r in rs],
                color=COLORS.get(m),
                marker=markers[j % len(markers)],
                s=45,
                alpha=0.85,
                label=f"{m} β={b:g}" if len(betas) > 1 else m,
            )
    ref_acc = results[0].get("reference_greedy_accuracy") if results else None
    if ref_acc is not None:
        ax.axhline(ref_acc, color="black", ls=":", lw=1, label="reference")
    ax.set_xlabel(f"final KL(π‖π_ref) on held-out prompts ({KL_AXIS_LABELS[key]})")
    ax.set_ylabel("final held-out greedy accuracy")
    ax.set_title("Reward–KL frontier (one point per run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
