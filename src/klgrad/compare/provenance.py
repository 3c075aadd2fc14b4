"""Where a grid's numbers come from: the code revision that ran, the machine it ran on, and pinned worktrees.

A grid that runs for hours or across sessions must not mix code versions. :func:`source_revision` names the
klgrad code actually imported (the git checkout holding the package's source folder, not the current folder):
``<40-hex commit>`` for a clean tree, ``<commit>-dirty-<12 hex>`` for a tree with changes, the hex a sha256 of
the changes themselves (``git diff HEAD`` and the untracked files under the package), so two different sets of
edits on one commit never read as the same revision. Outside git: ``klgrad-<version>`` (an installed wheel, or a
copy of the tree without ``.git``). Beside the name, ``content`` hashes the package's files themselves; two
records run the same code when their names or their contents agree (:func:`same_code`).

:func:`pin_worktree` makes (or reuses) a detached git worktree of one commit under a cache folder, and
:func:`pinned_command` the command that re-executes ``python -m klgrad compare`` from it, so code work in the
checkout beside it cannot change a running grid.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from klgrad.runlock import waiting_lock

PIN_ENV = "KLGRAD_PINNED_REVISION"
"""Set in the environment of a pinned re-execution: the commit the grid is pinned to (the child checks that the
code it imports is that commit, clean)."""
PIN_DIR_ENV = "KLGRAD_PIN_DIR"
"""Overrides the folder pinned worktrees are made under (default ``$XDG_CACHE_HOME/klgrad/pins``, else
``~/.cache/klgrad/pins``)."""


@dataclass(frozen=True)
class Revision:
    """The code revision of a grid: ``name`` is what grids compare (``commit`` plus ``-dirty-<hash>`` if dirty)."""

    name: str
    commit: str | None
    dirty: bool
    source: str
    """The package's source folder that was inspected."""
    content: str | None = None
    """sha256 of the package's files (:func:`content_hash`): the same code has the same content whether or not
    its copy is a git checkout (a machine given a copy of the tree without ``.git``)."""

    def as_dict(self) -> dict:
        return {
            "revision": self.name,
            "commit": self.commit,
            "dirty": self.dirty,
            "source": self.source,
            "content": self.content,
        }


def same_code(a: dict, b: dict) -> bool:
    """Two recorded revisions (:meth:`Revision.as_dict`) run the same code: the same package content when both
    record it (so a git-less copy of a commit, or a tree whose changes lie outside the package, is the same code,
    and two different git-less copies are not), else the same name."""
    if a.get("content") and b.get("content"):
        return a["content"] == b["content"]
    return a["revision"] == b["revision"]


