"""Fault-injection hooks for the reliability tests (documented in docs/reliability.md).

Both read an environment variable and are a dictionary lookup when it is unset (normal use).
"""

from __future__ import annotations

import os
import signal


def fault(point: str, step: int) -> None:
    """``KLGRAD_KILL_AT="<point>:<step>"`` SIGKILLs this process when the loop reaches ``point`` at record step
    ``step``. Points: ``rollout``, ``update``, ``log``, ``checkpoint_file``, ``checkpoint_rename``."""
    spec = os.environ.get("KLGRAD_KILL_AT")
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def nan_injected(step: int) -> bool:
    """``KLGRAD_NAN_AT="2,3"`` makes the loss of those record steps NaN (exercises the skip logic)."""
    spec = os.environ.get("KLGRAD_NAN_AT")
    return bool(spec) and str(step) in spec.split(",")
