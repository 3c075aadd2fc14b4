"""``klgrad compare merge DIR [DIR ...] --out OUT``: seeds of one grid run on several machines, into one grid.

Each input is a grid folder (``grid.json`` and ``runs/``), typically the same design run with disjoint
``--only-seeds`` on different machines. Merging requires one revision (the same name or the same package
content, :func:`klgrad.compare.provenance.same_code`) and one design (every field of
:data:`klgrad.compare.design.FIXED_FIELDS`, and the same ``steps``), copies each finished run (its final.json
present) into ``OUT/runs`` without its checkpoints, and writes OUT's grid.json (the design, the union of methods
and seeds, every input's sessions and a ``merged_from`` list naming each input and the machines its runs were
trained on) and the summary of all runs. A run present in two inputs must have the same final.json in both; an
unfinished run is left out and listed. Nothing is trained.

``seeds`` (``merge ... --only-seeds LIST``) merges only those seeds, each whole: a listed seed is refused while
any of its runs in an input is unfinished, and, in a grid with a primary hypothesis, unless both of the primary's
methods have finished it (a paired seed is merged with both halves or not at all). Long grids merge finished seeds
from folders where the next seed is still training. A run merged earlier gets the files it has gained since (a
measurement written beside its final.json after the first merge), never a changed final.json.

A grid with a primary hypothesis keeps its seed count: inputs with more seeds than the others merge only when one
of the records holds an amendment allowing them (:func:`klgrad.compare.design.amend_seeds`); every record's
amendments are kept.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from klgrad.compare.design import (
    FIXED_FIELDS,
    GRID_FILE,
    GridMismatchError,
    allowed_seeds,
    now,
    read_grid,
    run_name,
    write_json,
)
from klgrad.compare.provenance import same_code
from klgrad.compare.records import GridRecord, Summary
from klgrad.compare.runs import run_seed
from klgrad.runlock import run_lock

LEFT_BEHIND = ("checkpoints", "tb", ".klgrad.lock", ".*.tmp")
"""What a merge leaves behind of a run (names or patterns): its weights, TensorBoard events and lock."""
COPY_IGNORE = shutil.ignore_patterns(*LEFT_BEHIND)


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
                f"the amendment first (klgrad compare amend --out OUT --seeds {r['seeds']} --reason TEXT)"
            )


def merged_amendments(records: list[tuple[Path, dict]]) -> list[dict]:
    """Every record's seed-count amendments, each once, in the order they were declared."""
    return sorted(once([a for _, r in records for a in r.get("amendments") or []]), key=lambda a: a["at"])