def content_hash(source: Path) -> str:
    """sha256 over the package folder's files, sorted by relative path: ``path NUL bytes NUL`` each; compiled
    files (``__pycache__``, ``*.pyc``) left out."""
    h = hashlib.sha256()
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for path in files:
        h.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _git(cwd: Path, *args: str) -> str:
    """stdout of ``git -C cwd args`` (stripped); raises ``subprocess.CalledProcessError`` / ``OSError``."""
    return subprocess.run(
        ["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()


def package_source() -> Path:
    """The folder of the klgrad package this process imported (``.../src/klgrad``): this module's grandparent."""
    return Path(__file__).resolve().parent.parent


def package_version() -> str:
    """The installed klgrad distribution's version, or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("klgrad")
    except PackageNotFoundError:
        return "unknown"


def revision_name(commit: str, changes: bytes) -> str:
    """``commit`` when ``changes`` is empty, else ``commit-dirty-<first 12 hex of sha256(changes)>``."""
    if not changes:
        return commit
    return f"{commit}-dirty-{hashlib.sha256(changes).hexdigest()[:12]}"


def source_revision(source: Path | None = None) -> Revision:
    """The revision of the code in ``source`` (default: :func:`package_source`).

    Dirty means ``git diff HEAD`` is not empty (tracked files anywhere in the work tree, as ``git describe
    --dirty``) or there are untracked, not ignored files under ``source`` (a new module could be imported); the
    hash covers the diff and those files' names and bytes."""
    source = (source or package_source()).resolve()
    content = content_hash(source)
    try:
        commit = _git(source, "rev-parse", "HEAD")
        diff = subprocess.run(
            ["git", "-C", str(source), "diff", "HEAD", "--binary"], capture_output=True, timeout=60, check=True
        ).stdout
        untracked = _git(source, "ls-files", "--others", "--exclude-standard", "--full-name", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return Revision(f"klgrad-{package_version()}", None, False, str(source), content)
    top = Path(_git(source, "rev-parse", "--show-toplevel"))
    changes = diff
    for name in sorted(n for n in untracked.splitlines() if n):
        changes += b"\0untracked\0" + name.encode() + b"\0" + (top / name).read_bytes()
    return Revision(revision_name(commit, changes), commit, bool(changes), str(source), content)


def parse_cpuinfo(text: str) -> dict:
    """The CPU kind from the text of ``/proc/cpuinfo``: ``model`` (the first ``model name``, else ``Hardware``
    or ``Processor`` line, else None), ``cores`` (``processor`` entries), ``avx2`` and ``avx512`` (an
    ``avx512*`` flag) from the first ``flags`` line."""
    model = None
    for key in ("model name", "Hardware", "Processor"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if m:
            model = m.group(1).strip()
            break
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    flags = set(m.group(1).split()) if m else set()
    return {
        "model": model,
        "cores": len(re.findall(r"^processor\s*:", text, re.MULTILINE)),
        "avx2": "avx2" in flags,
        "avx512": any(f.startswith("avx512") for f in flags),
    }


def machine_record() -> dict:
    """The machine this process runs on: host name, architecture, CPU kind (:func:`parse_cpuinfo`, on Linux),
    CPU count and the CUDA device's name when torch sees one."""
    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"model": platform.processor() or None, "cores": os.cpu_count(), "avx2": None, "avx512": None}
    gpu = None
    if "torch" in sys.modules:  # the grid imports torch anyway; a leaf caller need not
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    return {"host": platform.node(), "arch": platform.machine(), "cpu": cpu, "gpu": gpu}


def machine_label(machine: dict) -> str:
    """One line naming a machine record: ``host: CPU model (avx512|avx2), GPU``."""
    cpu = machine.get("cpu") or {}
    isa = "avx512" if cpu.get("avx512") else "avx2" if cpu.get("avx2") else "no avx2"
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    return f"{machine.get('host')}: {cpu.get('model')} ({isa}){gpu}"


# ----------------------------------------------------------------------------------------------------------
# pinned worktrees


def pin_root(environ: dict | None = None) -> Path:
    """The folder pinned worktrees go under: ``$KLGRAD_PIN_DIR``, else ``$XDG_CACHE_HOME/klgrad/pins``, else
    ``~/.cache/klgrad/pins``."""
    env = os.environ if environ is None else environ
    if env.get(PIN_DIR_ENV):
        return Path(env[PIN_DIR_ENV])
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "klgrad" / "pins"


def pin_worktree(rev: str, repo: Path, root: Path, allow_dirty: bool = False) -> tuple[str, Path]:
    """(commit, worktree): ``rev`` of the git repository holding ``repo`` resolved to its commit, and a detached
    worktree of it at ``root/<commit>`` (made with ``git worktree add --detach`` unless it exists, under a lock on
    ``root/.pin.lock`` that concurrent callers wait for). An existing
    one must be at that commit, and clean unless ``allow_dirty``: a pinned copy someone edited is refused
    (ValueError); allowed, the grid records its revision as ``<commit>-dirty-<hash>``."""
    try:
        commit = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"--pin {rev}: not a commit of the repository at {repo}") from e
    path = root / commit
    # Many processes of one grid pin at once (one per seed or method on a GPU machine): one makes the worktree,
    # the others wait and then find it whole, not half checked out (on 2026-11-27 two of 16 read it as dirty).
    with waiting_lock(root / ".pin.lock"):
        if not path.exists():
            try:
                _git(repo, "worktree", "prune")  # a pinned folder deleted by hand leaves a stale registration
                _git(repo, "worktree", "add", "--detach", str(path), commit)
            except subprocess.CalledProcessError as e:
                raise ValueError(f"--pin {rev}: git worktree add {path} failed: {e.stderr.strip()}") from e
        rev_there = source_revision(path / "src" / "klgrad")
    if rev_there.commit != commit or (rev_there.dirty and not allow_dirty):
        raise ValueError(
            f"the pinned worktree {path} is at {rev_there.name}, not the clean commit {commit}: remove it "
            f"(git worktree remove --force {path}) and run again, or pass --allow-dirty to run it as it is"
        )
    return commit, path


def strip_pin_args(argv: list[str]) -> list[str]:
    """``argv`` without ``--pin REV`` / ``--pin=REV`` (the pinned child must not pin again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--pin":
            skip = True
        elif not a.startswith("--pin="):
            out.append(a)
    return out


def pinned_command(worktree: Path, commit: str, argv: list[str], environ: dict) -> tuple[list[str], dict]:
    """(argv, environment) that run ``python -m klgrad compare ARGS`` from ``worktree``: the interpreter of this
    process, ``PYTHONPATH`` = ``worktree/src`` first, ``KLGRAD_PINNED_REVISION`` = ``commit``; ``argv`` are the
    compare command's arguments (after ``compare``) without ``--pin``."""
    env = dict(environ)
    src = str(worktree / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[PIN_ENV] = commit
    return [sys.executable, "-m", "klgrad", "compare", *strip_pin_args(argv)], env


def check_pinned(revision: Revision, allow_dirty: bool = False, environ: dict | None = None) -> bool:
    """True when this process is a pinned re-execution (``KLGRAD_PINNED_REVISION`` set); raises ValueError
    when the code it imported is not that commit, clean unless ``allow_dirty`` (e.g. ``PYTHONPATH`` lost to an
    editable install, or the pinned copy was edited)."""
    env = os.environ if environ is None else environ
    want = env.get(PIN_ENV)
    if not want:
        return False
    if revision.commit != want or (revision.dirty and not allow_dirty):
        raise ValueError(
            f"pinned to {want} but the klgrad imported from {revision.source} is {revision.name}: "
            "PYTHONPATH must put the pinned worktree's src first"
        )
    return True
