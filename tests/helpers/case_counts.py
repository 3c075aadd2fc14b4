"""Counts of the cases the reliability tests ran, by kind (docs/reliability.md reports them).

tests/trainer/test_reliability.py, the config fuzzing in tests/config/test_config.py and the dataset fuzzing in
tests/data/test_data.py add to :data:`CASES`. With ``KLGRAD_RELIABILITY_COUNTS=PATH`` each of those modules writes
the running total of this pytest process to PATH (JSON) when it finishes, so the file holds the counts of every such
module run.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

CASES: collections.Counter[str] = collections.Counter()


def report_counts() -> dict[str, int]:
    """The counts so far, sorted by kind; also written to ``$KLGRAD_RELIABILITY_COUNTS`` when that is set."""
    counts = dict(sorted(CASES.items()))
    if os.environ.get("KLGRAD_RELIABILITY_COUNTS"):
        Path(os.environ["KLGRAD_RELIABILITY_COUNTS"]).write_text(json.dumps(counts, indent=1))
    return counts
