"""The test folders mirror ``src/klgrad/``; the helpers every folder shares (tolerances, the tiny test models, the
PNG and case-count checks, a small training config) live in ``tests/helpers/`` and are imported by bare name
(``from tolerances import gamma``). Test modules are imported with ``--import-mode=importlib`` (pyproject), so
two of the same name in different folders do not collide and pytest puts no test folder on ``sys.path``: this
file puts ``tests/helpers`` there, before any test module is collected."""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))
