r"""Regex format rewards: 1.0 when a completion has the expected shape, else 0.0.

Patterns (matched in full against the stripped completion):

- ``addition`` and ``addition_discovery``: digits only, ``\d+``;
- ``scratchpad``: the column-addition grammar of :mod:`klgrad.data.tasks`, e.g. ``7+8=15c1;0+5+1=6c0;=65``;
- ``boxed``: any text holding ``\boxed{`` followed later by ``}`` (word problems answered in LaTeX);
- ``think_answer``: ``<think>...</think>`` then ``<answer>...</answer>``, the R1 / Open-R1 format of the
  paper's setting.
"""

from __future__ import annotations

import re
from typing import Any

from klgrad.data.tasks import TASKS

FORMAT_PATTERNS: dict[str, str] = {
    **{name: spec.format_pattern for name, spec in TASKS.items()},
    # Atomic groups keep both linear in the completion's length (no catastrophic backtracking): the first
    # \boxed{ is followed by a } somewhere; tags do not nest.
    "boxed": r"(?>.*?\\boxed\{)(?>.*\}).*",
    "think_answer": r"<think>(?>(?:(?!</think>).)*)</think>\s*<answer>(?>(?:(?!</answer>).)*)</answer>",
}


def regex_format_reward(
    completions: list[str], pattern: str | re.Pattern[str], *, full_match: bool = True
) -> list[float]:
    """1.0 per completion that matches ``pattern``, else 0.0 (non-strings too).

    The completion is stripped of surrounding whitespace first. ``full_match=True`` uses ``re.fullmatch``,
    otherwise ``re.search``. A string pattern is compiled with ``re.DOTALL`` so ``.`` spans lines.
    The built-in patterns run in time linear in the completion's length; a pattern of yours that can
    backtrack catastrophically is yours to bound.
    """
    regex = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.DOTALL)
    match = regex.fullmatch if full_match else regex.search
    return [1.0 if isinstance(c, str) and match(c.strip()) else 0.0 for c in completions]


def format_pattern(name: str) -> str:
    """The pattern of a task or format name in :data:`FORMAT_PATTERNS`."""
    try:
        return FORMAT_PATTERNS[name]
    except KeyError:
        raise ValueError(f"no format pattern named {name!r}; known: {sorted(FORMAT_PATTERNS)}") from None


def make_format_reward(name_or_pattern: str) -> Any:
    """A TRL-signature reward ``fn(prompts, completions, **columns)`` for one fixed format.

    ``name_or_pattern`` is a key of :data:`FORMAT_PATTERNS` or else a regex.
    """
    pattern = re.compile(FORMAT_PATTERNS.get(name_or_pattern, name_or_pattern), re.DOTALL)

    def format_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return regex_format_reward(completions, pattern)

    format_reward.__name__ = f"format_{name_or_pattern}" if name_or_pattern in FORMAT_PATTERNS else "format"
    return format_reward
