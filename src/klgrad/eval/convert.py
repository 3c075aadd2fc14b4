r"""Convert public benchmark files you have downloaded into klgrad's format: JSONL rows ``{"id", "prompt", "answer"}``.

    klgrad convert-benchmarks MATH-500/test.jsonl --name math500 --out benchmarks/
    klgrad convert-benchmarks gpqa_diamond.csv --out benchmarks/ --format gpqa
    klgrad eval --model embedded --data benchmarks/math500.jsonl ...

Source layouts it knows (``--format auto``, the default, picks one from the first row's columns):

- ``problem_answer``: a problem column (``problem``, ``Problem``, ``question``, ``Question`` or ``prompt``) and
  ``answer`` / ``Answer``: MATH-500 ``test.jsonl``, AIME 2024 / 2025, AMC (``answer`` 142.0 -> ``142``);
- ``boxed_solution``: ``problem`` + ``solution``, whose last ``\boxed{...}`` is the answer: Minerva math, MATH;
- ``olympiadbench``: ``question`` + ``final_answer`` (a list; several answers joined by ``, ``): OlympiadBench;
- ``gsm8k``: ``question`` + ``answer`` ending in ``#### 72`` (thousands commas dropped): GSM8K;
- ``gpqa``: ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``, the options shuffled per row with a seeded
  generator: GPQA (main, diamond);
- ``mmlu_pro``: ``question``, ``options`` (a list), ``answer`` (a letter) or ``answer_index``: MMLU-Pro;
- ``arc``: ``question``, ``choices`` (``{"text": [...], "label": [...]}``), ``answerKey``: ARC-Challenge / Easy.

Files: ``.jsonl``, ``.json`` (a list of rows, or ``{"data": [...]}``), ``.parquet``, ``.csv``.

Answers are written so that any Math-Verify reward reads them as written: plain numbers as they are, anything
else in LaTeX math, ``$...$`` (klgrad's reward wraps bare gold answers itself, but other tools reading these files
may not: Math-Verify reads undelimited LaTeX such as ``\sqrt{2}`` as nothing, and ``1, 2`` as ``2``).
Multiple-choice answers become a letter in math, ``$C$``, with the options listed in the prompt as
``A) ...``; the model must then state its letter in LaTeX (``\boxed{C}``): a plain ``C`` or ``(C)`` is not read.
``--instruction`` is appended to every prompt (default: a \boxed{} instruction for the format, '' for none).
"""

from __future__ import annotations

import csv
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from klgrad.rewards.accuracy import gold_as_math

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = "Answer with the letter of the correct option within \\boxed{}, e.g. \\boxed{A}."
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")


class ConvertError(ValueError):
    """A source row or file that cannot be converted; the message names the file, row and column."""


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file, as dicts."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConvertError(f"{path}: line {line_no}: invalid JSON ({e.msg})") from e
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        yield from data["data"] if isinstance(data, dict) and "data" in data else data
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            yield from csv.DictReader(f)
    else:
        raise ConvertError(f"{path}: unsupported file type {path.suffix!r} (.jsonl, .json, .parquet, .csv)")


def gold(answer: Any) -> str:
    """An answer as klgrad's Math-Verify reward reads it as written: integral floats lose ``.0``; plain numbers
    stay; anything else as :func:`klgrad.rewards.accuracy.gold_as_math` writes it (``$...$`` unless it already
    holds a ``$`` delimiter or ``\\boxed``)."""
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = str(answer).strip()
    if not text:
        raise ValueError("empty answer")
    return text if _NUMBER.fullmatch(text) else gold_as_math(text)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _first(row: dict, names: tuple[str, ...]) -> str:
    """The first of ``names`` that ``row`` has (KeyError naming them all when none)."""
    for name in names:
        if name in row and row[name] is not None:
            return name
    raise KeyError(" / ".join(names))


_PROBLEM = ("problem", "Problem", "question", "Question", "prompt")


def options_prompt(question: str, options: list[str]) -> str:
    """The question, a blank line, then ``A) option`` lines."""
    return question.strip() + "\n\n" + "\n".join(f"{LETTERS[i]}) {str(o).strip()}" for i, o in enumerate(options))


def _problem_answer(row: dict, index: int, seed: int) -> tuple[str, str]:
    return str(row[_first(row, _PROBLEM)]), gold(row[_first(row, ("answer", "Answer"))])


def _boxed_solution(row: dict, index: int, seed: int) -> tuple[str, str]:
    solution = str(row[_first(row, ("solution", "Solution"))])
    boxed = last_boxed(solution)
    if boxed is None:
        raise ValueError("column 'solution' has no \\boxed{...}")
    return str(row[_first(row, _PROBLEM)]), gold(boxed)


def _olympiadbench(row: dict, index: int, seed: int) -> tuple[str, str]:
    answers = row["final_answer"]
    answers = answers if isinstance(answers, list) else [answers]
    parts = [str(a).strip().strip("$").strip() for a in answers]
    return str(row[_first(row, _PROBLEM)]), gold(", ".join(parts))


def _gsm8k(row: dict, index: int, seed: int) -> tuple[str, str]:
    answer = str(row["answer"])
    if "####" not in answer:
        raise ValueError("column 'answer' has no '#### <number>'")
    return str(row["question"]), gold(answer.rsplit("####", 1)[1].strip().replace(",", ""))


