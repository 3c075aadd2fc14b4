"""Numbers as text for tables and verdicts: one function, :func:`fmt_num`.

Its keyword arguments reproduce each table's established style, so the markdown klgrad writes (and the docs
quote) keeps its exact text:

- default (verdicts of ``k3-gaussian`` / ``k3-uniform-bias``): 4 decimals, scientific below 1e-3 and from 1e4;
- ``fmt_num(x, 3, significant=True)``: three significant figures (the k3 variance sweep);
- ``fmt_num(x, 4, sci_digits=1, sci_from=math.inf, tiny=1e-15, tiny_text="< 1e-15")``: distances at float64
  round-off (``fixed-points``);
- ``fmt_num(x, 3, sci_digits=2, sci_below=1e-2, sci_from=1e3, tiny=1e-12, tiny_text="<1e-12", zero="0")``:
  relative errors of the gradient audit (``klgrad audit``).
"""

from __future__ import annotations

import math

_NON_FINITE_TEXT = {"inf": "∞", "-inf": "-∞", "nan": "nan"}
"""How non-finite numbers print; the keys are also how klgrad's JSON result files store them."""


def fmt_num(
    x: float | str | None,
    digits: int = 4,
    *,
    sci_below: float = 1e-3,
    sci_from: float = 1e4,
    sci_digits: int | None = None,
    tiny: float = 0.0,
    tiny_text: str = "",
    zero: str | None = None,
    significant: bool = False,
    missing: str = "—",
) -> str:
    """``x`` as text. The first rule that applies decides:

    1. ``None`` -> ``missing``.
    2. Non-finite (a float, or the JSON strings ``"inf"``, ``"-inf"``, ``"nan"``) -> ``"∞"``, ``"-∞"``, ``"nan"``;
       any other string is returned unchanged.
    3. Exactly 0 and ``zero`` given -> ``zero``.
    4. ``|x| < tiny`` -> ``tiny_text`` (a quantity below the round-off it is computed to).
    5. ``significant`` -> ``digits`` significant figures (``f"{x:.{digits}g}"``).
    6. ``x != 0`` and ``|x| < sci_below`` or ``|x| >= sci_from`` -> scientific notation with ``sci_digits``
       decimals (default ``max(digits - 1, 1)``).
    7. Otherwise fixed-point with ``digits`` decimals.
    """
    if x is None:
        return missing
    if isinstance(x, str):
        return _NON_FINITE_TEXT.get(x, x)
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("∞" if x > 0 else "-∞")
    if x == 0 and zero is not None:
        return zero
    if abs(x) < tiny:
        return tiny_text
    if significant:
        return f"{x:.{digits}g}"
    if x != 0 and (abs(x) < sci_below or abs(x) >= sci_from):
        return f"{x:.{max(digits - 1, 1) if sci_digits is None else sci_digits}e}"
    return f"{x:.{digits}f}"