def same_file(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def add_new_files(run: Path, dest: Path, created: list[Path]) -> list[str]:
    """Copy into ``dest`` the files of ``run`` that ``dest`` lacks, except what :data:`LEFT_BEHIND` names;
    returns their paths relative to ``run``. Nothing present in ``dest`` is overwritten. Each folder and file it
    creates is appended to ``created`` before it is created, so a copy that fails part-way leaves in ``created``
    all there is to undo (:func:`remove_created`)."""
    added = []
    for root, dirs, files in os.walk(run):
        dirs[:] = [x for x in dirs if not left_behind(x)]  # never walk into a run's weights
        for name in sorted(files):
            rel = Path(root, name).relative_to(run)
            if left_behind(name) or (dest / rel).exists():
                continue
            for folder in reversed(rel.parents[:-1]):  # a/b/c.txt: a, then a/b
                if not (dest / folder).exists():
                    created.append(dest / folder)
                    (dest / folder).mkdir()
            created.append(dest / rel)
            shutil.copy2(run / rel, dest / rel)
            added.append(str(rel))
    return added


def remove_created(created: list[Path]) -> None:
    """Remove the files and folders listed in ``created``, newest first (a folder's files before it)."""
    for path in reversed(created):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def left_behind(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in LEFT_BEHIND)


def once(items: list[dict]) -> list[dict]:
    """``items`` without repeats, first occurrences in order: a grid merged again from a folder that already holds
    some of its sessions (its own earlier inputs) records each session once."""
    out: list[dict] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def check_whole_seeds(records: list[tuple[Path, dict]], seeds: list[int]) -> None:
    """Raise :class:`GridMismatchError` unless every seed in ``seeds`` can merge whole (module docstring)."""
    first = records[0][1]
    runs = [run for d, _ in records for run in (sorted((d / "runs").glob("*")) if (d / "runs").is_dir() else [])]
    primary = first.get("primary")
    for s in seeds:
        mine = [run for run in runs if run_seed(run.name) == s]
        open_ = [str(run) for run in mine if not (run / "final.json").is_file()]
        if open_:
            raise GridMismatchError(f"seed {s} is not finished: {', '.join(open_)} has no final.json")
        done = {run.name for run in mine}
        need = [run_name(m, b, s) for m in (primary["a"], primary["b"]) for b in first["betas"]] if primary else []
        missing = [n for n in need if n not in done]
        if missing or not mine:
            raise GridMismatchError(
                f"seed {s} cannot merge whole: {', '.join(missing) or 'no run'} not found in "
                f"{', '.join(str(d) for d, _ in records)}"
            )


@dataclass(frozen=True)
class Merged:
    """A merge's summary of every run now in the grid, and the unfinished runs it left out."""

    summary: Summary
    skipped: tuple[str, ...]


def merge_grids(inputs: list[Path], out_dir: Path, seeds: list[int] | None = None) -> Merged:
    """Merge the grid folders ``inputs`` into ``out_dir`` (module docstring).

    ``out_dir`` may already hold a grid of the same revision and design (it then counts as one more input), or be
    one of the inputs. ``seeds``: merge only these seeds' runs, each seed whole (refused otherwise). A merge that
    fails part-way (a summary that cannot be computed, say) leaves ``out_dir`` as it found it: the runs and files it
    copied are removed and grid.json, summary.json and summary.md put back."""
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
    if seeds is not None:
        check_whole_seeds(records, seeds)
    with run_lock(out_dir):
        kept = {name: (out_dir / name).read_bytes() for name in ROLLED_BACK if (out_dir / name).is_file()}
        new_paths: list[Path] = []  # what this merge adds to out_dir: removed again if it fails
        try:
            return merge_into(records, out_dir, seeds, existing, new_paths)
        except BaseException:
            remove_created(new_paths)
            for name in ROLLED_BACK:
                if name in kept:
                    (out_dir / name).write_bytes(kept[name])
                else:
                    (out_dir / name).unlink(missing_ok=True)
            raise


ROLLED_BACK = (GRID_FILE, "summary.json", "summary.md")
"""The files of a grid folder a failed merge puts back as they were (the figures are redrawn by the next one)."""


def merge_into(
    records: list[tuple[Path, dict]], out_dir: Path, seeds: list[int] | None, existing: dict | None, new_paths: list
) -> Merged:
    """The body of :func:`merge_grids` under its lock: copy the runs, write grid.json and the summary; every path
    it creates is appended to ``new_paths`` as it is created."""
    from klgrad.compare.report import write_summary

    skipped: list[str] = []
    copied: dict[str, list[str]] = {}
    for d, _ in records:
        for run in sorted((d / "runs").glob("*")) if (d / "runs").is_dir() else []:
            if seeds is not None and run_seed(run.name) not in seeds:
                continue
            dest = out_dir / "runs" / run.name
            if not (run / "final.json").is_file():
                skipped.append(str(run))
                continue
            if dest.resolve() == run.resolve():
                continue
            if dest.exists():
                if not same_file(run / "final.json", dest / "final.json"):
                    raise GridMismatchError(f"run {run.name} is in {d} and in {out_dir} with different final.json")
                added = add_new_files(run, dest, new_paths)
                if added:
                    copied.setdefault(str(d), []).append(f"{run.name} (new files)")
                continue
            if not dest.parent.exists():
                new_paths.append(dest.parent)  # out_dir/runs, first made by this merge
                dest.parent.mkdir(parents=True)
            new_paths.append(dest)
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
    return Merged(write_summary(out_dir, GridRecord.from_json(record)), tuple(skipped))
