"""What ``klgrad eval`` writes and prints.

``OUT/eval.json``, one model::

    {"model": {"label", "source", "checkpoint", "max_new_tokens", "chat_template", "seconds"},
     "settings": {...},
     "benchmarks": {NAME: {"n", "k", "greedy_accuracy", "pass@1", "pass@k", "mean_length"}}}

several models (``--model`` given more than once)::

    {"settings": {...},
     "models": {LABEL: {"source", "checkpoint", "max_new_tokens", "chat_template", "seconds",
                        "benchmarks": {NAME: {...}}}}}

``settings`` holds the flags, the data files and ``warnings`` (benchmarks whose answers Math-Verify misreads:
:func:`klgrad.eval.benchmarks.answer_warnings`).
``OUT/results.md`` (several models): the paper's layout, one row per model, one column per benchmark and an
unweighted average over benchmarks; cells greedy accuracy / pass@1 in percent, then a pass@K table.
``OUT/completions/LABEL/NAME.jsonl``: every problem's responses and verdicts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from klgrad.eval.run import EvalSettings, ModelResult


def model_entry(r: ModelResult) -> dict:
    """A model's part of ``eval.json`` without its benchmarks."""
    return {
        "source": str(r.source),
        "checkpoint": str(r.checkpoint) if r.checkpoint else None,
        "max_new_tokens": r.max_new_tokens,
        "chat_template": r.chat_template,
        "seconds": {name: round(s, 3) for name, s in r.seconds.items()},
    }


def eval_json(
    results: Sequence[ModelResult], settings: EvalSettings, data: Sequence[str], warnings: Sequence[str] = ()
) -> dict:
    """The ``eval.json`` object (layouts: module docstring)."""
    meta = {**asdict(settings), "data": [str(d) for d in data], "warnings": list(warnings)}
    if len(results) == 1:
        r = results[0]
        return {"model": {"label": r.label, **model_entry(r)}, "settings": meta, "benchmarks": r.benchmarks}
    return {"settings": meta, "models": {r.label: {**model_entry(r), "benchmarks": r.benchmarks} for r in results}}


def _cell(values: Sequence[float]) -> str:
    """Fractions as percent with one decimal, joined by `` / ``."""
    return " / ".join(f"{100 * v:.1f}" for v in values)


def _table(results: Sequence[ModelResult], keys: Sequence[str]) -> str:
    """Markdown: a row per model, a column per benchmark (cells: ``keys`` in percent) and the Average column."""
    names = list(results[0].benchmarks)
    lines = ["| model | " + " | ".join(names) + " | Average |", "|---|" + "---|" * (len(names) + 1)]
    for r in results:
        cells = [_cell([r.benchmarks[n][key] for key in keys]) for n in names]
        average = _cell([sum(r.benchmarks[n][key] for n in names) / len(names) for key in keys])
        lines.append(f"| {r.label} | " + " | ".join(cells) + f" | {average} |")
    return "\n".join(lines) + "\n"


def results_markdown(results: Sequence[ModelResult], settings: EvalSettings) -> str:
    """Models × benchmarks tables: greedy accuracy / pass@1, then pass@K (percent), each with an Average column
    (the unweighted mean over benchmarks)."""
    first = results[0].benchmarks
    sizes = ", ".join(f"{name} {b['n']}" for name, b in first.items())
    k = settings.samples
    return (
        f"# klgrad eval: {len(results)} models on {len(first)} benchmark{'s' if len(first) > 1 else ''}\n\n"
        f"Problems per benchmark: {sizes}. {k} samples per problem at temperature {settings.temperature}"
        f" (top-p {settings.top_p}), seed {settings.seed}, engine {settings.engine}. Correct = Math-Verify equality"
        " with the answer (klgrad's accuracy reward). Average = unweighted mean over benchmarks.\n\n"
        "## Greedy accuracy / pass@1 (%)\n\n"
        + _table(results, ("greedy_accuracy", "pass@1"))
        + f"\n## pass@{k} (%)\n\n"
        + _table(results, ("pass@k",))
    )


def _file_name(label: str) -> str:
    return re.sub(r"[^\w.@+#-]", "_", label)


def write_outputs(
    results: Sequence[ModelResult],
    settings: EvalSettings,
    data: Sequence[str],
    out: Path,
    warnings: Sequence[str] = (),
) -> list[Path]:
    """``eval.json``, ``results.md`` (several models) and the completions; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "eval.json"]
    paths[0].write_text(json.dumps(eval_json(results, settings, data, warnings), indent=1) + "\n", encoding="utf-8")
    if len(results) > 1:
        paths.append(out / "results.md")
        paths[1].write_text(results_markdown(results, settings), encoding="utf-8")
    for r in results:
        folder = out / "completions" / _file_name(r.label)
        folder.mkdir(parents=True, exist_ok=True)
        for name, problems in r.problems.items():
            rows = (
                {
                    "id": p.example.id,
                    "prompt": p.example.prompt,
                    "answer": p.example.answer,
                    "greedy": p.greedy,
                    "greedy_correct": p.greedy_correct,
                    "samples": p.samples,
                    "correct": p.correct,
                    "lengths": p.lengths,
                }
                for p in problems
            )
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return paths


def print_table(results: Sequence[ModelResult], settings: EvalSettings, console) -> None:
    """One row per (model, benchmark) on a rich console."""
    from rich.table import Table

    k = settings.samples
    table = Table(title=f"klgrad eval: {k} samples at T = {settings.temperature}, greedy once")
    for col in ("model", "benchmark", "n", "greedy acc.", "pass@1", f"pass@{k}", "mean length", "seconds"):
        table.add_column(col, justify="left" if col in ("model", "benchmark") else "right")
    for r in results:
        for name, b in r.benchmarks.items():
            table.add_row(
                r.label,
                name,
                str(b["n"]),
                f"{b['greedy_accuracy']:.3f}",
                f"{b['pass@1']:.3f}",
                f"{b['pass@k']:.3f}",
                f"{b['mean_length']:.1f}",
                f"{r.seconds[name]:.1f}",
            )
    console.print(table)
