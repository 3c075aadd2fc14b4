"""The runs of a grid and their provenance: bring one run to the grid's steps (train, resume or extend it), record
which machine and revision trained which of its steps, and read the finished ones back as summary rows.

A run is ``OUT/runs/NAME`` (:func:`klgrad.compare.design.run_name`), a ``klgrad train`` run directory with
``final.json`` once its final numbers are measured (:mod:`klgrad.compare.measurements`) and
``provenance.jsonl``, one line per call that trained it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from klgrad.compare.design import now, run_name, with_beta, write_json
from klgrad.compare.provenance import machine_label
from klgrad.compare.records import GridRecord, RunRow

if TYPE_CHECKING:
    from klgrad.compare.measurements import Measurement
    from klgrad.config import Config


def read_jsonl(path: Path) -> list[dict]:
    """A run's JSONL records (:func:`klgrad.trainer.read_jsonl`: a torn last line ends them)."""
    from klgrad.trainer import read_jsonl as read

    return read(path)


def logged_finals(run_dir: Path) -> dict:
    """The final numbers a run logged itself: its last held-out evaluation's accuracies, the reference's (step 0)
    greedy accuracy, and the mean over its last 10 steps of the training batches' log-prob gap, reward std within
    groups, k1 and mean reward."""
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


def train(cfg: Config, **kwargs) -> dict:
    """:func:`klgrad.trainer.train` (a name of this module, so a test can stand in for it)."""
    from klgrad.trainer import train as train_run

    return train_run(cfg, **kwargs)


def latest_checkpoint(run_dir: Path) -> Path | None:
    from klgrad.trainer import latest_checkpoint as latest

    return latest(run_dir)


def ensure_run(
    cfg: Config,
    steps: int,
    *,
    exact_prompts: int,
    estimate_samples: int,
    keep_checkpoints: bool,
    measurements: Sequence[Measurement],
    provenance: dict,
    nominal_beta: float | None = None,
) -> dict:
    """Bring one run of the grid to ``steps`` and return its final.json (``measurements``: what is measured on the
    final policy beyond :func:`logged_finals`, :func:`klgrad.compare.measurements.measure_run`; ``nominal_beta``:
    the grid's β the final objective J_β is measured at when the run trains at a scaled ``kl.beta``,
    :mod:`klgrad.compare.beta_scale`; final.json records the trained one as ``kl_beta``).

    A run finished at ``steps`` (or stopped by ``train.stop_when``) with final.json is read back. One finished at
    fewer steps is extended: its final.json is kept as ``final.stepN.json`` and training resumes from its last
    checkpoint with ``train.steps`` = ``steps`` (refused when ``--no-checkpoints`` deleted it). An interrupted run
    resumes from its newest periodic checkpoint. Then, in this order: the final measurements (weights still
    there), final.json (written atomically), and only then the checkpoints are deleted (``keep_checkpoints``
    False). ``provenance`` (machine, revision) is appended to the run's provenance.jsonl before training starts
    (``to_step`` None) and closed with the last step trained: a killed call's machine is on record too.
    """
    from klgrad.compare.measurements import measure_run
    from klgrad.threads import cpu_threads

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
            **logged_finals(run_dir),
            **measure_run(measured, run_dir, exact_prompts, estimate_samples, measurements, trained=cfg),
        }
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


def extendable(run_dir: Path, steps: int) -> bool:
    """False only for a run whose final.json is of fewer than ``steps`` steps (not stopped by its criterion) and
    that has no checkpoint left to resume from."""
    if not (run_dir / "final.json").is_file():
        return True
    done, stopped = run_steps_done(run_dir)
    return done >= steps or stopped or latest_checkpoint(run_dir) is not None


def collect_results(out_dir: Path, record: GridRecord) -> list[RunRow]:
    """The final.json of every run of the design that is finished at the grid's steps (or stopped by its
    criterion), as summary rows; runs not there yet are left out."""
    results = []
    for m, b, s in record.runs():
        path = out_dir / "runs" / run_name(m, b, s) / "final.json"
        if not path.is_file():
            continue
        final = json.loads(path.read_text())
        if final.get("steps", record.steps) >= record.steps or final.get("stopped"):
            results.append(RunRow(m, b, s, final))
    return results


def started_seeds(out_dir: Path, record: GridRecord) -> list[int]:
    """The seeds with a run folder of the grid's methods and βs in ``out_dir/runs`` (finished or not)."""
    prefixes = [run_name(m, b, 0)[:-1] for b in record.betas for m in record.methods]
    runs = out_dir / "runs"
    found = set()
    for d in runs.iterdir() if runs.is_dir() else ():
        for pre in prefixes:
            tail = d.name[len(pre) :]
            if d.is_dir() and d.name.startswith(pre) and tail.isdigit():
                found.add(int(tail))
    return sorted(found)


def run_seed(name: str) -> int | None:
    """The seed of a run folder named by :func:`klgrad.compare.design.run_name` (``METHOD-betaB-seedS``)."""
    _, sep, tail = name.rpartition("-seed")
    return int(tail) if sep and tail.isdigit() else None
