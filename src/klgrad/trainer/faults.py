"""The seam the reliability tests reach into a run through (docs/reliability.md, "Fault injection").

A run holds one :class:`Hooks`; the loop, the update and the checkpoint writer call it at fixed points and it does
nothing unless a test (or ``KLGRAD_KILL_AT`` / ``KLGRAD_NAN_AT``, read once by :meth:`Hooks.from_env` when
``klgrad train`` starts) installs callbacks. Nothing else of the trainer knows about faults.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

POINTS = ("rollout", "update", "log", "checkpoint_file", "checkpoint_rename")
"""Where :attr:`Hooks.at` is called, in the order a step passes them (record step ``s``)."""


def _nothing(point: str, step: int) -> None:
    return None


def _never(step: int) -> bool:
    return False


@dataclass(frozen=True)
class Hooks:
    """Callbacks at a run's fault points; the defaults do nothing."""

    at: Callable[[str, int], None] = _nothing
    """``at(point, step)``: the run reaches ``point`` (one of :data:`POINTS`) at record step ``step``."""
    nan: Callable[[int], bool] = _never
    """``nan(step)``: True makes the loss of record step ``step`` NaN (the non-finite-update guard's test)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Hooks:
        """``KLGRAD_KILL_AT="<point>:<step>"`` SIGKILLs the process at that point and step;
        ``KLGRAD_NAN_AT="2,3"`` makes those steps' losses NaN. Unset: :data:`NO_HOOKS`."""
        kill_at, nan_at = environ.get("KLGRAD_KILL_AT"), environ.get("KLGRAD_NAN_AT")

        def at(point: str, step: int) -> None:
            if f"{point}:{step}" == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def nan(step: int) -> bool:
            return str(step) in (nan_at or "").split(",")

        return cls(at if kill_at else _nothing, nan if nan_at else _never)


NO_HOOKS = Hooks()
"""A run without fault injection."""
