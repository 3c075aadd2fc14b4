"""Long grids on tiny runs (the shipped tiny model, 4 prompts × 4 answers, 1–4 steps): a grid extended to more
steps, a grid killed mid-run and resumed from its periodic checkpoint, seeds run apart and merged, a grid refused
at another revision, the primary hypothesis on record before the first run, and a run stopped by its criterion."""

from __future__ import annotations

import json
import shutil

import pytest

import klgrad.compare.grid as grid_module
import klgrad.compare.report as report_module
import klgrad.compare.runs as runs_module
from klgrad.cli import main
from klgrad.compare.convergence import ConvergenceCriterion
from klgrad.compare.design import GridMismatchError
from klgrad.compare.grid import run_compare as run_grid
from klgrad.compare.measurements import Measurement
from klgrad.compare.merge import merge_grids
from klgrad.compare.options import RunOptions
from klgrad.compare.provenance import Revision, source_revision
from klgrad.trainer import latest_checkpoint, read_jsonl, train
from tests.helpers.tiny_runs import SMALL_GRID, small

SMALL = {**SMALL_GRID, "train.threads": 1}  # one thread count whatever the load: reruns compared bit for bit
KW = dict(exact_prompts=3, estimate_samples=4, progress=False, level="sequence", overrides=SMALL)


def run_compare(out, revision=None, **fields):
    """:func:`klgrad.compare.grid.run_compare` of the options named by ``fields``."""
    return run_grid(RunOptions.of(out, **fields), revision=revision)


def stable(records: list[dict]) -> list[dict]:
    """Records without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in records]


def numbers(final: dict) -> dict:
    """final.json without where it ran and the exact objective's wall-clock seconds."""
    out = {k: v for k, v in final.items() if k not in ("ran_on", "final_on")}
    out["objective"] = {k: v for k, v in final["objective"].items() if not k.startswith("seconds")}
    return out


@pytest.mark.slow
def test_a_larger_steps_extends_every_run_and_leaves_the_earlier_steps_alone(tmp_path):
    out = tmp_path / "g"
    kw = dict(seeds=2, methods=("k2_as_loss", "k3_as_loss"), **KW)
    run_compare(out, steps=2, **kw)
    runs = sorted((out / "runs").iterdir())
    before = {d.name: read_jsonl(d / "metrics.jsonl") for d in runs}
    summary = run_compare(out, steps=4, **kw)
    for d in runs:
        after = read_jsonl(d / "metrics.jsonl")
        assert [r["step"] for r in after] == [0, 1, 2, 3, 4]
        assert after[:3] == before[d.name]  # steps 0–2 exactly as the 2-step grid logged them
        assert json.loads((d / "final.json").read_text())["steps"] == 4
        assert json.loads((d / "final.step2.json").read_text())["steps"] == 2  # the 2-step numbers, kept
        assert [p.name for p in (d / "checkpoints").glob("step_*")] == ["step_000004"]  # older ones pruned
        assert "steps: 4" in (d / "config.yaml").read_text()  # the extension is recorded
        prov = read_jsonl(d / "provenance.jsonl")
        assert [(p["from_step"], p["to_step"]) for p in prov] == [(0, 2), (2, 4)]
        assert prov[0]["revision"] == source_revision().name
    grid = json.loads((out / "grid.json").read_text())
    assert (grid["steps"], grid["cadence_steps"], len(grid["sessions"])) == (4, 2, 2)
    assert summary.steps == 4
    saved = json.loads((out / "summary.json").read_text())
    assert saved["convergence"]["steps"] == 4
    assert saved["convergence"]["criterion"] == ConvergenceCriterion().text()
    assert set(saved["convergence"]["by_method"]) == {"k2_as_loss", "k3_as_loss"}
    assert len(saved["runs"]) == 4


