"""The learning-rate schedule shared by ``klgrad train`` and ``klgrad sft``."""

from __future__ import annotations

import math
from typing import get_args

from klgrad.choices import Schedule

SCHEDULES: tuple[str, ...] = get_args(Schedule)


def lr_factor(step: int, total: int, warmup: int, schedule: Schedule) -> float:
    """Multiplier of the base learning rate at optimizer ``step`` of ``total``: linear warm-up, then a decay.

    step < warmup: (step + 1) / warmup. After, with progress p = min(1, (step − warmup) / max(1, total − warmup)):
    constant 1; cosine ½(1 + cos πp); linear 1 − p.
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0
