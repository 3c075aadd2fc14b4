"""``klgrad compare run``: the paper's KL comparison as a grid of real training runs, with paired statistics.

Methods (everything else equal, β shared): ``none``, ``k1_as_loss``, ``k2_as_loss``, ``k3_as_loss`` (the
paper's four, decoupled form at the chosen level) and ``k1_in_reward`` (combined form;
:func:`klgrad.compare.design.method_overrides`). Each (method, β, seed) is a ``klgrad train`` run in
``OUT/runs/``; finished runs are skipped, interrupted ones resumed, shorter ones extended
(:mod:`klgrad.compare.runs`).

Per run the final numbers are (:mod:`klgrad.compare.measurements`): held-out greedy accuracy (last evaluation),
the exact KL(π‖π_ref) on held-out prompts by prefix-tree enumeration (short-answer tasks; for longer answers the
stepwise estimate, exact next-token KLs summed along policy samples, with its standard error), the sampled
k1/k2/k3 estimates on the same prompts, the forward KL(π_ref‖π), and the mean over the last 10 steps of the
training-batch log-prob gap, reward std within groups and KL. For short-answer tasks ``objective`` also gives,
on the same prompts, the exact regularised objective J_β = E_π[R] − β·KL(π‖π_ref) of the final policy, its
optimum J* and the policy's distance to it, KL(π‖π*) = (J* − J_β)/β, so methods are compared on the objective
they all claim to optimise.

Design: runs of one seed draw the same prompts and the same sampling uniforms whatever their method
(:func:`klgrad.trainer.prompt_indices`, :func:`klgrad.trainer.rollout_uniforms`), so the seed is a block and every
prediction is decided on per-seed differences by a paired test (:mod:`klgrad.compare.hypotheses`), never by eye.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from klgrad.compare.beta_scale import beta_row, settle_scale
from klgrad.compare.convergence import ConvergenceCriterion
from klgrad.compare.design import (
    GRID_FILE,
    amend_seeds,
    method_overrides,
    now,
    read_grid,
    run_name,
    settle_design,
    shared_config,
    write_json,
)
from klgrad.compare.hypotheses import check_claim, check_logged
from klgrad.compare.options import RunOptions
from klgrad.compare.provenance import Revision, check_pinned, machine_record, source_revision
from klgrad.compare.records import GridRecord, Summary
from klgrad.compare.report import registration, write_summary
from klgrad.compare.runs import collect_results, ensure_run, extendable, started_seeds
from klgrad.runlock import run_lock


def sampling_temperature(cfgs: list) -> float:
    """The one rollout temperature of a grid's runs: every KL of the summary is between the full distributions at
    it, so the summary states it; runs at different temperatures are not one grid."""
    temps = {c.rollout.temperature for c in cfgs}
    if len(temps) != 1:
        raise ValueError(f"a grid's runs must share rollout.temperature, got {sorted(temps)}")
    return temps.pop()


def run_compare(options: RunOptions, *, revision: Revision | None = None) -> Summary:
    """Run, resume or extend the grid, then write figure, frontier, summary.json and summary.md into ``out``.

    Before any run, ``out/grid.json`` records the design and the code revision
    (:mod:`klgrad.compare.design`; a continuation at another revision, or with another design, raises
    :class:`~klgrad.compare.design.GridMismatchError`), and a new grid gets a summary.json stating its
    ``primary`` hypothesis (``"A<B:METRIC"``, :mod:`klgrad.compare.claims`) and its convergence criterion
    (:mod:`klgrad.compare.convergence`) before any result. ``only_seeds`` runs that subset of the seeds (seeds of
    one grid on several machines, merged by :func:`klgrad.compare.merge.merge_grids`); the summary covers every
    finished run of the design in ``out``. ``only_methods`` likewise trains that subset of ``methods`` (the
    design, its record and every config's validation stay those of all ``methods``).

    Runs checkpoint every max(1, steps // 10) steps (evaluate every max(1, steps // 3)) and keep only the newest
    checkpoint (``train.keep_checkpoints`` 1), so an interrupted run resumes mid-way; a larger ``steps`` than a
    finished grid's extends every run (:func:`~klgrad.compare.runs.ensure_run`; only ``train.steps`` changes: both
    periods stay those of the grid's first ``steps``, recorded as ``cadence_steps``); ``train.stop_when`` (a
    dotted override) stops a run on a stated criterion. ``measure`` names the final measurements beyond the core
    ones; a run whose final.json exists keeps the numbers it has.

    Holds ``out``'s lock (:mod:`klgrad.runlock`) from after the configs validate to the end, so a second compare
    into the same folder fails at once with :class:`~klgrad.runlock.RunLockedError`. With ``checkpoints`` False a
    run's ``checkpoints/`` is deleted once its ``final.json`` is written (it is then still skipped, but can no
    longer be extended).

    ``beta_scale`` trains each method at the same nominal strength, β' = β·n_kl/n_pg
    (:mod:`klgrad.compare.beta_scale`): L̄ is measured once (or reused from grid.json) and recorded there, each
    (method, β)'s β' as ``effective_betas``; run folders and the summary keep the nominal β, the final objective
    J_β is measured at it, and the summary table states β'.
    """
    d, out_dir = options.design, Path(options.out)
    if d.primary is not None:
        check_claim(d.primary, d.methods)
    run_seeds = list(range(d.seeds)) if options.only_seeds is None else sorted(set(options.only_seeds))
    if not set(run_seeds) <= set(range(d.seeds)):
        raise ValueError(f"only_seeds {run_seeds} are not all among the grid's seeds 0..{d.seeds - 1}")
    only = options.only_methods
    if only is not None and (not only or not set(only) <= set(d.methods)):
        raise ValueError(f"only_methods {list(only)} are not all among the grid's methods {list(d.methods)}")
    run_methods = list(d.methods) if only is None else [m for m in d.methods if m in set(only)]
    grid = [(m, b, s) for b in d.betas for m in d.methods for s in run_seeds]
    cadence = (read_grid(out_dir) or {}).get("cadence_steps", d.steps)  # the first session's steps
    base = {
        "train.steps": d.steps,
        "train.eval_every": max(1, cadence // 3),
        "train.save_every": max(1, cadence // 10),
        "train.keep_checkpoints": 1,
        "train.tensorboard": False,
        **d.overrides,
    }
    from klgrad.config import load_config, to_dict

    cfgs, run_overrides = {}, {}
    for m, b, s in grid:  # validate every config before running anything
        run_dir = out_dir / "runs" / run_name(m, b, s)
        run_overrides[(m, b, s)] = {
            **base,
            **method_overrides(m, d.level, b),
            "train.seed": s,
            "train.out_dir": str(run_dir),
        }
        cfgs[(m, b, s)] = load_config(d.config, run_overrides[(m, b, s)])
    sampling_temperature(list(cfgs.values()))  # one temperature, or refused before anything is written
    check_logged(d.convergence, list(cfgs.values()))
    stuck = [str(c.train.out_dir) for c in cfgs.values() if not extendable(Path(c.train.out_dir), d.steps)]
    if stuck:
        raise ValueError(
            f"cannot extend to {d.steps} steps: {', '.join(stuck)} finished earlier and has no checkpoint left "
            "(--no-checkpoints); rerun those runs or keep checkpoints"
        )
    revision = revision or source_revision()
    pinned = check_pinned(revision, options.allow_dirty)
    machine = machine_record()
    new = {
        "revision": revision.as_dict(),
        "pinned": pinned,
        "created": now(),
        "config": d.config,
        "resolved_config": shared_config(to_dict(load_config(d.config, base))),
        "methods": list(d.methods),
        "seeds": d.seeds,
        "betas": list(d.betas),
        "level": d.level,
        "steps": d.steps,
        "cadence_steps": cadence,
        "overrides": dict(d.overrides),
        "margin": d.margin,
        "exact_prompts": d.exact_prompts,
        "estimate_samples": d.estimate_samples,
        "primary": None if d.primary is None else d.primary.as_dict(),
        "convergence": None if d.convergence is None else d.convergence.as_dict(),
    }
    new = json.loads(json.dumps(new))  # as grid.json will hold it (tuples as lists), so records compare equal
    with run_lock(out_dir):  # one writer per output folder (creates it)
        old = read_grid(out_dir)
        scale = settle_scale(d.beta_scale, (old or {}).get("beta_scale"), next(iter(cfgs.values())))
        rows: list[dict] = []
        if scale is not None:  # each method at the same nominal strength: β' per (method, β)
            new["beta_scale"] = scale.as_dict()
            rows = [beta_row(m, b, cfgs[(m, b, run_seeds[0])], scale.mean_length) for b in d.betas for m in d.methods]
            for (m, b, s), over in run_overrides.items():
                eff = next(r["effective_beta"] for r in rows if r["method"] == m and r["beta"] == b)
                cfgs[(m, b, s)] = load_config(d.config, {**over, "kl.beta": eff})
        new["machine"] = machine  # this session's; every session's is in "sessions"
        new["session"] = {
            "at": new["created"],
            "machine": machine,
            "revision": revision.name,
            "pinned": pinned,
            "steps": d.steps,
            "seeds": run_seeds,
            "methods": run_methods,
        }
        if options.measure:  # what this session measured beyond the core (not part of the design)
            new["session"]["measure"] = [x.spec() for x in options.measure]
        has_runs = any((out_dir / "runs").glob("*/metrics.jsonl"))
        settled = settle_design(old, new, has_runs, str(out_dir), options.allow_dirty)
        del settled["session"]
        if scale is not None:  # the recorded rows, this invocation's added or updated
            mine = {(r["method"], r["beta"]) for r in rows}
            kept = [r for r in (old or {}).get("effective_betas", []) if (r["method"], r["beta"]) not in mine]
            settled["effective_betas"] = kept + rows
        if settled["convergence"] is None:
            settled["convergence"] = ConvergenceCriterion().as_dict()
        write_json(out_dir / GRID_FILE, settled)  # before any run
        record = GridRecord.from_json(settled)
        if not (out_dir / "summary.json").exists():
            write_json(out_dir / "summary.json", registration(record).to_json())
        provenance = {"machine": machine, "revision": revision.name}
        from tqdm.auto import tqdm

        todo = [(m, b, s) for m, b, s in grid if m in run_methods]
        bar = tqdm(todo, desc="klgrad compare", disable=not options.progress, dynamic_ncols=True)
        for m, b, s in bar:
            bar.set_postfix(run=f"{m} β={b:g} seed {s}")
            ensure_run(
                cfgs[(m, b, s)],
                d.steps,
                exact_prompts=d.exact_prompts,
                estimate_samples=d.estimate_samples,
                keep_checkpoints=options.checkpoints,
                measurements=options.measure,
                provenance=provenance,
                nominal_beta=None if scale is None else b,
            )
        bar.close()
        return write_summary(out_dir, record)


def amend_grid(out_dir: Path, seeds: int, reason: str, revision: Revision | None = None) -> GridRecord:
    """Declare that the grid in ``out_dir`` runs ``seeds`` seeds (:func:`klgrad.compare.design.amend_seeds`):
    grid.json gains the amendment, and summary.json (rewritten from the finished runs, or the registration when
    there are none yet) records it. Trains nothing; returns the new record."""
    with run_lock(out_dir):
        raw = read_grid(out_dir)
        if raw is None:
            raise ValueError(f"{out_dir} holds no {GRID_FILE}: not a klgrad compare grid")
        started = started_seeds(out_dir, GridRecord.from_json(raw))
        name = (revision or source_revision()).name
        raw = amend_seeds(raw, seeds, reason, started, name, now())
        write_json(out_dir / GRID_FILE, raw)
        record = GridRecord.from_json(raw)
        if collect_results(out_dir, record):
            write_summary(out_dir, record)
        else:
            reg = dataclasses.replace(registration(record), amendments=record.amendments)
            write_json(out_dir / "summary.json", reg.to_json())
    return record


if __name__ == "__main__":  # the module's former command line: a pointer, not a silent no-op
    raise SystemExit("python -m klgrad.compare.grid --rewrite-summary DIR is now: klgrad compare report DIR")
