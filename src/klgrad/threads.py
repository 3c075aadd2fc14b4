"""CPU threads on a shared machine: how many torch threads a klgrad process uses (``train.threads: auto``).

The rule, re-applied before every training step::

    threads = max(1, (cores - round(other_busy)) // klgrad_processes)

- ``cores``: the CPUs this process may run on (its affinity mask), capped by a cgroup CPU quota.
- ``other_busy``: how many cores processes *other than klgrad* kept busy during the previous step, from the
  machine's CPU time (``/proc/stat``) less the CPU time of every running klgrad process (``/proc/<pid>/stat``).
- ``klgrad_processes``: the klgrad processes training on this machine now, this one included (compare's runs,
  ``accelerate launch`` ranks on CPU, two terminals): each registers its pid in a per-user directory under the
  temporary directory while it trains, so they split the free cores instead of fighting over them.

Why: torch's OpenMP threads meet at a barrier after every parallel operation, and by default (no
``OMP_WAIT_POLICY``) a thread that arrives first spins for the others. With one thread per core and one other
busy process, a descheduled thread stalls its team and the spinning ones burn the cores the others need:
``klgrad train`` on the embedded default ran 3.2× slower beside one ``while True: pass`` process on 2 cores,
while with one thread fewer than the cores it ran at the speed a fair share of the CPU allows (measured in
``bench/contention.py``; docs/performance.md). The wait policy is left at OpenMP's default because
``OMP_WAIT_POLICY=PASSIVE`` costs ~8% when the machine is idle; dropping the contended thread is what helps.

Outside Linux there is no ``/proc``: other processes' load counts as zero (the split among klgrad processes
still holds). A fixed ``train.threads: N`` turns all of this off (needed for bit-identical reruns: a sum's
rounding depends on how it is split across threads); ``train.threads: null`` leaves torch's own setting
(``OMP_NUM_THREADS``, else one thread per core).

The policy, in one place: :func:`training_threads` around a training run (the share re-decided before every step by
:func:`adapt_threads`), :func:`cpu_threads` around work outside training (an evaluation, a grid's final metrics, a
forgetting measurement). A leaf module: no klgrad import, and torch only inside the functions that set its count.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BUSY_CORE = 0.5
"""Another process's load rounds to whole cores: ≥ 0.5 of a core busy takes that core from klgrad."""


