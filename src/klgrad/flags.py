"""Command-line flags read off a frozen dataclass: one field, one flag, one name from the flag to the code.

A field ``exact_prompts: int = option(20, "held-out prompts of the final KL")`` becomes ``--exact-prompts N``;
the parsed namespace holds it under the field's own name and :func:`parse_record` builds the record from it, so
no command copies flags into a record field by field (CleanRL's typed ``Args`` with tyro, without the dependency).

Types: ``int``, ``float``, ``str``, ``Path``, ``bool`` (``--x`` / ``--no-x``), a ``Literal`` (its values are the
choices), ``tuple[T, ...]`` (one comma-separated value, or a repeated flag with ``repeat=True``, or a positional
with ``positional=True``), ``X | None`` (default None; ``none`` or ``off`` gives None where None is not the
default). A field whose type is itself such a dataclass (``nested=True``) brings that record's flags, under its
``prefix``; the nested record is None unless one of its flags is given. Other types need a ``parse`` function
(``str -> value``), which may raise ValueError (reported by argparse against the flag, exit 2).

Older spellings stay accepted: ``aliases`` (other names of the same flag), ``const_aliases`` (``{"--flag":
"value"}``: a hidden switch that sets the field to that value) and, for a repeated field, ``legacy``
(``{"--flag": parse}``: a hidden flag whose parsed value, unless None, is appended to the field).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

UNSET: Any = object()
"""The namespace value of a nested record's flag that was not given."""


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    aliases: tuple[str, ...] = (),
    const_aliases: Mapping[str, str] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    positional: bool = False,
    repeat: bool = False,
    nested: bool = False,
    prefix: str | None = None,
    only: tuple[str, ...] | None = None,
    legacy: Mapping[str, Callable[[str], Any]] | None = None,
    flag: bool = True,
) -> Any:
    """A dataclass field with what its flag needs (module docstring); ``flag=False``: set by the code, not a flag;
    ``only``: the nested record's fields that get a flag (the rest keep their defaults); ``prefix``: a nested
    record's flag prefix (default its field's name; "" for none)."""
    meta = {
        "help": help,
        "aliases": aliases,
        "const_aliases": dict(const_aliases or {}),
        "metavar": metavar,
        "parse": parse,
        "positional": positional,
        "repeat": repeat,
        "nested": nested,
        "prefix": prefix,
        "only": only,
        "legacy": dict(legacy or {}),
        "flag": flag,
    }
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, dict | list):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field: str, prefix: str = "") -> str:
    """``exact_prompts`` -> ``--exact-prompts`` (``prefix`` ``convergence``: ``--convergence-exact-prompts``)."""
    return "--" + "-".join(p for p in (prefix, field) if p).replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for ``T | None``, else (tp, False)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _scalar_parser(tp: Any) -> tuple[Callable[[str], Any], tuple[str, ...] | None]:
    """(str -> value, choices or None) of a scalar type."""
    if get_origin(tp) is Literal:
        return str, tuple(str(a) for a in get_args(tp))
    if tp in (int, float, str):
        return tp, None
    if tp is Path:
        return Path, None
    raise TypeError(f"no flag parser for {tp!r}: give the field a parse function")


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("none", "off") else parse(text)

    return parse_optional


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError turned into argparse's error for the flag (exit 2, the message kept)."""

    def parse_value(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse_value.__name__ = getattr(parse, "__name__", "value")
    return parse_value


def _describe(default: Any) -> str:
    if default is None or default is False or default in ((), {}, ""):
        return ""
    if isinstance(default, tuple):
        default = ",".join(str(x) for x in default)
    return f" (default {default:.3g})" if isinstance(default, float) else f" (default {default})"


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    dest_prefix: str = "",
    flag_prefix: str = "",
    only: tuple[str, ...] | None = None,
    nested: bool = False,
) -> None:
    """Add one flag per field of the dataclass ``cls`` (module docstring) to ``parser``; each flag's ``dest`` is
    the field's dotted path (``design.convergence.gap`` for a nested record's field)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("flag", True) or (only is not None and f.name not in only):
            continue
        dest = f"{dest_prefix}.{f.name}" if dest_prefix else f.name
        tp, optional = _unwrap_optional(hints[f.name])
        default = f.default
        if meta.get("nested"):
            prefix = f.name if meta.get("prefix") is None else meta["prefix"]
            inner = "-".join(p for p in (flag_prefix, prefix) if p)
            add_flags(parser, tp, dest, inner, meta.get("only"), nested=True)
            continue
        names = [flag_name(f.name, flag_prefix), *meta.get("aliases", ())]
        help_text = meta.get("help", "").replace("%", "%%")  # argparse formats help with %
        shown = None if default is dataclasses.MISSING else default
        kw: dict[str, Any] = {"dest": dest, "help": help_text + _describe(shown)}
        kw["metavar"] = meta.get("metavar") or f.name.upper()
        if nested:  # a nested record's flag that is not given leaves the record None or its default
            kw["default"] = UNSET
        elif default is not dataclasses.MISSING:
            kw["default"] = default
        elif not meta.get("positional"):
            kw["required"] = True
        if tp is bool and not meta.get("parse"):
            kw["help"] = help_text + (" (default on)" if default is True else "")
            kw.pop("metavar")
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            _add_hidden(parser, meta, dest, None)
            continue
        is_tuple = tp is tuple or get_origin(tp) is tuple
        choices = None
        if meta.get("parse"):
            parse = meta["parse"]
        elif is_tuple:
            item = get_args(tp)[0] if get_args(tp) else str
            parse, choices = _scalar_parser(item)
            if not (meta.get("positional") or meta.get("repeat")):
                parse = _comma_list(_choice(parse, choices) if choices else parse)
                choices = None
        else:
            parse, choices = _scalar_parser(tp)
        if optional and not meta.get("parse") and default is not None:
            parse = _or_none(parse)
        kw["type"] = _checked(parse)
        if choices:
            kw["choices"] = choices
            kw.pop("metavar")
        if meta.get("positional"):
            kw.pop("dest")
            kw["nargs"] = "+" if is_tuple else None
            parser.add_argument(dest, **kw)
            continue
        if meta.get("repeat"):
            kw["action"] = "append"
            kw["default"] = UNSET if nested else None
        parser.add_argument(*names, **kw)
        _add_hidden(parser, meta, dest, kw)


def _add_hidden(parser, meta: Mapping, dest: str, kw: dict | None) -> None:
    """The field's older switches (``const_aliases``) and value flags (``legacy``), hidden from the help."""
    for alias, value in meta.get("const_aliases", {}).items():
        const = value if kw is None or "type" not in kw else kw["type"](value)
        parser.add_argument(
            alias, dest=dest, action="store_const", const=const, help=argparse.SUPPRESS, default=argparse.SUPPRESS
        )
    for alias, parse in meta.get("legacy", {}).items():
        parser.add_argument(
            alias, dest=dest, action="append", type=_checked(parse), help=argparse.SUPPRESS, default=argparse.SUPPRESS
        )


