"""The named final measurements (klgrad.compare.measurements): one registry for the built-ins and a user's, their
options parsed and checked before any run, the core set and its final.json order by answer length, and
measurements taken afterwards on a grid's finished runs into ``runs/RUN/NAME.json`` (forgetting there is what
``klgrad forgetting`` measures on the same run, the command the study script that did this before called)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from klgrad.cli import main
from klgrad.compare.context import FinalContext
from klgrad.compare.measurements import (
    MEASUREMENTS,
    Measurement,
    core_measurements,
    measure_after,
    parse_measurement,
    register_measurement,
)
from klgrad.compare.records import GridRecord
from tests.helpers.run_dirs import make_run

BUILT_IN = ("exact_kl", "sampled_kl", "stepwise_kl", "forward_kl", "kl_to_optimum", "forgetting", "downstream")


def counted(ctx, factor: float = 2.0, label: str = "x") -> dict:
    """A user's measurement with options (imported by path in the tests below)."""
    return {"value": factor * ctx.samples, "label": label}


def test_the_built_ins_are_registered_like_a_users():
    assert set(BUILT_IN) <= set(MEASUREMENTS)
    assert MEASUREMENTS["forgetting"].options == {"samples": 4}
    assert MEASUREMENTS["kl_to_optimum"].options == {"ref_samples": 256}
    assert not MEASUREMENTS["exact_kl"].nested  # final.json's top-level keys, as before
    assert MEASUREMENTS["downstream"].nested  # its dict under its name, as the hook stored it
    with pytest.raises(ValueError, match="'forgetting' is registered already"):
        register_measurement(Measurement("forgetting", counted))
    mine = register_measurement(counted, name="counted_test")
    try:
        assert parse_measurement("counted_test:factor=3").options == {"factor": 3.0, "label": "x"}
    finally:
        del MEASUREMENTS[mine.name]


