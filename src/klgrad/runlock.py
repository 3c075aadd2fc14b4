"""One writer per run directory: an exclusive, non-blocking OS lock that a command holds while it writes.

``klgrad train`` (and ``--resume``), ``compare``, ``sft`` and ``reproduce`` take :func:`run_lock` on their output
directory before they read or write anything in it; a second process that asks for the same directory gets
:class:`RunLockedError` at once, naming the directory and the holder's pid, and touches nothing.

Why ``flock(LOCK_EX | LOCK_NB)`` on ``DIR/.klgrad.lock`` rather than a pid file or ``O_EXCL``: the lock belongs
to the open file, so the kernel releases it when the holder exits *for any reason*, SIGKILL and OOM kill
included. A killed run never leaves a stale lock behind, and nobody has to guess whether a recorded pid is still
alive (or reused). The lock file itself stays in the directory after the run; it is the lock on it, not its
existence, that marks a directory as in use. The holder's pid is written into it only so the refusal can name
the holder.

Limits (docs/reliability.md, "One writer per run directory"):

- The lock is advisory: it stops other klgrad processes (which all ask for it), not ``rm`` or an editor.
- It is per open file description, not per thread: a second :func:`run_lock` on the same directory conflicts
  even inside the same process (each ``open()`` makes a new description), so nesting is for different
  directories only. A child made with ``fork()`` shares the description and keeps the lock alive until it, too,
  exits; the descriptor is close-on-exec, so programs started with ``exec`` do not.
- Network file systems: on Linux NFS clients ``flock`` is emulated with POSIX byte-range locks and works across
  machines only when the server's lock manager is reachable; with ``-o nolock`` (and on some FUSE or SMB mounts)
  the lock is local to one machine, or the call fails with an ``OSError`` (ENOLCK, EOPNOTSUPP), which propagates.
  Two machines writing one run directory on such a mount are not protected.

:func:`waiting_lock` is the other kind: a short critical section that a second process should *wait* for, then
find done (building a shared cache folder, making a pinned worktree), not be refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".klgrad.lock"
"""The lock file's name inside the directory it guards."""


class RunLockedError(RuntimeError):
    """Another process holds the lock of ``directory``; ``pid`` is its pid as it recorded it (None: unreadable)."""

    def __init__(self, directory: str | os.PathLike[str], pid: int | None) -> None:
        super().__init__(str(directory), pid)  # the constructor's arguments: the exception pickles and unpickles
        self.directory = Path(directory)
        self.pid = pid

    def __str__(self) -> str:
        holder = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        return (
            f"{self.directory} is in use by another klgrad process ({holder}); "
            "wait for it to finish or choose another directory"
        )


def holder_pid(lock_file: str | os.PathLike[str]) -> int | None:
    """The pid recorded in ``lock_file`` (None when it is absent, empty or not a number)."""
    try:
        text = Path(lock_file).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def run_lock(directory: str | os.PathLike[str], *, lock_file: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Hold the exclusive lock of ``directory`` for the ``with`` block; yields the lock file's path.

    Creates ``directory`` (with its parents) when needed, then ``flock(LOCK_EX | LOCK_NB)`` on
    ``lock_file`` (default ``directory/.klgrad.lock``; pass one beside the directory when the directory itself
    gets replaced whole, as a saved model directory does). Raises :class:`RunLockedError` without waiting when
    another open file holds it. On exit (normal or exception) the recorded pid is cleared and the lock released.
    """
    directory = Path(directory)
    path = Path(lock_file) if lock_file is not None else directory / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    held = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # EWOULDBLOCK: held by another open file description
            raise RunLockedError(directory, holder_pid(path)) from None
        held = True
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # unbuffered: readers see it once write() returns
        yield path
    finally:
        if held:  # no pid left behind to mislead (a killed holder's stays, harmlessly: its lock is gone)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor of the open file releases the lock


@contextlib.contextmanager
def waiting_lock(lock_file: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` for the ``with`` block, waiting for it while another process
    holds it (creates the file and its folder). For work several processes may start at once and only one must
    do: the waiter then checks again and finds it done. Released on exit, and by the kernel if the holder dies."""
    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