def _comma_list(parse_item: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse_list(text: str) -> tuple:
        return tuple(parse_item(x.strip()) for x in text.split(",") if x.strip())

    return parse_list


def _choice(parse: Callable[[str], Any], choices: tuple[str, ...]) -> Callable[[str], Any]:
    def parse_choice(text: str) -> Any:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return parse(text)

    return parse_choice


def parse_record(cls: type, args: argparse.Namespace, prefix: str = "", **fixed: Any) -> Any:
    """The ``cls`` record from a namespace :func:`add_flags` filled (``fixed``: fields the command sets itself).
    A nested record none of whose flags was given is None (its field's default)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            values[f.name] = fixed[f.name]
            continue
        meta = f.metadata
        dest = f"{prefix}.{f.name}" if prefix else f.name
        if meta.get("nested"):
            tp, _ = _unwrap_optional(hints[f.name])
            values[f.name] = _nested(tp, args, dest, f)
            continue
        if not meta.get("flag", True) or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value is UNSET:
            continue
        if meta.get("repeat"):
            value = tuple(v for v in value or () if v is not None)  # a legacy flag's off value is None
        elif isinstance(value, list):  # a positional's nargs="+"
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def _nested(tp: type, args: argparse.Namespace, dest: str, f: dataclasses.Field) -> Any:
    given = any(k.startswith(f"{dest}.") and v is not UNSET for k, v in vars(args).items())
    if given or f.default is dataclasses.MISSING:
        return parse_record(tp, args, dest)
    return f.default
