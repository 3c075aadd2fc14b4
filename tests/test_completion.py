"""``klgrad completion {bash,zsh,fish}``: scripts generated from the real parser actually complete.

bash is exercised for real: the script is sourced in a bash subprocess, COMP_WORDS / COMP_CWORD are set as
readline would set them, the completion function is called and COMPREPLY is read back. fish (``complete -C``)
and zsh (syntax) run where those shells are installed.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pytest

from klgrad.choices import ANALYTIC_HEADS
from klgrad.cli import build_parser, main
from klgrad.completion import completion_script, completion_spec
from klgrad.config import Config
from klgrad.kl import KL_HEADS


def _bash_complete(script: str, words: list[str]) -> list[str]:
    """COMPREPLY for the command line ``words`` with the cursor on the last word."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    program = (
        f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _klgrad\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n"
    )
    out = subprocess.run(["bash", "--norc", "--noprofile"], input=program, capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def bash_script() -> str:
    return completion_script("bash", build_parser())


def _leaf_flags() -> list[str]:
    flags = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                flags.append(f"--{prefix}{f.name}")

    walk(Config(), "")
    assert len(flags) > 40
    return flags


def test_cli_prints_each_script(capsys):
    for shell in ("bash", "zsh", "fish"):
        assert main(["completion", shell]) == 0
        assert capsys.readouterr().out == completion_script(shell, build_parser())


def test_bash_script_is_valid_syntax(bash_script, tmp_path):
    path = tmp_path / "klgrad.bash"
    path.write_text(bash_script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_bash_completes_subcommands(bash_script):
    got = _bash_complete(bash_script, ["klgrad", ""])
    assert "train" in got
    commands = {"audit", "compare", "train", "sft", "eval", "forgetting", "export", "regime", "reproduce",
                "convert-benchmarks"}  # fmt: skip
    assert set(got) == {*commands, "completion"}
    assert _bash_complete(bash_script, ["klgrad", "tr"]) == ["train"]


def test_bash_completes_dotted_config_flags_of_train(bash_script):
    got = _bash_complete(bash_script, ["klgrad", "train", "--kl"])
    assert "--kl.head" in got
    assert all(flag.startswith("--kl") for flag in got)
    every = set(_bash_complete(bash_script, ["klgrad", "train", "--"]))
    assert set(_leaf_flags()) <= every
    assert {"--config", "--resume", "--help"} <= every


def test_bash_completes_choices_of_a_value(bash_script):
    assert sorted(_bash_complete(bash_script, ["klgrad", "train", "--kl.head", "k3"])) == ["k3_as_loss", "k3_in_reward"]
    assert set(_bash_complete(bash_script, ["klgrad", "train", "--kl.head", ""])) == {*KL_HEADS, *ANALYTIC_HEADS}
    assert _bash_complete(bash_script, ["klgrad", "train", "--train.wandb", "t"]) == ["true"]
    assert _bash_complete(bash_script, ["klgrad", "train", "--kl.level", "=", "token_"]) == ["token_to_go"]
    assert _bash_complete(bash_script, ["klgrad", "compare", "--level", "seq"]) == ["sequence"]
    assert "k3-gaussian" in _bash_complete(bash_script, ["klgrad", "reproduce", "k3"])
    assert _bash_complete(bash_script, ["klgrad", "export", "--dtype", "b"]) == ["bfloat16"]
    # a free value (a path) is left to readline's file-name default
    assert _bash_complete(bash_script, ["klgrad", "train", "--config", ""]) == []


def test_options_of_one_command_stay_out_of_another(bash_script):
    assert "--kl.head" not in _bash_complete(bash_script, ["klgrad", "audit", "--"])
    assert "--vocab" in _bash_complete(bash_script, ["klgrad", "audit", "--"])


def test_spec_reads_the_parser():
    spec = completion_spec(build_parser())
    assert spec[""]["words"] == [
        "audit",
        "compare",
        "train",
        "sft",
        "eval",
        "forgetting",
        "export",
        "regime",
        "reproduce",
        "convert-benchmarks",
        "completion",
    ]
    head = next(o for o in spec["train"]["options"] if o.flag == "--kl.head")
    assert head.choices == (*KL_HEADS, *ANALYTIC_HEADS)


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes(tmp_path):
    path = tmp_path / "klgrad.fish"
    path.write_text(completion_script("fish", build_parser()))
    subprocess.run(["fish", "-n", str(path)], check=True)

    def complete(line: str) -> list[str]:
        cmd = f"source {path}; complete -C '{line}'"
        out = subprocess.run(["fish", "--no-config", "-c", cmd], capture_output=True, text=True, check=True).stdout
        return [row.split("\t")[0] for row in out.splitlines()]

    assert "train" in complete("klgrad ")
    assert complete("klgrad train --kl.h") == ["--kl.head"]
    assert sorted(complete("klgrad train --kl.head k3")) == ["k3_as_loss", "k3_in_reward"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_script_is_valid_syntax(tmp_path):
    path = tmp_path / "_klgrad"
    path.write_text(completion_script("zsh", build_parser()))
    subprocess.run(["zsh", "-n", str(path)], check=True)
    subprocess.run(["zsh", "-f", "-c", f"autoload -U compinit && compinit -u && source {path}"], check=True)


def test_module_entry_point_still_works():
    out = subprocess.run([sys.executable, "-m", "klgrad", "completion", "bash"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "complete -o default -F _klgrad klgrad" in out.stdout
