"""YAML and dotted flags -> the records of :mod:`klgrad.config.sections`: one pydantic validation, every problem at once
(:func:`problem_lines`); its JSON schema feeds the flags' help, docs/configuration.md, the shipped schema. No torch."""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import json
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from klgrad.choices import HEAD_RESOLVERS
from klgrad.config import sections
from klgrad.config.sections import AlgoConfig, Config, KLConfig, KLHeadOptions  # noqa: F401 (the records' home)


class ConfigError(ValueError):
    """A configuration problem: one line per problem (``problems``), each starting with the dotted field."""

    problems = property(lambda self: str(self).splitlines())


_adapter = functools.cache(TypeAdapter)  # the validator and serializer of a record class, built on first use


@functools.cache
def json_schema() -> dict[str, Any]:
    """A config file's JSON schema (pydantic's, read-only); inherited fields get their base record's doc."""
    schema = _adapter(Config).json_schema()
    for name, definition in schema["$defs"].items():
        for key, prop in definition["properties"].items():
            infos = [getattr(b, "__pydantic_fields__", {}).get(key) for b in getattr(sections, name).__mro__]
            prop.setdefault("description", next((i.description for i in infos if i and i.description), ""))
    return {**schema, "title": "klgrad config", "$schema": "https://json-schema.org/draft/2020-12/schema"}


def _at(loc: tuple) -> tuple[dict[str, Any], int]:
    """The schema of the field ``loc`` names, and how many parts of ``loc`` name it (the rest are union tags)."""
    defs, node, n = json_schema()["$defs"], json_schema(), 0
    for part in loc:
        node = defs[node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node
        if part not in node.get("properties", {}) and not (isinstance(part, int) and "items" in node):
            break
        node, n = node["items"] if isinstance(part, int) else node["properties"][part], n + 1
    return (defs[node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node), n


def _where(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))


def _suggest(word: Any, options: list | None) -> str:
    near = difflib.get_close_matches(word, options or [], n=1) if isinstance(word, str) else []
    return f"; did you mean {near[0]!r}?" if near else ""


BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
QUOTE = " (YAML read it as a number or boolean: quote it to keep it text)"


def _message(err: dict[str, Any]) -> list[str]:
    """One pydantic error as ``dotted.field message`` lines, in pydantic's words, "did you mean" for a near miss."""
    loc, kind, value, ctx = err["loc"], err["type"], err.get("input"), err.get("ctx") or {}
    (node, n), got = _at(loc), reprlib.repr(value)
    union = n < len(loc) and "anyOf" in node  # loc ends in a union member's tag: name the field
    where = _where(loc[:n] if union else loc)
    if kind == "value_error":  # a record's rules across its fields (sections.require): "field message" lines
        lines = [line.split(" ", 1) for line in str(ctx["error"]).splitlines()]
        return [f"{_where((*loc, *name.split('.')))} {msg}" for name, msg in lines]
    if kind == "unexpected_keyword_argument":
        allowed = list(_at(loc[:-1])[0]["properties"])
        return [f"{where} is not a config field; allowed here: {allowed}{_suggest(loc[-1], allowed)}"]
    if union and kind not in BOUNDS:  # no member took the value
        words = {"integer": "an integer", "number": "a number"}
        members = [repr(m["const"]) if "const" in m else words.get(m["type"], m["type"]) for m in node["anyOf"]]
        return [f"{where} must be {' or '.join(members)}, got {got}"]
    if "Input should be" not in err["msg"]:  # pydantic's own sentence ("Field required", "List should have ...")
        return [f"{where or 'config'} {err['msg'][0].lower()}{err['msg'][1:]}"]
    choices = re.findall(r"'([^']*)'", ctx["expected"]) if kind == "literal_error" else ctx.get("expected")
    hint = QUOTE if kind == "string_type" and isinstance(value, int | float) else ""
    return [f"{where or 'config'} {err['msg'].replace('Input should be', 'must be')}, got {got}{hint}"
            + _suggest(value, choices if kind in ("literal_error", "choice_or_import_path") else None)]  # fmt: skip


def problem_lines(errors: list[dict[str, Any]]) -> list[str]:
    """One line per problem: a union field (``train.threads``) gets its member's bound, or every member named."""
    field = lambda e: e["loc"][: _at(e["loc"])[1]]  # noqa: E731
    bounded = {field(e) for e in errors if e["type"] in BOUNDS}
    kept = [e for e in errors if not (field(e) != e["loc"] and e["type"] not in BOUNDS and field(e) in bounded)]
    return list(dict.fromkeys(line for e in kept for line in _message(e)))


def to_dict(record: Any) -> dict:
    """A record (the config or a section) as plain nested data (tuples as lists), ready for YAML/JSON."""
    return _adapter(type(record)).dump_python(record, mode="json")


# PyYAML's safe loader and dumper (no Python object tags), reading and quoting the YAML 1.2 floats that YAML 1.1
# reads as strings: 1e-6, 1E-4, -.5, 1.0e6 (integers stay integers)
ConfigLoader, ConfigDumper = type("ConfigLoader", (yaml.SafeLoader,), {}), type("ConfigDumper", (yaml.SafeDumper,), {})
for _cls in (ConfigLoader, ConfigDumper):
    _float = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?=[eE]))(?:[eE][-+]?[0-9]+)?$")
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _float, list("-+.0123456789"))


