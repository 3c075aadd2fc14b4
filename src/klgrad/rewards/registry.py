"""Reward functions by name, and their isolated, weighted evaluation.

A reward function has TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``: one value
per completion, the dataset's columns (``answer``, ``task``, ...) as keyword lists aligned with
``completions``. ``None`` means "no opinion" (the function does not apply to that sample): it adds 0 to the
total and stays None in ``RewardResult.per_function``.

:func:`compute_rewards` isolates each function: one that raises, runs past ``timeout_s``, returns a wrong
length or a non-sequence, or returns a non-number / NaN / inf for some samples, gives those samples
``failure_value``; the failure is counted and logged, and the other functions' values are used as usual.

Timeouts: each call runs in its own daemon thread, joined with ``timeout_s``. Python cannot kill a thread,
so a timed-out call is abandoned: it keeps running (and holding the GIL at times) until it returns on its
own, and its result is discarded. Daemon threads do not keep the interpreter alive at exit. Reward
functions must therefore be thread-safe and must not rely on ``signal`` (Math-Verify's own timeouts raise
outside the main thread: use :func:`klgrad.rewards.math_verify_reward`, which bounds itself).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from klgrad.choices import ACCURACY_REWARDS, IMPORT_PATH
from klgrad.data.tasks import final_number
from klgrad.import_path import import_object
from klgrad.rewards.accuracy import math_verify_reward
from klgrad.rewards.format import FORMAT_PATTERNS, regex_format_reward

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


def accuracy_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Built-in ``accuracy``: Math-Verify equality of each completion with the ``answer`` column."""
    if "answer" not in columns:
        raise ValueError("the accuracy reward needs an 'answer' column")
    return math_verify_reward(completions, columns["answer"])


def format_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Built-in ``format``: the completion fully matches the pattern named by its ``task`` column.

    Synthetic examples carry ``task`` in their meta; for loaded datasets pass a ``task`` column holding a
    key of :data:`klgrad.rewards.FORMAT_PATTERNS` (e.g. ``"boxed"``), or use ``make_format_reward``.
    """
    if "task" not in columns:
        raise ValueError(f"the format reward needs a 'task' column naming one of {sorted(FORMAT_PATTERNS)}")
    out = []
    for completion, task in zip(completions, columns["task"], strict=True):
        if task not in FORMAT_PATTERNS:
            raise ValueError(f"no format pattern for task {task!r}; known: {sorted(FORMAT_PATTERNS)}")
        out.extend(regex_format_reward([completion], FORMAT_PATTERNS[task]))
    return out


def final_number_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Built-in ``final_number``: Math-Verify equality of the completion's *last number* with the ``answer``.

    For chat models on arithmetic. Math-Verify reads a completion's rightmost expression, so a response that
    only restates the question (``"To calculate 502 + 703, we need to add"``) evaluates ``502 + 703`` and scores
    as correct: measured on SmolLM2-135M-Instruct, greedy responses that never state a result scored 1.0 on
    3-digit addition. Reading the last number alone closes that: the model must write the result.
    """
    if "answer" not in columns:
        raise ValueError("the final_number reward needs an 'answer' column")
    return math_verify_reward([final_number(c) or "" for c in completions], columns["answer"])


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "final_number": final_number_reward,
    "format": format_reward,
}


def accuracy_reward_name(names: Iterable[str]) -> str | None:
    """The first of :data:`ACCURACY_REWARDS` among ``names`` (a run's reward names), or None."""
    present = set(names)
    return next((n for n in ACCURACY_REWARDS if n in present), None)


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name (``"accuracy"``, ``"final_number"``, ``"format"``) or ``"package.module:function"``,
    imported with importlib (never ``eval``); ``function`` may be a dotted attribute path.

    Raises:
        ValueError: naming ``spec`` when it is malformed, its module cannot be imported, the attribute is
            missing or not callable, or it cannot take ``(prompts, completions)`` positionally.
    """
    if not isinstance(spec, str):
        raise ValueError(f"reward spec {spec!r}: expected a string, got {type(spec).__name__}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if not re.fullmatch(IMPORT_PATH, spec):
        raise ValueError(
            f"reward spec {spec!r}: expected a built-in name {sorted(BUILTIN_REWARDS)} or 'package.module:function'"
        )
    obj: Any = import_object(spec, "reward spec")
    if not callable(obj):
        raise ValueError(f"reward spec {spec!r}: {type(obj).__name__} object is not callable")
    try:
        inspect.signature(obj).bind_partial([], [])
    except TypeError as e:
        raise ValueError(f"reward spec {spec!r}: must accept (prompts, completions, **columns): {e}") from e
    except ValueError:  # no signature available (some builtins): trust it
        pass
    return obj


@dataclass(frozen=True)
class RewardSpec:
    """A reward function, the name its values are logged under, and its weight in the total."""

    name: str
    fn: RewardFn
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"reward name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise ValueError(f"reward {self.name!r}: fn is not callable")
        if not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {self.weight}")

    @classmethod
    def load(cls, spec: str, weight: float = 1.0, name: str | None = None) -> RewardSpec:
        """:func:`load_reward_fn` ``spec``, named ``name`` (default: the spec itself)."""
        return cls(name or spec, load_reward_fn(spec), weight)


@dataclass(frozen=True)
class RewardResult:
    total: list[float]
    """Per sample: sum over functions of weight * value (None counts 0, a failure ``failure_value``)."""
    per_function: dict[str, list[float | None]]
    """Per function and sample: the value, None ("no opinion"), or ``failure_value`` where it failed."""
    failures: dict[str, int]
    """Per function: samples that got ``failure_value`` (a failed call counts all its samples)."""
    errors: dict[str, list[str]] = field(default_factory=dict)
    """Per function: one message per failure (a failed call, or a bad value with its sample index)."""

    def means(self) -> dict[str, float]:
        """Mean of each function's values over samples where it had an opinion (NaN if none)."""
        out = {}
        for name, values in self.per_function.items():
            seen = [v for v in values if v is not None]
            out[name] = sum(seen) / len(seen) if seen else math.nan
        return out


