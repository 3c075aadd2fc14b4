"""A user's object by import path, ``package.module:name``: reward functions, KL heads and audited penalties all
arrive this way (imported with importlib, never ``eval``)."""

from __future__ import annotations

import importlib
import re

from klgrad.choices import IMPORT_PATH


def import_object(spec: str, what: str) -> object:
    """The object at ``package.module:name`` (``name`` may be a dotted attribute path).

    Raises:
        ValueError: ``"{what} {spec!r}: ..."`` when ``spec`` is not of that form, its module cannot be imported
            (whatever the module raised while importing), or the attribute is missing.
    """
    if not isinstance(spec, str) or not re.fullmatch(IMPORT_PATH, spec):
        raise ValueError(f"{what} {spec!r}: expected 'package.module:name'")
    module_name, attr_path = spec.split(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    return obj
