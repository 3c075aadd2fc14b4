"""``klgrad compare``'s subcommands: run is the default, the older mode flags and spellings reach the same typed
records as the new ones, each subcommand's flags are its record's fields, and the old module command lines point
to their subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from klgrad import cli
from klgrad.compare import commands
from klgrad.compare.claims import parse_claim
from klgrad.compare.convergence import ConvergenceCriterion
from klgrad.compare.options import AmendOptions, GridDesign, MergeOptions, ReportOptions, RunOptions
from klgrad.flags import parse_record


def _args(*argv: str) -> argparse.Namespace:
    args, extra = cli.build_parser().parse_known_args(commands.compare_words(["compare", *argv]))
    assert extra == []
    return args


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("run", "merge", "amend", "report", "measure", "mean-length"):
        assert f"\n    {name}" in out, name


def test_run_is_the_default_and_the_older_spellings_give_the_same_record():
    new = ["--out", "g", "--exact-prompts", "22", "--estimate-samples", "16", "--convergence-gap", "0.08",
           "--convergence-metric", "kl/k1", "--convergence-lr-decay", "none", "--no-checkpoints",
           "--measure", "kl_to_optimum:ref_samples=256", "--measure", "forgetting:samples=4"]  # fmt: skip
    old = ["--out", "g", "--kl-prompts", "22", "--kl-samples", "16", "--converge-gap", "0.08", "--converge-metric",
           "kl/k1", "--converge-without-lr-decay", "--no-checkpoints", "--optimum-ref-samples", "256",
           "--forgetting-samples", "4", "--forgetting-samples", "0"]  # fmt: skip
    a, b, c = (parse_record(RunOptions, _args(*argv)) for argv in (["run", *new], new, old))
    assert a == b == c
    assert a.design.exact_prompts == 22
    assert a.design.convergence == ConvergenceCriterion(gap=0.08, lr_decay=None)
    assert [m.spec() for m in a.measure] == ["kl_to_optimum:ref_samples=256", "forgetting:samples=4"]
    assert not a.checkpoints


def test_defaults_are_the_records_and_a_design_flag_is_its_field():
    options = parse_record(RunOptions, _args())
    assert options == RunOptions()
    assert options.design.convergence is None  # not given: a continuation takes the grid's
    got = parse_record(RunOptions, _args("--primary", "k2_as_loss<k3_as_loss", "--betas", "0.1,0.5", "--seeds", "8"))
    assert got.design == dataclasses.replace(
        GridDesign(), primary=parse_claim("k2_as_loss<k3_as_loss"), betas=(0.1, 0.5), seeds=8
    )


def test_the_older_mode_flags_are_merge_and_amend():
    merge = _args("--merge", "a", "b", "--only-seeds", "0-2", "--out", "m")
    assert merge.compare_func is commands.cmd_merge
    assert parse_record(MergeOptions, merge) == MergeOptions((Path("a"), Path("b")), Path("m"), (0, 1, 2))
    amend = _args("--out", "g", "--amend-seeds", "8", "--reason", "why")
    assert amend.compare_func is commands.cmd_amend
    assert parse_record(AmendOptions, amend) == AmendOptions(seeds=8, out=Path("g"), reason="why")
    report = _args("report", "x", "y", "--no-figures")
    assert parse_record(ReportOptions, report) == ReportOptions((Path("x"), Path("y")), figures=False)


def test_a_subcommand_that_trains_nothing_refuses_stray_words(tmp_path, capsys):
    assert cli.main(["compare", "report", str(tmp_path), "--rollout.group_size", "4"]) == 2
    assert "report takes no config overrides" in capsys.readouterr().err


def test_the_old_module_command_lines_point_to_their_subcommands():
    for module, pointer in (("klgrad.compare.grid", "klgrad compare report"),
                            ("klgrad.compare.beta_scale", "klgrad compare mean-length")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert done.returncode == 1
        assert pointer in done.stderr


def test_mean_length_prints_the_length_beta_scale_measures(capsys):
    from klgrad.compare.beta_scale import mean_response_length
    from klgrad.config import load_config

    over = ["--data.n_train", "200"]
    assert cli.main(["compare", "mean-length", "--config", "configs/tiny_add.yaml", *over]) == 0
    printed = float(capsys.readouterr().out)
    want = mean_response_length(load_config("configs/tiny_add.yaml", {"data.n_train": 200}))
    assert printed == pytest.approx(want, rel=1e-5)  # printed to 6 significant digits