def merge_rewards(parts: list[RewardResult]) -> RewardResult:
    """The reward results of consecutive row blocks (ranks, in order) as one result over all rows."""
    if len(parts) == 1:
        return parts[0]
    failing = {name for p in parts for name in p.failures}
    erring = {name for p in parts for name in p.errors}
    return RewardResult(
        total=[v for p in parts for v in p.total],
        per_function={name: [v for p in parts for v in p.per_function[name]] for name in parts[0].per_function},
        failures={name: sum(p.failures.get(name, 0) for p in parts) for name in failing},
        errors={name: [e for p in parts for e in p.errors.get(name, [])] for name in erring},
    )


_TIMEOUT = object()


def _call_with_timeout(fn: RewardFn, args: tuple, kwargs: dict, timeout_s: float) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, reason)`` when ``fn`` raised or outlived ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # a reward function's SystemExit must not end the run either
            box["error"] = e

    thread = threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"timed out after {timeout_s:g} s (thread abandoned)"
    if "error" in box:
        e = box["error"]
        return None, f"raised {type(e).__name__}: {e}"
    return box["result"], None


def _check_value(value: Any) -> float | str | None:
    """A float, None, or a string saying why ``value`` is not a usable reward."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        return f"non-number {type(value).__name__}"
    as_float = float(value)
    if not math.isfinite(as_float):
        return f"non-finite {as_float}"
    return as_float


def compute_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    *,
    failure_value: float = 0.0,
    timeout_s: float = 5.0,
) -> RewardResult:
    """Evaluate every reward function on a batch, isolating failures, and sum them with their weights.

    Args:
        specs: the functions; names must be unique.
        prompts: one per completion (repeat a prompt for each of its group's completions).
        completions: the generated texts.
        columns: dataset columns, each aligned with ``completions``, passed as keyword arguments.
        failure_value: value given to a sample whose function failed (see module docstring).
        timeout_s: wall-clock limit of one function's call on the whole batch.

    Returns:
        :class:`RewardResult`. Functions run one after another, each on fresh copies of the lists.
    """
    n = len(completions)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique, got {names}")
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts but {n} completions")
    for key, column in columns.items():
        if len(column) != n:
            raise ValueError(f"column {key!r} has {len(column)} values but there are {n} completions")
    if not (timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")

    total = [0.0] * n
    per_function: dict[str, list[float | None]] = {}
    failures: dict[str, int] = {}
    errors: dict[str, list[str]] = {}
    for spec in specs:
        kwargs = {key: list(column) for key, column in columns.items()}
        result, reason = _call_with_timeout(spec.fn, (list(prompts), list(completions)), kwargs, timeout_s)
        messages: list[str] = []
        if reason is None and (isinstance(result, str | bytes | Mapping) or not hasattr(result, "__len__")):
            reason = f"returned {type(result).__name__}, expected a list of {n} values"
        elif reason is None and len(result) != n:
            reason = f"returned {len(result)} values for {n} completions"
        if reason is not None:
            values: list[float | None] = [failure_value] * n
            messages.append(reason)
        else:
            values = []
            for i, raw in enumerate(result):
                checked = _check_value(raw)
                if isinstance(checked, str):
                    messages.append(f"sample {i}: {checked}")
                    checked = failure_value
                values.append(checked)
        failed = n if reason is not None else len(messages)
        for message in messages:
            logger.warning("reward %r: %s; sample(s) get %g", spec.name, message, failure_value)
        for i, value in enumerate(values):
            if value is not None:
                total[i] += spec.weight * value
        per_function[spec.name] = values
        failures[spec.name] = failed
        errors[spec.name] = messages
    return RewardResult(total=total, per_function=per_function, failures=failures, errors=errors)
