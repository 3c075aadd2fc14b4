"""The ``klgrad`` commands' wiring: the entry points resolve to :func:`klgrad.cli.main`, every subcommand has its
handler, and the choices a flag offers are the ones the code implements. (The completion scripts:
tests/test_completion.py; each command's behaviour: the test module of what it runs.)"""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from klgrad import cli
from klgrad.choices import ENGINES, LEVELS, MODEL_DTYPES
from klgrad.completion import SHELLS
from klgrad.data import TASKS
from klgrad.rewards import ACCURACY_REWARDS

ROOT = Path(__file__).resolve().parents[1]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _choices(parser: argparse.ArgumentParser, dest: str) -> tuple:
    return next(a for a in parser._actions if a.dest == dest).choices


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_console_script_and_module_run_cli_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    module, _, name = scripts["klgrad"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main
    assert "from klgrad.cli import main" in (ROOT / "src" / "klgrad" / "__main__.py").read_text(encoding="utf-8")


def test_every_subcommand_runs_its_own_handler():
    commands = _subparsers()
    assert list(commands) == [
        "audit", "compare", "train", "sft", "eval", "forgetting", "export", "regime", "reproduce", "convert-benchmarks",
        "completion",
    ]
    for name, parser in commands.items():
        assert parser.get_default("func") is getattr(cli, f"cmd_{name.replace('-', '_')}"), name
    assert [n for n, p in commands.items() if p.get_default("takes_overrides")] == ["compare", "train", "regime"]


def test_flag_choices_are_what_the_code_implements():
    commands = _subparsers()
    assert sorted(_choices(_subcommands(commands["compare"])["run"], "design.level")) == sorted(LEVELS)
    assert tuple(_choices(commands["sft"], "task")) == tuple(n for n, spec in TASKS.items() if not spec.chat)
    assert tuple(_choices(commands["reproduce"], "name")) == cli.REPRODUCE_TARGETS
    assert tuple(_choices(commands["completion"], "shell")) == SHELLS
    assert tuple(_choices(commands["eval"], "engine")) == ENGINES
    assert tuple(_choices(commands["eval"], "reward")) == ACCURACY_REWARDS
    assert tuple(_choices(commands["export"], "dtype")) == MODEL_DTYPES


@pytest.mark.parametrize("argv", [["audit", "--no-such-flag"], ["sft", "--out", "x", "--task", "subtraction"]])
def test_bad_arguments_exit_2_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage: klgrad" in capsys.readouterr().err


def test_building_the_parser_loads_no_model_library():
    """``klgrad --help`` and completion build every command's parser, compare's from its typed records
    (klgrad.compare.options) and forgetting's from klgrad.eval.forgetting: none of that may load torch or numpy.
    A fresh interpreter, so that no other test's imports count."""
    import subprocess
    import sys

    code = (
        "import sys, klgrad.cli; klgrad.cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
