"""Figures without a display: pyplot with the Agg backend, and a save that closes the figure.

matplotlib stays optional at import time: nothing here imports it until a figure is drawn.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """``matplotlib.pyplot``, with the non-interactive Agg backend selected if pyplot is not imported yet.

    A session that already imported pyplot (a notebook, an interactive shell) keeps its backend: switching
    would close its open figures, and every backend can write files.
    """
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: str | os.PathLike[str], dpi: float, **savefig_kwargs: Any) -> None:
    """Write ``fig`` to ``path`` at ``dpi`` (extra keywords go to ``Figure.savefig``) and close it.

    pyplot keeps every figure it created alive until it is closed; closing here bounds the memory of a
    process that draws many.
    """
    fig.savefig(path, dpi=dpi, **savefig_kwargs)
    pyplot().close(fig)
