"""Benchmark files and the prompts a model sees.

A benchmark is a JSONL, parquet, JSON or CSV file, or a ``Dataset.save_to_disk`` folder, with a prompt column and
an answer column (read by :func:`klgrad.data.load_examples`, which names the file, row and column of a bad row).
Its name is the file's stem (a folder's name). The prompt is wrapped in the tokenizer's chat template as one user
message when the tokenizer has a template (and ``chat_template`` is on); otherwise the model sees BOS + the raw
prompt, as ``klgrad train`` feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from klgrad.data import Example, load_examples
from klgrad.rewards import accuracy_reward
from klgrad.rewards.accuracy import gold_as_math
from klgrad.rollout.encoding import encode_prompts, uses_chat


@dataclass(frozen=True)
class Benchmark:
    """One benchmark file's problems."""

    name: str
    path: Path
    examples: list[Example]


def benchmark_name(path: Path) -> str:
    """The file's stem (``math500.jsonl`` -> ``math500``), a folder's name."""
    return path.name if path.is_dir() else path.stem


def load_benchmarks(
    paths: list[str | Path], *, prompt_column: str = "prompt", answer_column: str = "answer", limit: int | None = None
) -> list[Benchmark]:
    """Each file's first ``limit`` problems (all when None), in the order given.

    Raises:
        FileNotFoundError: a file is missing.
        klgrad.data.DataError: a bad row (missing column, empty prompt, ...), naming the file, row and column.
        ValueError: two files with the same name (stem), or ``limit`` < 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    out: list[Benchmark] = []
    seen: dict[str, Path] = {}
    for p in map(Path, paths):
        name = benchmark_name(p)
        if name in seen:
            raise ValueError(f"--data {seen[name]} and {p} share the benchmark name {name!r} (the file stem)")
        seen[name] = p
        res = load_examples(p, prompt_column=prompt_column, answer_column=answer_column, max_rows=limit)
        out.append(Benchmark(name, p, res.examples))
    return out


def misread_answers(examples: list[Example]) -> list[Example]:
    """Problems whose answer Math-Verify does not read as written: a response stating exactly that answer in
    LaTeX math (:func:`~klgrad.rewards.accuracy.gold_as_math`) does not score 1 against it.

    The accuracy reward wraps a bare gold answer in ``$...$`` before parsing
    (:func:`klgrad.rewards.accuracy.gold_as_math`), so ``\\sqrt{2}`` and ``1, 2`` read as written; what remains
    are answers Math-Verify cannot parse to a value (``\\text{}``, unbalanced braces).
    Such rows are scored wrongly: no response can match them.
    """
    ok = accuracy_reward(
        [e.prompt for e in examples], [gold_as_math(e.answer) for e in examples], answer=[e.answer for e in examples]
    )
    return [e for e, v in zip(examples, ok, strict=True) if v != 1.0]


def answer_warnings(benchmarks: list[Benchmark]) -> list[str]:
    """One line per benchmark with :func:`misread_answers`, naming how many, the first one and the fix."""
    out = []
    for b in benchmarks:
        bad = misread_answers(b.examples)
        if bad:
            out.append(
                f"{b.name}: {len(bad)} of {len(b.examples)} answers are not read as written by Math-Verify "
                f"(e.g. {bad[0].id}: {bad[0].answer!r}), so those problems are scored wrongly; write LaTeX answers "
                "in $...$ (docs/eval.md)"
            )
    return out


def uses_chat_template(tokenizer, enabled: bool) -> bool:
    """True when prompts go through the tokenizer's chat template: it has one and it is not turned off
    (training's :func:`~klgrad.rollout.encoding.uses_chat` with ``auto``, or ``raw`` when off)."""
    return uses_chat("auto" if enabled else "raw", tokenizer)


def encode_eval_prompts(tokenizer, prompts: list[str], *, chat_template: bool) -> tuple[Tensor, Tensor]:
    """(P, L) left-padded ids and mask: :func:`klgrad.rollout.encoding.encode_prompts`, through the chat template
    when the tokenizer has one and it is not turned off (as training's ``data.prompt_format: auto``)."""
    return encode_prompts(tokenizer, prompts, chat=uses_chat_template(tokenizer, chat_template))