def test_a_spec_names_a_registered_measurement_or_imports_a_users():
    m = parse_measurement("forgetting:samples=8")
    assert (m.name, m.options, m.spec()) == ("forgetting", {"samples": 8}, "forgetting:samples=8")
    user = parse_measurement("mine=tests.compare.test_measurements:counted:factor=0.5,label=y")
    assert (user.name, user.options, user.nested) == ("mine", {"factor": 0.5, "label": "y"}, True)

    class Ctx:
        samples = 4

    assert user.run(Ctx()) == {"mine": {"value": 2.0, "label": "y"}}
    assert parse_measurement("plain=tests.compare.test_measurements:counted").options == {"factor": 2.0, "label": "x"}
    for bad, match in (
        ("nosuch", "no measurement 'nosuch'; registered: exact_kl"),
        ("forgetting:sample=3", r"unknown options \['sample'\]"),
        ("forgetting:samples=1", "samples must be >= 2, got 1"),
        ("kl_to_optimum:ref_samples=x", "invalid literal"),
        ("forgetting:samples", "KEY=VALUE"),
        ("x=tests.compare.test_measurements:nothing", "has no attribute"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_measurement(bad)


def test_the_core_measurements_by_answer_length_in_final_jsons_order():
    assert [m.name for m in core_measurements(True)] == ["exact_kl", "forward_kl", "sampled_kl"]
    assert [m.name for m in core_measurements(False)] == ["sampled_kl", "stepwise_kl", "forward_kl"]


def _grid(tmp_path: Path, seeds: int = 2) -> tuple[Path, GridRecord]:
    """A grid folder of ``seeds`` finished runs of k2_as_loss (no training: klgrad run directories whose policy is
    the tiny reference plus noise, one thread each, a final.json of what a run logged)."""
    out = tmp_path / "g"
    for s in range(seeds):
        run, _ = make_run(tmp_path / f"made{s}", noise=0.02 * (s + 1))
        dest = out / "runs" / f"k2_as_loss-beta0.5-seed{s}"
        shutil.copytree(run, dest)
        cfg = yaml.safe_load((dest / "config.yaml").read_text())
        cfg["train"]["threads"] = 1  # the same thread count as the script's measurement below
        (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        (dest / "final.json").write_text(json.dumps({"greedy_accuracy": 0.5, "steps": 3}))
    record = {
        "revision": {"revision": "abc", "commit": "abc", "dirty": False, "source": "/src/klgrad"},
        "pinned": False,
        "created": "2026-01-01T00:00:00+00:00",
        "config": None,
        "resolved_config": {"rollout": {"temperature": 1.0}},
        "methods": ["k2_as_loss"],
        "seeds": seeds,
        "betas": [0.5],
        "level": "sequence",
        "steps": 3,
        "overrides": {},
        "margin": 0.1,
        "exact_prompts": 2,
        "estimate_samples": 2,
        "primary": None,
        "convergence": None,
    }
    (out / "grid.json").write_text(json.dumps(record))
    return out, GridRecord.from_json(record)


@pytest.mark.slow
def test_forgetting_measured_afterwards_is_what_the_forgetting_command_measures_on_that_run(tmp_path, capsys):

    out, record = _grid(tmp_path, seeds=1)
    run = out / "runs" / "k2_as_loss-beta0.5-seed0"
    done = measure_after(out, record, [parse_measurement("forgetting:samples=2")], device="cpu", progress=False)
    assert done.measured == [run.name]
    saved = json.loads((run / "forgetting.json").read_text())
    assert main(["forgetting", "--policy", str(run), "--samples", "2", "--device", "cpu", "--threads", "1"]) == 0
    script = json.loads(capsys.readouterr().out)
    for key in ("reverse_kl", "reverse_kl_se", "forward_kl", "forward_kl_se", "n_prompts", "samples", "temperature"):
        assert saved["forgetting"][key] == script[key], key  # the same models, seeds and threads: the same floats
    assert saved["forgetting_reverse_kl"] == script["reverse_kl"] > 0
    assert saved["spec"] == "forgetting:samples=2"
    assert saved["checkpoint"].endswith("step_000003")
    assert "measured_by" in saved
    assert json.loads((run / "final.json").read_text()) == {"greedy_accuracy": 0.5, "steps": 3}  # left as it is


def test_a_measurement_afterwards_resumes_and_lists_runs_without_weights(tmp_path, capsys):
    out, record = _grid(tmp_path)
    calls = []

    def noted(ctx) -> dict:
        calls.append(ctx.run_dir.name)
        return {"seen": ctx.run_dir.name, "short": ctx.short}

    m = Measurement("noted", noted)
    done = measure_after(out, record, [m], seeds=[1], progress=False)
    assert (done.measured, calls) == (["k2_as_loss-beta0.5-seed1"], ["k2_as_loss-beta0.5-seed1"])
    saved = json.loads((out / "runs" / "k2_as_loss-beta0.5-seed1" / "noted.json").read_text())
    assert saved["noted"] == {"seen": "k2_as_loss-beta0.5-seed1", "short": True}
    shutil.rmtree(out / "runs" / "k2_as_loss-beta0.5-seed0" / "checkpoints")
    again = measure_after(out, record, [m], progress=False)
    assert (again.measured, again.had_it, again.no_checkpoint) == ([], ["k2_as_loss-beta0.5-seed1"],
                                                                    ["k2_as_loss-beta0.5-seed0"])  # fmt: skip
    assert calls == ["k2_as_loss-beta0.5-seed1"]  # nothing measured twice
    # a measurement final.json holds already (a hook's, under its name) is not taken again
    (out / "runs" / "k2_as_loss-beta0.5-seed1" / "noted.json").unlink()
    final = out / "runs" / "k2_as_loss-beta0.5-seed1" / "final.json"
    final.write_text(json.dumps({**json.loads(final.read_text()), "noted": {}}))
    assert measure_after(out, record, [m], progress=False).had_it == ["k2_as_loss-beta0.5-seed1"]


def test_the_command_measures_named_runs_and_refuses_a_folder_without_a_grid(tmp_path, capsys, monkeypatch):
    out, _ = _grid(tmp_path)
    monkeypatch.setitem(MEASUREMENTS, "noted_cli", Measurement("noted_cli", lambda ctx: {"ok": True}))
    assert main(["compare", "measure", str(out), "noted_cli", "--only-runs", "k2_as_loss-beta0.5-seed0"]) == 0
    assert "1 measured (noted_cli), 0 had it, 0 without checkpoints" in capsys.readouterr().out
    assert (out / "runs" / "k2_as_loss-beta0.5-seed0" / "noted_cli.json").is_file()
    assert not (out / "runs" / "k2_as_loss-beta0.5-seed1" / "noted_cli.json").exists()
    assert main(["compare", "measure", str(tmp_path), "noted_cli"]) == 2
    assert "holds no grid.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an unknown measurement is an argparse error naming it
        main(["compare", "measure", str(out), "nosuch"])
    assert "no measurement 'nosuch'" in capsys.readouterr().err


def test_downstream_of_a_pinned_grid_measured_afterwards_runs_the_pinned_revisions_eval(tmp_path, monkeypatch):
    """The old hook ran inside the pinned process, so its ``klgrad eval`` was the pinned revision's; measured
    afterwards, the eval subprocess gets the pinned worktree's src first on PYTHONPATH."""
    from klgrad.compare import measures
    from klgrad.compare import provenance as pv
    from klgrad.config import Config

    monkeypatch.setattr(pv, "pin_worktree", lambda rev, repo, root, allow_dirty=False: (rev, tmp_path / "pins" / rev))
    seen = {}

    def fake_run(cmd, check, stdout, env):
        seen["cmd"], seen["env"] = cmd, env
        eval_dir = Path(cmd[cmd.index("--out") + 1])
        eval_dir.mkdir(parents=True)
        (eval_dir / "eval.json").write_text('{"benchmarks": {}}')

    monkeypatch.setattr(measures.subprocess, "run", fake_run)
    ctx = FinalContext(Config(), tmp_path / "run", 2, 2, pinned="c0ffee")
    out = measures.downstream(ctx, samples=8)
    assert seen["env"]["PYTHONPATH"].split(":")[0] == str(tmp_path / "pins" / "c0ffee" / "src")
    assert seen["cmd"][1:4] == ["-m", "klgrad", "eval"]
    assert "--samples 8" in out["command"]
    assert out["eval"] == {"benchmarks": {}}
    lines = (tmp_path / "run" / "downstream" / "harder.jsonl").read_text().splitlines()
    assert len(lines) == measures.HARDER_EVAL
    measures.downstream(FinalContext(Config(), tmp_path / "run2", 2, 2), samples=8)  # unpinned: this klgrad
    assert seen["env"].get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    assert parse_measurement("downstream:samples=2,pinned=false").options == {"samples": 2, "pinned": False}