def _gpqa(row: dict, index: int, seed: int) -> tuple[str, str]:
    options = [row["Correct Answer"], *(row[f"Incorrect Answer {i}"] for i in (1, 2, 3))]
    order = list(range(4))
    random.Random(f"{seed}:{index}").shuffle(order)  # the same shuffle for the same seed and row
    return options_prompt(row["Question"], [options[i] for i in order]), gold(LETTERS[order.index(0)])


def _mmlu_pro(row: dict, index: int, seed: int) -> tuple[str, str]:
    options = list(row["options"])
    letter = str(row.get("answer") or "").strip()
    if letter not in LETTERS[: len(options)]:
        letter = LETTERS[int(row["answer_index"])]
    return options_prompt(row["question"], options), gold(letter)


def _arc(row: dict, index: int, seed: int) -> tuple[str, str]:
    choices = row["choices"]
    labels = [str(x) for x in choices["label"]]
    key = str(row["answerKey"])
    if key not in labels:
        raise ValueError(f"answerKey {key!r} is not one of the choice labels {labels}")
    return options_prompt(row["question"], list(choices["text"])), gold(LETTERS[labels.index(key)])


FORMATS: dict[str, Callable[[dict, int, int], tuple[str, str]]] = {
    "problem_answer": _problem_answer,
    "boxed_solution": _boxed_solution,
    "olympiadbench": _olympiadbench,
    "gsm8k": _gsm8k,
    "gpqa": _gpqa,
    "mmlu_pro": _mmlu_pro,
    "arc": _arc,
}
CHOICE_FORMATS = ("gpqa", "mmlu_pro", "arc")


def detect_format(row: dict) -> str:
    """The source layout of a row, from its columns (table in the module docstring)."""
    keys = set(row)
    if "final_answer" in keys:
        return "olympiadbench"
    if {"Correct Answer", "Incorrect Answer 1"} <= keys:
        return "gpqa"
    if "options" in keys and keys & {"answer", "answer_index"}:
        return "mmlu_pro"
    if {"choices", "answerKey"} <= keys:
        return "arc"
    if "question" in keys and "####" in str(row.get("answer", "")):
        return "gsm8k"
    if keys & set(_PROBLEM) and keys & {"answer", "Answer"}:
        return "problem_answer"
    if keys & set(_PROBLEM) and keys & {"solution", "Solution"}:
        return "boxed_solution"
    raise ConvertError(f"unknown layout: columns {sorted(keys)}; pass --format (one of {sorted(FORMATS)})")


def convert_file(
    path: Path, fmt: str = "auto", *, instruction: str | None = None, seed: int = 0
) -> tuple[str, list[dict]]:
    """(format used, klgrad rows ``{"id", "prompt", "answer"}``) of one source file.

    ``instruction``: appended to each prompt after a blank line; None = the format's default (a \\boxed{}
    instruction), "" = none. Raises :class:`ConvertError` naming the file, the 1-based row and the problem.
    """
    out: list[dict] = []
    for index, row in enumerate(read_rows(path), start=1):
        if fmt == "auto":
            try:
                fmt = detect_format(row)
            except ConvertError as e:
                raise ConvertError(f"{path}: row {index}: {e}") from e
        if fmt not in FORMATS:
            raise ConvertError(f"unknown --format {fmt!r}; one of {sorted(FORMATS)}")
        try:
            prompt, answer = FORMATS[fmt](row, index, seed)
        except KeyError as e:
            raise ConvertError(f"{path}: row {index}: missing column {e.args[0]} (format {fmt})") from e
        except (ValueError, TypeError) as e:
            raise ConvertError(f"{path}: row {index}: {e} (format {fmt})") from e
        extra = instruction
        if extra is None:
            extra = CHOICE_INSTRUCTION if fmt in CHOICE_FORMATS else MATH_INSTRUCTION
        row_id = row.get("id", row.get("unique_id", row.get("ID", f"{path.stem}-{index}")))
        out.append({"id": str(row_id), "prompt": prompt.strip() + (f"\n\n{extra}" if extra else ""), "answer": answer})
    if not out:
        raise ConvertError(f"{path}: no rows")
    return fmt, out


def convert_sources(
    sources: list[Path], out: Path, *, name: str | None = None, fmt: str = "auto", instruction: str | None = None,
    seed: int = 0,
) -> int:
    """Convert each file of ``sources`` into ``out/NAME.jsonl`` (``klgrad convert-benchmarks``); 0, or 2 with the
    reason on stderr for a file that cannot be converted (files converted before it stay written)."""
    if name and len(sources) > 1:
        print("convert-benchmarks: --name needs exactly one source", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for src in sources:
        try:
            if not src.is_file():
                raise ConvertError(f"{src}: no such file")
            used, rows = convert_file(src, fmt, instruction=instruction, seed=seed)
        except ConvertError as e:
            print(f"convert-benchmarks: {e}", file=sys.stderr)
            return 2
        dest = out / f"{name or src.stem}.jsonl"
        dest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"{src} ({used}, {len(rows)} rows) -> {dest}")
    return 0