def thread_setting(text: str) -> int | str:
    """A ``--threads`` flag's value (an argparse ``type``): ``"auto"``, or a whole number >= 1 as an int;
    :class:`argparse.ArgumentTypeError` otherwise, which argparse reports against the flag."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number >= 1, got {text!r}")
    return int(text)


def choose_threads(cores: int, other_busy: float, klgrad_processes: int) -> int:
    """``max(1, (cores − round(other_busy)) // klgrad_processes)``: this process's share of the cores nobody
    else is using (``other_busy`` in cores, ``round`` half up)."""
    free = cores - math.floor(max(0.0, other_busy) + BUSY_CORE)
    return max(1, free // max(1, klgrad_processes))


def usable_cores() -> int:
    """The CPUs this process may run on (affinity mask where the OS has one), capped by a cgroup v2 or v1 CPU
    quota (``cpu.max`` / ``cpu.cfs_quota_us``), rounded up."""
    cpus = affinity()
    cores = len(cpus) if cpus else os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cgroup_quota() -> float | None:
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def _ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def affinity() -> set[int] | None:
    """The CPU numbers this process may run on, or None where the OS does not say."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return None


def machine_busy_seconds(cpus: set[int] | None = None) -> float | None:
    """CPU seconds spent on ``cpus`` (every CPU if None) by all processes: user, nice, system, irq and softirq
    from ``/proc/stat`` (idle, iowait and steal excluded), or None without ``/proc``. Counting only the CPUs
    this process may use keeps a container's neighbours on other CPUs out of it."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in values[:7])
        total += user + nice + system + irq + softirq
    return total / _ticks()


def process_seconds(pid: int) -> tuple[float, str] | None:
    """(CPU seconds of ``pid``, all its threads, user + system; its start time, which tells a reused pid apart)
    from ``/proc/<pid>/stat``, or None if it is gone or there is no ``/proc``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _ticks(), fields[19]


def registry_dir() -> Path:
    """Where training klgrad processes register: ``<tmp>/klgrad-cpu-<uid>`` (one per user)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"klgrad-cpu-{uid}"


def _alive(pid: int, start: str) -> bool:
    stat = process_seconds(pid)
    if stat is not None:
        return stat[1] == start or start == ""
    if Path("/proc").is_dir():
        return False
    try:  # no /proc: signal 0 tests the pid only
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


@dataclass
class CpuShare:
    """This process's share of the CPU, re-decided at every :meth:`threads` call from the load since the previous
    one. Use as a context manager around training: it registers the process on entry and unregisters on exit."""

    cores: int = field(default_factory=usable_cores)
    directory: Path = field(default_factory=registry_dir)
    cpus: set[int] | None = field(default_factory=affinity)
    _last: tuple[float, float, dict[int, float]] | None = None  # (wall, machine busy s, klgrad pid -> CPU s)
    _entry: Path | None = None
    other_busy: float = 0.0
    """Cores kept busy by other processes since the previous call (0 at the first)."""

    def __enter__(self) -> CpuShare:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            stat = process_seconds(os.getpid())
            self._entry = self.directory / str(os.getpid())
            self._entry.write_text(stat[1] if stat else "")
        except OSError:  # a read-only temporary directory: no peers are known, the rest still works
            self._entry = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._entry is not None:
            self._entry.unlink(missing_ok=True)

    def klgrad_pids(self) -> list[int]:
        """The registered klgrad processes still running (this one included); stale entries are removed."""
        pids = {os.getpid()}
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            entries = []
        for entry in entries:
            try:
                pid, start = int(entry.name), entry.read_text()
            except (ValueError, OSError):
                continue
            if _alive(pid, start):
                pids.add(pid)
            else:
                entry.unlink(missing_ok=True)
        return sorted(pids)

    def threads(self) -> int:
        """The thread count for the next stretch of work: :func:`choose_threads` of the load since the last call
        (none known at the first call: only the split among klgrad processes)."""
        pids = self.klgrad_pids()
        now = time.monotonic()
        busy = machine_busy_seconds(self.cpus)
        ours = {pid: s[0] for pid in pids if (s := process_seconds(pid)) is not None}
        other = 0.0
        if busy is not None and self._last is not None and now > self._last[0]:
            wall, busy0, ours0 = self._last
            ours_delta = sum(sec - ours0.get(pid, 0.0) for pid, sec in ours.items())  # a new pid: all its time
            other = max(0.0, (busy - busy0) - ours_delta) / (now - wall)
        self._last = (now, busy, ours) if busy is not None else None
        self.other_busy = other
        return choose_threads(self.cores, other, len(pids))


# ----------------------------------------------------------------------------------------------------------
# the policy: what a run and the work beside it do with torch's thread count


@contextlib.contextmanager
def shared_cpu() -> Iterator[CpuShare]:
    """Register this process as a klgrad process sharing the CPU (:class:`CpuShare`), take its first share (only
    the split among klgrad processes: no load is known yet), and give torch its previous thread count back at the
    end (a library call leaves the caller's setting as it found it)."""
    import torch

    before = torch.get_num_threads()
    try:
        with CpuShare() as cpu:
            # set even when unchanged: torch.set_num_threads also turns MKL's dynamic thread count off, which a
            # process that never calls it keeps on (measured ~7% slower steps alone, bench/contention.py)
            torch.set_num_threads(cpu.threads())
            yield cpu
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def training_threads(setting: int | str | None) -> Iterator[CpuShare | None]:
    """``train.threads`` around a training run: ``"auto"`` the share of :func:`shared_cpu`, re-decided before every
    step (:func:`adapt_threads`) and given back at the end; an int N sets N threads and leaves them set (a fixed
    count is the caller's choice: bit-identical reruns need it); None leaves torch's setting. Yields the share
    (auto) or None."""
    if setting == "auto":
        with shared_cpu() as cpu:
            yield cpu
        return
    if setting is not None:
        import torch

        torch.set_num_threads(int(setting))
    yield None


@contextlib.contextmanager
def cpu_threads(setting: int | str | None) -> Iterator[CpuShare | None]:
    """Work outside training (an evaluation, a grid's final metrics, a forgetting measurement) under the thread
    rule of ``train.threads``: ``"auto"`` registers this process as a klgrad process sharing the CPU and takes its
    share once, at entry (:func:`shared_cpu`: beside a training run on 2 cores, one thread each instead of both
    fighting over both cores); an int N runs with N threads; None leaves torch's setting. Torch's thread count is
    given back at the end."""
    if setting == "auto":
        with shared_cpu() as cpu:
            yield cpu
        return
    if setting is None:
        yield None
        return
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(int(setting))
        yield None
    finally:
        torch.set_num_threads(before)


def adapt_threads(cpu: CpuShare | None) -> int:
    """Before a training step: with a share (``train.threads: auto``) set torch's thread count to this process's
    share of the free cores (decided from the load since the previous call). Returns the thread count in force
    (the record's ``cpu/threads``)."""
    import torch

    if cpu is not None:
        n = cpu.threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
    return torch.get_num_threads()
