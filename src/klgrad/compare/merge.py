"""``klgrad compare --merge DIR [DIR ...] --out OUT``: seeds of one grid run on several machines, into one grid.

Each input is a grid folder (``grid.json`` and ``runs/``), typically the same design run with disjoint
``--only-seeds`` on different machines. Merging requires one revision (the same name or the same package
content, :func:`klgrad.compare.provenance.same_code`) and one design (every field of
:data:`klgrad.compare.design.FIXED_FIELDS`, and the same ``steps``), copies each finished run (its final.json
present) into ``OUT/runs`` without its checkpoints, and writes OUT's grid.json (the design, the union of methods
and seeds, every input's sessions and a ``merged_from`` list naming each input and the machines its runs were
trained on) and the summary of all runs. A run present in two inputs must have the same final.json in both; an
unfinished run is left out and listed. Nothing is trained.

A grid with a primary hypothesis keeps its seed count: inputs with more seeds than the others merge only when one
of the records holds an amendment allowing them (:func:`klgrad.compare.design.amend_seeds`); every record's
amendments are kept.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from klgrad.compare.design import (
    FIXED_FIELDS,
    GRID_FILE,
    GridMismatchError,
    allowed_seeds,
    now,
    read_grid,
    write_json,
)
from klgrad.compare.provenance import same_code
from klgrad.runlock import run_lock

COPY_IGNORE = shutil.ignore_patterns("checkpoints", "tb", ".klgrad.lock", ".*.tmp")
"""What a merge leaves behind of a run: its weights, TensorBoard events and lock."""


def check_mergeable(records: list[tuple[Path, dict]]) -> None:
    """Raise :class:`GridMismatchError` unless every record has the first one's revision, design and steps."""
    (first_dir, first), *rest = records
    for d, r in rest:
        a, b = first["revision"]["revision"], r["revision"]["revision"]
        if not same_code(first["revision"], r["revision"]):
            raise GridMismatchError(
                f"{first_dir} was run at revision {a}, {d} at revision {b}: seeds of one grid must share one revision"
            )
        for k in (*FIXED_FIELDS, "steps"):
            if first.get(k) != r.get(k):
                raise GridMismatchError(f"{d} records {k} = {r.get(k)!r}; {first_dir} records {first.get(k)!r}")
    if first.get("primary") is None:
        return
    allowed = allowed_seeds({"seeds": min(r["seeds"] for _, r in records), "amendments": merged_amendments(records)})
    for d, r in records:
        if r["seeds"] > allowed:
            raise GridMismatchError(
                f"{d} records {r['seeds']} seeds; the grid has a primary hypothesis and may have {allowed}: declare "
                f"the amendment first (klgrad compare --out OUT --amend-seeds {r['seeds']} --reason TEXT)"
            )


def merged_amendments(records: list[tuple[Path, dict]]) -> list[dict]:
    """Every record's seed-count amendments, each once, in the order they were declared."""
    return sorted(once([a for _, r in records for a in r.get("amendments") or []]), key=lambda a: a["at"])


def same_file(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def once(items: list[dict]) -> list[dict]:
    """``items`` without repeats, first occurrences in order: a grid merged again from a folder that already holds
    some of its sessions (its own earlier inputs) records each session once."""
    out: list[dict] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def merge_grids(inputs: list[Path], out_dir: Path) -> dict:
    """Merge the grid folders ``inputs`` into ``out_dir`` (module docstring); returns the summary.

    ``out_dir`` may already hold a grid of the same revision and design (it then counts as one more input), or be
    one of the inputs."""
    from klgrad.compare.grid import write_summary

    records = []
    for d in inputs:
        r = read_grid(d)
        if r is None:
            raise GridMismatchError(f"{d} holds no {GRID_FILE}: not a klgrad compare grid")
        records.append((d, r))
    existing = read_grid(out_dir)
    if existing is not None and out_dir.resolve() not in {d.resolve() for d in inputs}:
        records.append((out_dir, existing))
    check_mergeable(records)
    with run_lock(out_dir):
        skipped: list[str] = []
        copied: dict[str, list[str]] = {}
        for d, _ in records:
            for run in sorted((d / "runs").glob("*")) if (d / "runs").is_dir() else []:
                dest = out_dir / "runs" / run.name
                if not (run / "final.json").is_file():
                    skipped.append(str(run))
                    continue
                if dest.resolve() == run.resolve():
                    continue
                if dest.exists():
                    if not same_file(run / "final.json", dest / "final.json"):
                        raise GridMismatchError(f"run {run.name} is in {d} and in {out_dir} with different final.json")
                    continue
                shutil.copytree(run, dest, ignore=COPY_IGNORE)
                copied.setdefault(str(d), []).append(run.name)
        first = records[0][1]
        methods: list[str] = []
        for _, r in records:
            methods += [m for m in r["methods"] if m not in methods]
        record = {
            **{k: v for k, v in first.items() if k not in ("sessions", "merged_from", "amendments")},
            "methods": methods,
            "seeds": max(r["seeds"] for _, r in records),
            "created": min(r.get("created", now()) for _, r in records),
            "pinned": all(r.get("pinned") for _, r in records),
            **({"amendments": merged_amendments(records)} if merged_amendments(records) else {}),
            "sessions": once([s for _, r in records for s in r.get("sessions", [])]),
            "merged_from": [
                *(existing or {}).get("merged_from", []),
                {"at": now(), "inputs": [str(d) for d, _ in records], "copied": copied, "skipped": skipped},
            ],
        }
        write_json(out_dir / GRID_FILE, record)
        summary = write_summary(out_dir, record)
    return {**summary, "skipped": skipped}
