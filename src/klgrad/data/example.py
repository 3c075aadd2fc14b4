"""One prompt with its ground truth, the unit every task and loader produces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """A prompt and its ground-truth answer.

    Attributes:
        prompt: the text the policy continues.
        answer: the ground truth as a string Math-Verify parses (``"81"``, ``"\\frac{1}{2}"``).
        id: unique within a split (synthetic: derived from the operands; loaded: the id column or
            ``"<file stem>-<row>"``).
        meta: extra columns, handed to reward functions as keyword arguments
            (see :func:`examples_to_columns`).
    """

    prompt: str
    answer: str
    id: str
    meta: dict[str, Any] = field(default_factory=dict)


def examples_to_columns(examples: Sequence[Example]) -> dict[str, list[Any]]:
    """Column view of a batch for reward functions: ``answer``, ``id`` and every ``meta`` key.

    A meta key missing from some examples is filled with None there. ``prompt`` is not a column: reward
    functions receive prompts positionally (TRL signature ``fn(prompts, completions, **columns)``).
    """
    keys: dict[str, None] = {}
    for ex in examples:
        keys.update(dict.fromkeys(ex.meta))
    columns: dict[str, list[Any]] = {
        "answer": [ex.answer for ex in examples],
        "id": [ex.id for ex in examples],
    }
    for key in keys:
        if key in columns:
            raise ValueError(f"meta key {key!r} collides with the built-in column of the same name")
        columns[key] = [ex.meta.get(key) for ex in examples]
    return columns


def repeat_columns(columns: dict[str, list[Any]], times: int) -> dict[str, list[Any]]:
    """Every column's values each repeated ``times`` times in place (``[a, b]`` -> ``[a, a, b, b]`` at 2): the
    columns of G responses per prompt, groups contiguous."""
    return {name: [v for v in col for _ in range(times)] for name, col in columns.items()}