@pytest.mark.slow
def test_a_grid_killed_mid_run_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    kw = dict(seeds=1, steps=4, methods=("k2_as_loss",), **KW)
    run_compare(tmp_path / "whole", **kw)
    real = runs_module.train

    def killed(cfg, **kwargs):  # the process dies after step 3 (its checkpoint written)
        real(cfg, stop_after=3, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(runs_module, "train", killed)
    with pytest.raises(KeyboardInterrupt):
        run_compare(tmp_path / "cut", **kw)
    run = tmp_path / "cut" / "runs" / "k2_as_loss-beta0.5-seed0"
    assert not (run / "final.json").exists()
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_000003"]  # periodic, newest kept
    monkeypatch.setattr(runs_module, "train", real)
    run_compare(tmp_path / "cut", **kw)
    whole = tmp_path / "whole" / "runs" / "k2_as_loss-beta0.5-seed0"
    assert stable(read_jsonl(run / "metrics.jsonl")) == stable(read_jsonl(whole / "metrics.jsonl"))
    cut, ref = (json.loads((d / "final.json").read_text()) for d in (run, whole))
    assert numbers(cut) == numbers(ref)
    # the killed call is on record (to_step None: it kept steps 0-3, to the next call's from_step), then the resumed
    assert [(p["from_step"], p["to_step"]) for p in read_jsonl(run / "provenance.jsonl")] == [(0, None), (3, 4)]


@pytest.mark.slow
def test_seeds_run_apart_merge_into_one_summary_and_another_revision_is_refused(tmp_path):
    kw = dict(seeds=2, steps=1, methods=("k2_as_loss", "k3_as_loss"), primary="k2_as_loss<k3_as_loss:kl", **KW)
    seen = []

    def downstream(ctx):  # a downstream evaluation needs the weights: they are still there
        seen.append(latest_checkpoint(ctx.run_dir) is not None)
        return {"checkpoint_seen": seen[-1]}

    measure = (Measurement("downstream", downstream),)
    run_compare(tmp_path / "a", only_seeds=[0], **kw)
    run_compare(tmp_path / "b", only_seeds=[1], checkpoints=False, measure=measure, **kw)
    assert seen == [True, True]
    for m in ("k2_as_loss", "k3_as_loss"):
        run_b = tmp_path / "b" / "runs" / f"{m}-beta0.5-seed1"
        assert not (run_b / "checkpoints").exists()  # deleted after final.json and the hook
        assert json.loads((run_b / "final.json").read_text())["downstream"] == {"checkpoint_seen": True}
    with pytest.raises(ValueError, match="no checkpoint left"):  # --no-checkpoints: cannot be extended
        run_compare(tmp_path / "b", only_seeds=[1], checkpoints=False, **{**kw, "steps": 2})
    assert json.loads((tmp_path / "b" / "grid.json").read_text())["steps"] == 1  # refused before the record

    summary = merge_grids([tmp_path / "a", tmp_path / "b"], tmp_path / "m").summary
    saved = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert sorted((r["method"], r["seed"]) for r in saved["runs"]) == [
        ("k2_as_loss", 0),
        ("k2_as_loss", 1),
        ("k3_as_loss", 0),
        ("k3_as_loss", 1),
    ]
    assert summary.primary.n_pairs == 2  # one seed from each machine, paired
    assert saved["revision"] == source_revision().name
    assert all(r["ran_on"] for r in saved["runs"])  # each run names the machine that trained it
    merged = json.loads((tmp_path / "m" / "grid.json").read_text())
    assert merged["revision"]["revision"] == source_revision().name
    assert len(merged["sessions"]) == 2
    assert merged["merged_from"][0]["inputs"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert not list((tmp_path / "m" / "runs").glob("*/checkpoints"))  # weights are not copied
    merge_grids([tmp_path / "a"], tmp_path / "m")  # again, from an input whose session m holds already
    again = json.loads((tmp_path / "m" / "grid.json").read_text())
    assert again["sessions"] == merged["sessions"]  # each session once
    assert len(again["merged_from"]) == 2

    shutil.copytree(tmp_path / "b", tmp_path / "c")
    record = json.loads((tmp_path / "c" / "grid.json").read_text())
    record["revision"]["revision"] = record["revision"]["commit"] = "0" * 40
    record["revision"]["content"] = "1" * 64  # other code, not only another name
    (tmp_path / "c" / "grid.json").write_text(json.dumps(record))
    with pytest.raises(GridMismatchError, match=f"/a was run at revision .*/c at revision {'0' * 40}"):
        merge_grids([tmp_path / "a", tmp_path / "c"], tmp_path / "m2")
    assert not (tmp_path / "m2" / "summary.json").exists()


@pytest.mark.slow
def test_a_merge_of_listed_seeds_takes_each_seed_whole_and_later_files_of_runs_it_already_holds(tmp_path):
    kw = dict(seeds=3, steps=1, methods=("k2_as_loss", "k3_as_loss"), primary="k2_as_loss<k3_as_loss:kl", **KW)
    lane = tmp_path / "lane"
    run_compare(lane, only_seeds=[0], **kw)
    run_compare(lane, only_seeds=[1], only_methods=["k2_as_loss"], **kw)  # seed 1: only one half so far
    (lane / "runs" / "k3_as_loss-beta0.5-seed2").mkdir()  # seed 2: a run still training (no final.json)
    out = tmp_path / "results"

    with pytest.raises(GridMismatchError, match=r"seed 1 cannot merge whole: k3_as_loss-beta0\.5-seed1 not found"):
        merge_grids([lane], out, seeds=[0, 1])
    with pytest.raises(GridMismatchError, match=r"seed 2 is not finished: .*k3_as_loss-beta0\.5-seed2 has no final"):
        merge_grids([lane], out, seeds=[2])
    assert not out.exists()  # refused before anything is written
    assert main(["compare", "--merge", str(lane), "--only-seeds", "1", "--out", str(out)]) == 2
    # a spaced seed list would merge seed 0 alone and drop "1" silently: refused before anything is written
    assert main(["compare", "--merge", str(lane), "--only-seeds", "0", "1", "--out", str(out)]) == 2
    assert not out.exists()

    merged = merge_grids([lane], out, seeds=[0])
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["k2_as_loss-beta0.5-seed0", "k3_as_loss-beta0.5-seed0"]
    assert merged.skipped == ()  # the other seeds' runs are not candidates at all
    saved = json.loads((out / "summary.json").read_text())
    assert sorted((r["method"], r["seed"]) for r in saved["runs"]) == [("k2_as_loss", 0), ("k3_as_loss", 0)]

    later = lane / "runs" / "k2_as_loss-beta0.5-seed0"  # a measurement written after the first merge
    (later / "forgetting.json").write_text('{"forward_kl": 0.1}')
    (later / "checkpoints" / "late.bin").write_bytes(b"weights")  # weights are never copied
    merge_grids([lane], out, seeds=[0])
    merged = out / "runs" / "k2_as_loss-beta0.5-seed0"
    assert json.loads((merged / "forgetting.json").read_text()) == {"forward_kl": 0.1}
    assert not (merged / "checkpoints").exists()
    record = json.loads((out / "grid.json").read_text())
    assert record["merged_from"][-1]["copied"] == {str(lane): ["k2_as_loss-beta0.5-seed0 (new files)"]}
    (later / "forgetting.json").write_text('{"forward_kl": 0.2}')  # a changed file is not overwritten
    merge_grids([lane], out, seeds=[0])
    assert json.loads((merged / "forgetting.json").read_text()) == {"forward_kl": 0.1}
    final = json.loads((later / "final.json").read_text())
    (later / "final.json").write_text(json.dumps({**final, "steps": 99}))  # nor a changed final.json: refused
    with pytest.raises(GridMismatchError, match=r"with different final\.json"):
        merge_grids([lane], out, seeds=[0])


@pytest.mark.slow
def test_a_merge_that_fails_part_way_leaves_the_grid_as_it_was(tmp_path, monkeypatch):
    """A summary that cannot be computed (as a sign-flip p of 21 seeds once could not) after the runs were copied
    and grid.json written: the copied runs are removed and grid.json, summary.json and summary.md are the bytes they
    were, so a second merge records the runs it brings in."""
    kw = dict(seeds=2, steps=1, methods=("k2_as_loss", "k3_as_loss"), primary="k2_as_loss<k3_as_loss:kl", **KW)
    lane, out = tmp_path / "lane", tmp_path / "results"
    run_compare(lane, only_seeds=[0], **kw)
    merge_grids([lane], out, seeds=[0])
    run_compare(lane, only_seeds=[1], **kw)
    before = {name: (out / name).read_bytes() for name in ("grid.json", "summary.json", "summary.md")}
    runs_before = sorted(p.name for p in (out / "runs").iterdir())
    real = report_module.write_summary

    def failing(out_dir, record, figures=True):
        (out_dir / "summary.json").write_text("{}")  # half written
        raise ValueError("cannot summarise")

    monkeypatch.setattr(report_module, "write_summary", failing)
    with pytest.raises(ValueError, match="cannot summarise"):
        merge_grids([lane], out, seeds=[1])
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (out / "runs").iterdir()) == runs_before
    monkeypatch.setattr(report_module, "write_summary", real)
    merge_grids([lane], out, seeds=[1])
    record = json.loads((out / "grid.json").read_text())
    assert record["merged_from"][-1]["copied"] == {str(lane): ["k2_as_loss-beta0.5-seed1", "k3_as_loss-beta0.5-seed1"]}
    assert len(record["merged_from"]) == 2  # the failed attempt left no entry


@pytest.mark.slow
def test_one_seeds_methods_run_apart_and_merged_are_the_runs_of_one_invocation(tmp_path):
    kw = dict(seeds=2, steps=1, methods=("k2_as_loss", "k3_as_loss"), only_seeds=[0], **KW)
    run_compare(tmp_path / "whole", **kw)
    run_compare(tmp_path / "a", only_methods=["k3_as_loss"], **kw)
    run_compare(tmp_path / "b", only_methods=["k2_as_loss"], **kw)
    assert [p.name for p in (tmp_path / "a" / "runs").iterdir()] == ["k3_as_loss-beta0.5-seed0"]
    recorded = json.loads((tmp_path / "a" / "grid.json").read_text())
    assert recorded["methods"] == ["k2_as_loss", "k3_as_loss"]  # the design: every method, trained or not
    assert recorded["sessions"][-1]["methods"] == ["k3_as_loss"]  # what this invocation trained
    merge_grids([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    for m in ("k2_as_loss", "k3_as_loss"):  # the same run whichever process trained it (one machine)
        apart, together = (
            json.loads((tmp_path / d / "runs" / f"{m}-beta0.5-seed0" / "final.json").read_text())
            for d in ("m", "whole")
        )
        assert numbers(apart) == numbers(together)
    with pytest.raises(ValueError, match="only_methods"):
        run_compare(tmp_path / "c", only_methods=["k1_as_loss"], **kw)
    assert not (tmp_path / "c").exists()  # refused before anything is written


def test_a_grid_refuses_to_continue_at_another_revision(tmp_path, monkeypatch, capsys):
    """No training: each run is skipped (ensure_run replaced); the record is what is checked."""
    monkeypatch.setattr(grid_module, "ensure_run", lambda cfg, steps, **kw: {})
    out = tmp_path / "g"
    pinned = Revision("f" * 40, "f" * 40, False, "/pins/ffff/src/klgrad")
    run_compare(out, seeds=2, steps=2, methods=("k2_as_loss", "k3_as_loss"), revision=pinned, **KW)
    grid = json.loads((out / "grid.json").read_text())
    assert grid["revision"] == pinned.as_dict()
    assert grid["machine"]["cpu"]["model"] is not None or grid["machine"]["cpu"]["cores"] >= 0
    assert {"avx2", "avx512", "model"} <= set(grid["machine"]["cpu"])
    (out / "runs" / "k2_as_loss-beta0.5-seed0").mkdir(parents=True)
    (out / "runs" / "k2_as_loss-beta0.5-seed0" / "metrics.jsonl").write_text("")
    flags = ["--seeds", "2", "--steps", "2", "--methods", "k2_as_loss,k3_as_loss", "--level", "sequence"]
    assert main(["compare", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert f"run at revision {'f' * 40}" in err
    assert f"is {source_revision().name}" in err
    assert f"--pin {'f' * 40}" in err
    assert json.loads((out / "grid.json").read_text()) == grid  # untouched


def test_the_primary_hypothesis_and_criterion_are_on_record_before_the_first_run(tmp_path, monkeypatch):
    out = tmp_path / "g"
    seen = []

    def first_run(cfg, steps, **kw):
        seen.append((json.loads((out / "grid.json").read_text()), json.loads((out / "summary.json").read_text())))
        raise KeyboardInterrupt

    monkeypatch.setattr(grid_module, "ensure_run", first_run)
    crit = ConvergenceCriterion(gap=0.08)
    kw = dict(seeds=8, steps=2, methods=("none", "k2_as_loss", "k3_as_loss"), convergence=crit, **KW)
    with pytest.raises(KeyboardInterrupt):
        run_compare(out, primary="k2_as_loss<k3_as_loss:kl", **kw)
    ((grid, summary),) = seen
    assert grid["primary"]["text"] == "k2_as_loss<k3_as_loss:kl"
    assert summary["primary"] == grid["primary"]
    assert summary["status"].startswith("registered")
    assert summary["convergence"] == {"criterion": crit.text(), "met": None, "steps": 2, "parameters": crit.as_dict()}
    assert summary["registered_at"] == grid["created"]
    assert grid["convergence"] == crit.as_dict()


@pytest.mark.slow
def test_a_run_stops_on_its_stated_criterion(tmp_path):
    s = train(small(tmp_path / "a", **{"train.stop_when": "kl/k1 > -1"}), progress=False)  # holds at step 1
    assert s["steps"] == 1
    assert s["stopped"]["step"] == 1
    assert s["stopped"]["criterion"] == "kl/k1 > -1"
    run = tmp_path / "a" / "run"
    assert json.loads((run / "summary.json").read_text())["stopped"] == s["stopped"]
    assert latest_checkpoint(run).name == "step_000001"  # saved like a last step
    assert "eval/greedy_accuracy" in read_jsonl(run / "metrics.jsonl")[-1]  # and evaluated like one
    s = train(small(tmp_path / "b", **{"train.stop_when": "eval/greedy_accuracy >= 0"}), progress=False)
    assert s["steps"] == 2  # eval metrics exist at evaluation steps (train.eval_every 2)
    assert s["stopped"]["step"] == 2


@pytest.mark.slow
def test_the_final_metrics_and_hooks_run_under_the_runs_thread_rule(tmp_path):
    """With ``train.threads: auto`` a run's final metrics and hooks run registered as a klgrad process sharing the
    CPU (klgrad.threads), as its training does, not with every core beside the next run's training; with a fixed
    N they run with N threads."""
    import os

    import torch

    from klgrad.threads import registry_dir

    seen = []

    def hook(ctx):
        seen.append(((registry_dir() / str(os.getpid())).is_file(), torch.get_num_threads()))
        return {}

    before = torch.get_num_threads()
    try:
        for threads in ("auto", 1):
            kw = {**KW, "overrides": {**SMALL, "train.threads": threads}}
            run_compare(tmp_path / str(threads), seeds=2, only_seeds=[0], steps=1, methods=("k2_as_loss",),
                        measure=(Measurement("h", hook),), **kw)  # fmt: skip
    finally:
        torch.set_num_threads(before)  # a fixed count stays set after training (the trainer's rule)
    assert seen[0][0]
    assert seen[1] == (False, 1)
    assert not (registry_dir() / str(os.getpid())).exists()
