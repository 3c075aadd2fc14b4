"""Result dicts as JSON: numpy/torch scalars become Python numbers, non-finite floats become strings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch


def jsonable(obj: Any) -> Any:
    """Recursively turn numpy/torch scalars into Python ones and non-finite floats into "inf"/"-inf"/"nan".

    The strings are what :func:`klgrad.fmt.fmt_num` prints as "∞", "-∞", "nan".
    """
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.tolist())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.bool_ | bool):
        return bool(obj)
    if isinstance(obj, np.integer | int):
        return int(obj)
    if isinstance(obj, np.floating | float):
        x = float(obj)
        if math.isfinite(x):
            return x
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return obj


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write an already :func:`jsonable` ``result`` to ``path`` (indent 2, strict JSON: no NaN/Infinity)."""
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
