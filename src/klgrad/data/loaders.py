"""Prompt/answer datasets from disk: JSONL, parquet, ``datasets`` folders, and JSON / CSV.

Every row is validated; a bad row raises :class:`DataError` naming the file, the 1-based row (for JSONL: the
line number, blank lines included) and the column, or is skipped and counted with ``skip_bad_rows=True``.

A row is bad when: it is not valid UTF-8 or not valid JSON (JSONL), it is not an object, the prompt or answer
column is missing, the prompt is not a non-blank string, or the answer is not a non-blank string or a finite
int/float (converted with ``str``; integral floats lose their ``.0``, since parquet and CSV turn integer
columns holding a null into floats). Lists, dicts, None and booleans are rejected.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klgrad.data.example import Example

logger = logging.getLogger(__name__)

RESERVED_COLUMNS = ("prompt", "answer", "id")
"""Names :func:`klgrad.data.examples_to_columns` owns; source columns of these names never enter ``meta``."""


class DataError(ValueError):
    """A dataset file that cannot be used as it is; the message names the file, row and column."""


@dataclass(frozen=True)
class LoadResult:
    examples: list[Example]
    skipped: int
    """Bad rows skipped (always 0 unless ``skip_bad_rows``)."""
    source: str
    """``"<format>:<resolved path>"``, e.g. ``"jsonl:/data/train.jsonl"``."""


class _BadRow:
    """A row the reader could not turn into a dict (bad bytes, bad JSON, not an object)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


Row = dict[str, Any] | _BadRow


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Row]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, _BadRow(f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield line_no, _BadRow(f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            yield (
                line_no,
                obj if isinstance(obj, dict) else _BadRow(f"expected a JSON object, got {type(obj).__name__}"),
            )


def _parquet_rows(path: Path) -> Iterator[tuple[int, Row]]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches()
        row_no = 0
        for batch in batches:
            for row in batch.to_pylist():
                row_no += 1
                yield row_no, row
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise DataError(f"{path}: cannot read as parquet: {e}") from e


def _datasets_folder_rows(path: Path) -> Iterator[tuple[int, Row]]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict with splits {sorted(ds)}; pass one split's folder")
    yield from enumerate(ds, start=1)


def _builder_rows(path: Path, builder: str) -> Iterator[tuple[int, Row]]:
    """JSON / CSV through ``datasets.load_dataset``, its cache in a temporary folder removed afterwards."""
    import datasets

    with tempfile.TemporaryDirectory(prefix="klgrad-data-") as cache:
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
            rows = ds.to_list()
        except Exception as e:  # datasets wraps parse errors in several exception types
            raise DataError(f"{path}: cannot read as {builder}: {e}") from e
        del ds
    yield from enumerate(rows, start=1)


_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".json": "json", ".csv": "csv"}


def _detect(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise DataError(f"{path}: a DatasetDict with splits {splits}; pass one split's folder")
        if (path / "state.json").exists() or (path / "dataset_info.json").exists():
            return "datasets"
        raise DataError(f"{path}: a folder without state.json / dataset_info.json (not Dataset.save_to_disk)")
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected one of {sorted(_SUFFIXES)}")
    return kind


def _as_text(value: Any, *, numbers: bool) -> tuple[str | None, str]:
    """``(text, "")`` for a usable value, ``(None, reason)`` otherwise."""
    if isinstance(value, str):
        return (value, "") if value.strip() else (None, "empty string")
    if numbers and isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(value, float):
            if not math.isfinite(value):
                return None, f"non-finite number {value}"
            if value.is_integer():
                return str(int(value)), ""
        return str(value), ""
    expected = "a string or a number" if numbers else "a string"
    return None, f"expected {expected}, got {type(value).__name__}"


def load_examples(
    path: str | os.PathLike[str],
    *,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    id_column: str | None = None,
    skip_bad_rows: bool = False,
    max_rows: int | None = None,
) -> LoadResult:
    """Read prompts and answers from a ``.jsonl``, ``.parquet``, ``.json`` or ``.csv`` file, or a folder
    written by ``Dataset.save_to_disk``.

    Args:
        path: the file or folder.
        prompt_column: column holding the prompt text.
        answer_column: column holding the ground truth (string or number).
        id_column: column holding unique ids (string or int); None gives ``"<file stem>-<row>"``.
        skip_bad_rows: skip and count bad rows instead of raising.
        max_rows: stop after this many valid examples (bad rows after them are not inspected).

    Returns:
        :class:`LoadResult`. Each example's ``meta`` holds the row's other columns, except those named
        ``prompt``, ``answer`` or ``id`` (see :data:`RESERVED_COLUMNS`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataError: unsupported file, unreadable file, a bad row (unless ``skip_bad_rows``), no valid row at
            all, or a duplicate id (always: skipping one of two rows that share an id would hide which is
            right).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such data file or folder", str(path))
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    kind = _detect(path)
    if kind == "jsonl":
        rows = _jsonl_rows(path)
    elif kind == "parquet":
        rows = _parquet_rows(path)
    elif kind == "datasets":
        rows = _datasets_folder_rows(path)
    else:
        rows = _builder_rows(path, kind)

    examples: list[Example] = []
    skipped = 0
    first_row_of_id: dict[str, int] = {}
    used = {prompt_column, answer_column, id_column, *RESERVED_COLUMNS}

    def bad(row_no: int, reason: str, column: str | None = None) -> None:
        nonlocal skipped
        where = f"{path}: row {row_no}" + (f": column {column!r}" if column is not None else "")
        if not skip_bad_rows:
            raise DataError(f"{where}: {reason}")
        skipped += 1
        logger.debug("skipped %s: %s", where, reason)

    for row_no, row in rows:
        if isinstance(row, _BadRow):
            bad(row_no, row.reason)
            continue
        fields: dict[str, str] = {}
        for column, numbers in ((prompt_column, False), (answer_column, True), (id_column, True)):
            if column is None:
                continue
            if column not in row:
                bad(row_no, f"missing column (row has {sorted(row)})", column)
                break
            text, reason = _as_text(row[column], numbers=numbers)
            if text is None:
                bad(row_no, reason, column)
                break
            fields[column] = text
        else:
            ex_id = fields[id_column] if id_column is not None else f"{path.stem}-{row_no}"
            if ex_id in first_row_of_id:
                raise DataError(
                    f"{path}: rows {first_row_of_id[ex_id]} and {row_no}: duplicate id {ex_id!r}"
                    f" in column {id_column!r}"
                )
            first_row_of_id[ex_id] = row_no
            meta = {k: v for k, v in row.items() if k not in used}
            examples.append(Example(fields[prompt_column], fields[answer_column].strip(), ex_id, meta))
            if max_rows is not None and len(examples) >= max_rows:
                break
    if hasattr(rows, "close"):
        rows.close()

    if not examples:
        raise DataError(f"{path}: no valid rows ({skipped} skipped)")
    if skipped:
        logger.warning("%s: skipped %d bad rows", path, skipped)
    return LoadResult(examples=examples, skipped=skipped, source=f"{kind}:{path.resolve()}")
