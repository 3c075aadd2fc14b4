"""klgrad.flags: a dataclass's fields as flags, one name from the flag to the record (types, defaults, choices,
lists, booleans, nested records, the older spellings), and errors that name the flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from klgrad.flags import add_flags, flag_name, option, parse_record


def _seeds(text: str) -> tuple[int, ...]:
    if not text.isdigit():
        raise ValueError(f"not a seed: {text!r}")
    return tuple(range(int(text)))


@dataclass(frozen=True)
class Inner:
    gap: float | None = option(None, "a gap", aliases=("--old-gap",))
    decay: float | None = option(0.5, "a fraction", const_aliases={"--no-decay": "none"})
    hidden: int = 7


@dataclass(frozen=True)
class Outer:
    name: str = option(help="required")
    count: int = option(3, "how many", aliases=("--n",))
    rate: float = option(0.1, "a rate")
    level: Literal["a", "b"] = option("a", "a choice")
    values: tuple[float, ...] = option((0.5,), "comma-separated")
    picks: tuple[Literal["x", "y"], ...] = option(("x",), "comma-separated choices")
    path: Path = option(Path("out"), "a folder")
    keep: bool = option(True, "a switch on by default")
    loud: bool = option(False, "a switch off by default")
    seeds: tuple[int, ...] | None = option(None, "parsed by a function", parse=_seeds)
    tags: tuple = option((), "repeatable", repeat=True, legacy={"--tag-count": lambda t: None if t == "0" else f"n{t}"})
    inner: Inner | None = option(None, nested=True, only=("gap", "decay"))
    code_only: str = option("x", flag=False)


def _parse(*argv: str, **fixed) -> Outer:
    p = argparse.ArgumentParser()
    add_flags(p, Outer)
    return parse_record(Outer, p.parse_args(list(argv)), **fixed)


def test_each_field_is_a_flag_of_its_name_typed_with_its_default():
    got = _parse("--name", "g")
    assert got == Outer(name="g")
    assert flag_name("exact_prompts") == "--exact-prompts"
    got = _parse("--name", "g", "--count", "5", "--rate", "0.25", "--level", "b", "--values", "0.1,1", "--picks",
                 "y,x", "--path", "p", "--no-keep", "--loud", "--seeds", "3", code_only="set")  # fmt: skip
    assert got == Outer("g", 5, 0.25, "b", (0.1, 1.0), ("y", "x"), Path("p"), False, True, (0, 1, 2), code_only="set")


def test_older_spellings_and_repeats_reach_the_same_field():
    assert _parse("--name", "g", "--n", "9").count == 9
    assert _parse("--name", "g", "--tags", "a", "--tag-count", "2", "--tags", "b", "--tag-count", "0").tags == (
        "a",
        "n2",
        "b",
    )  # a legacy flag's None (0: off) adds nothing


def test_a_nested_record_is_none_until_one_of_its_flags_is_given():
    assert _parse("--name", "g").inner is None
    assert _parse("--name", "g", "--inner-gap", "0.08").inner == Inner(gap=0.08)
    assert _parse("--name", "g", "--old-gap", "0.08").inner == Inner(gap=0.08)
    assert _parse("--name", "g", "--inner-decay", "none").inner == Inner(decay=None)
    assert _parse("--name", "g", "--no-decay").inner == Inner(decay=None)
    p = argparse.ArgumentParser()
    add_flags(p, Outer)
    assert "--inner-hidden" not in p.format_help()  # only the fields named get a flag


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "x"], "argument --count"),
        (["--level", "c"], "argument --level: invalid choice"),
        (["--picks", "x,z"], "'z' is not one of x, y"),
        (["--seeds", "q"], "not a seed: 'q'"),
        ([], "the following arguments are required: --name"),
    ],
)
def test_a_bad_value_exits_2_naming_its_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(*(["--name", "g"] if argv else []), *argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_help_states_each_default():
    p = argparse.ArgumentParser()
    add_flags(p, Outer)
    text = " ".join(p.format_help().split())
    assert "how many (default 3)" in text
    assert "comma-separated (default 0.5)" in text
    assert "a switch on by default (default on)" in text
    assert "--code-only" not in text
