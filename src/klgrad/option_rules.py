"""The value rules of the KL and objective options, each written once.

A KL or objective option is set in four places: a run's config (``kl.*``, ``algo.*``; :mod:`klgrad.config`),
:class:`klgrad.objective.ObjectiveSpec` (Python and the verl integration, which builds one), and the TRL plugin's
:class:`klgrad.integrations.trl.KLGradTRLConfig`. Each place names the option its own way (``kl.clip_eps``,
``kl_clip_eps``, ``clip_eps``) and reports the problem under that name; the rule and its words are here. A leaf
module: no klgrad import, no torch, so the config checks a YAML file without a model library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "beta": (lambda v: v >= 0, "must be >= 0"),
    "kl_clip_eps": (lambda v: v is None or 0 < v < 1, "must be in (0, 1) or null (None: importance sampling only)"),
    "clip_eps_low": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "clip_eps_high": (lambda v: v > 0, "must be > 0"),
    "dual_clip": (lambda v: v is None or v > 1, "must be > 1 or null (None: off)"),
    "entropy_coef": (lambda v: v >= 0, "must be >= 0"),
    "std_min": (lambda v: v is None or v > 0, "must be > 0 or null (None: no clip)"),
    "std_max": (lambda v: v is None or v > 0, "must be > 0 or null (None: no clip)"),
    "max_log_ratio": (lambda v: v > 0, "must be > 0"),
}
"""Option -> (holds, what it must be). The key is the option's concept (``kl_clip_eps``: the KL head's clip ε);
each place maps its own field name to it."""


def problem(rule: str, value: Any) -> str | None:
    """What is wrong with ``value`` under ``rule`` (a key of :data:`RULES`), or None when it holds."""
    holds, must = RULES[rule]
    return None if holds(value) else must


def combined_level_problem(form: str, level: str) -> str | None:
    """The combined form puts β·(the head's coefficient) into the reward as a return over the response; a
    per-token term (level ``token``) is no return, so it is refused there (decoupled takes all three levels)."""
    if form == "combined" and level == "token":
        return "'token' is not a return: the combined form needs 'sequence' or 'token_to_go'"
    return None


def choice_problem(value: Any, choices: tuple[str, ...]) -> str | None:
    """``must be one of [...]`` unless ``value`` is one of ``choices``."""
    return None if value in choices else f"must be one of {list(choices)}"