def load_yaml(text: str) -> Any:
    """Config YAML -> Python (:class:`ConfigLoader`); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=ConfigLoader)  # safe: ConfigLoader is a SafeLoader


def dump_yaml(data: Any, sort_keys: bool = False) -> str:
    """Python -> config YAML that :func:`load_yaml` reads back unchanged."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=sort_keys)


def parse_value(text: str) -> Any:
    """A flag's value in YAML scalar/list syntax (``0.5``, ``1e-6``, ``null``, ``[0.9, 0.95]``), else the text."""
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text


def parse_override_args(args: list[str]) -> dict[str, Any]:
    """``["--kl.head", "k3_as_loss", "--kl.beta=0.5"]`` -> ``{"kl.head": "k3_as_loss", "kl.beta": 0.5}``."""
    out, rest = {}, list(args)
    while rest:
        flag = rest.pop(0)
        key, eq, value = flag[2:].partition("=")
        if not flag.startswith("--") or not key or not (eq or rest):
            raise ConfigError(f"override {flag!r} must look like --section.field VALUE (a value is needed)")
        out[key] = parse_value(value if eq else rest.pop(0))
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """YAML file + dotted overrides (``{"kl.beta": 0.1}``) -> :class:`Config` (:func:`resolve_heads`), or a
    :class:`ConfigError` of all."""
    p = None if path is None else resolve_config_path(path)
    if p is not None and not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = {} if p is None else load_yaml(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    data = {k: {} if v is None else v for k, v in load_yaml(dump_yaml(data)).items()}  # a copy; empty = defaults
    for dotted, value in (overrides or {}).items():
        *names, name = dotted.split(".")
        node = functools.reduce(lambda d, k: d.setdefault(k, {}) if isinstance(d, dict) else d, names, data)
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {names[-1]} is not a section")
        node[name] = value
    try:  # JSON mode: strict types, yet sections are given as mappings
        cfg = _adapter(Config).validate_json(json.dumps(data, default=str))
    except ValidationError as e:
        raise ConfigError("\n".join(problem_lines(e.errors()))) from None
    return resolve_heads(cfg)


def resolve_heads(cfg: Config) -> Config:
    """``cfg`` through the registered resolvers (:data:`klgrad.choices.HEAD_RESOLVERS`: a framework preset id becomes
    its KL term, with the preset's level, form and aggregation; an unknown id a :class:`ConfigError`). Idempotent."""
    return functools.reduce(lambda resolved, resolve: resolve(resolved), HEAD_RESOLVERS, cfg)


def resolve_config_path(path: str | Path) -> Path:
    """``path`` when it exists (or is absolute), else the shipped config it names (``[configs/]tiny_add.yaml``)."""
    p, parts = Path(path), Path(path).parts[1:] if Path(path).parts[:1] == ("configs",) else Path(path).parts
    shipped = importlib.resources.files("klgrad").joinpath("configs", *parts) if parts and ".." not in parts else None
    return Path(str(shipped)) if not (p.is_file() or p.is_absolute()) and shipped and shipped.is_file() else p
