"""``train.stop_when``: a stated criterion on logged metrics that ends a run before ``train.steps``.

Syntax: ``METRIC OP VALUE [for K]``, e.g. ``eval/greedy_accuracy >= 0.9`` or ``kl/k1 > 5 for 3``. ``METRIC`` is a
key of the run's records (docs/metrics.md), ``OP`` one of ``<``, ``<=``, ``>``, ``>=``, and the run stops at the
first step where the condition has held in the last ``K`` records that log ``METRIC`` (default 1). An ``eval/``
metric exists at evaluation steps only, so it is checked there; any other metric at every step. The stopping
step is evaluated and checkpointed like the last one, and the run's ``summary.json`` records
``"stopped": {"criterion", "step", "value"}``. A leaf module (no torch): the config checks the syntax with it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_RULE = re.compile(r"^\s*([A-Za-z0-9_/.\-]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+|[-+]?inf)\s*(?:for\s+(\d+)\s*)?$")


@dataclass(frozen=True)
class StopRule:
    """A parsed ``train.stop_when``."""

    metric: str
    op: str
    value: float
    times: int = 1

    @property
    def text(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}" + (f" for {self.times}" if self.times > 1 else "")

    def holds(self, x: float | None) -> bool:
        """The condition on one logged value (None, a non-finite value logged as null, never holds)."""
        return x is not None and OPS[self.op](x, self.value)


def parse_stop_rule(text: str) -> StopRule:
    """``METRIC OP VALUE [for K]`` → :class:`StopRule`; raises ValueError with the expected form."""
    m = _RULE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not 'METRIC OP VALUE [for K]' (OP: <, <=, >, >=), e.g. 'kl/k1 > 5 for 3'")
    metric, op, value, times = m.groups()
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"{text!r}: VALUE of METRIC OP VALUE, {value!r}, is not a number") from None
    k = int(times) if times else 1
    if k < 1:
        raise ValueError(f"{text!r}: 'for K' in METRIC OP VALUE [for K] needs K >= 1")
    return StopRule(metric, op, v, k)


def stop_point(records: Sequence[dict], rule: StopRule) -> dict | None:
    """The first record step at which ``rule`` has held in the last ``rule.times`` records logging its metric:
    ``{"criterion", "step", "value"}``, or None. Pure: the loop and the run's summary both use it."""
    run = 0
    for r in records:
        if r.get("step", 0) < 1 or rule.metric not in r:  # step 0 is the reference's own evaluation
            continue
        run = run + 1 if rule.holds(r[rule.metric]) else 0
        if run >= rule.times:
            return {"criterion": rule.text, "step": r["step"], "value": r[rule.metric]}
    return None


def check_stop_rule(text: str) -> str:
    """``text`` when it parses as a rule (the config's check of ``train.stop_when``); else the ValueError."""
    parse_stop_rule(text)
    return text
