"""Tasks and datasets: synthetic arithmetic with disjoint splits, and prompt/answer files from disk."""

from klgrad.data.example import Example, examples_to_columns
from klgrad.data.loaders import DataError, LoadResult, load_examples
from klgrad.data.tasks import (
    DISCOVERY_CORRECT_FRACTION,
    HOLDOUT_FRACTION,
    TASKS,
    TaskSpec,
    extract_answer,
    get_task,
    is_heldout,
    make_splits,
    sft_target,
    taught_answer,
)

__all__ = [
    "DISCOVERY_CORRECT_FRACTION",
    "HOLDOUT_FRACTION",
    "TASKS",
    "DataError",
    "Example",
    "LoadResult",
    "TaskSpec",
    "examples_to_columns",
    "extract_answer",
    "get_task",
    "is_heldout",
    "load_examples",
    "make_splits",
    "sft_target",
    "taught_answer",
]
