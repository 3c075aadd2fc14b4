"""``train.threads: auto`` (klgrad.threads): the share rule in closed form and as properties, and the load and
the klgrad processes it reads, measured with real processes (a busy loop, a registered peer), no mocks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from klgrad.config import ConfigError, load_config
from klgrad.threads import (
    CpuShare,
    choose_threads,
    cpu_threads,
    machine_busy_seconds,
    process_seconds,
    registry_dir,
    thread_setting,
    usable_cores,
)
from klgrad.trainer import read_jsonl, train
from tests.helpers.tiny_runs import small

LINUX = Path("/proc/stat").exists()


@pytest.mark.parametrize(
    ("cores", "other", "procs", "want"),
    [
        (2, 0.0, 1, 2),  # alone: every core
        (2, 0.49, 1, 2),  # a light neighbour does not take a core
        (2, 0.5, 1, 1),  # half a core busy rounds up to one
        (2, 1.0, 1, 1),  # the case: one busy process on two cores
        (2, 3.0, 1, 1),  # never below one thread
        (2, 0.0, 2, 1),  # two klgrad processes split two cores
        (16, 1.0, 1, 15),
        (16, 1.0, 4, 3),  # 15 free cores among 4 klgrad processes
        (16, 0.0, 3, 5),
    ],
)
def test_choose_threads_closed_form(cores, other, procs, want):
    assert choose_threads(cores, other, procs) == want


@given(
    cores=st.integers(1, 512),
    other=st.floats(0, 1e6, allow_nan=False),
    procs=st.integers(1, 1024),
)
def test_choose_threads_properties(cores, other, procs):
    n = choose_threads(cores, other, procs)
    assert 1 <= n <= cores
    assert n * procs <= max(procs, cores)  # the klgrad processes together never ask for more than the cores
    assert choose_threads(cores, other + 1, procs) <= n  # more load never gives more threads
    assert choose_threads(cores, other, procs + 1) <= n
    if other < 0.5 and procs == 1:
        assert n == cores  # alone on an idle machine: as before, one thread per core


def test_usable_cores_within_the_affinity_mask():
    n = usable_cores()
    assert 1 <= n <= (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_own_cpu_time_is_not_counted_as_other_load():
    """A busy loop in this process counts as ours: the load read as other processes' does not rise with it.

    The same reading taken over an idle stretch first is the machine's background (near 0 on an idle test machine,
    whatever other work runs on a shared one); counting our own loop as other load would add about a core."""

    def other_load(busy: bool) -> float:
        with CpuShare() as cpu:
            cpu.threads()
            t0 = time.monotonic()
            x = 0
            while time.monotonic() - t0 < 0.6:
                if busy:
                    x += 1
                else:
                    time.sleep(0.01)
            cpu.threads()
        return cpu.other_busy

    background = other_load(busy=False)
    assert other_load(busy=True) < background + 0.5


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_busy_process_takes_a_core():
    """One ``while True: pass`` process beside us: measured as ≥ 0.5 busy core, so one thread fewer than the cores."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with CpuShare() as cpu:
            cpu.threads()
            time.sleep(1.0)
            n = cpu.threads()
    finally:
        busy.kill()
        busy.wait()
    assert cpu.other_busy >= 0.5  # a busy loop gets at least half a core of the (≥ 1) cores over a second
    assert n == choose_threads(cpu.cores, cpu.other_busy, 1)
    assert n <= max(1, cpu.cores - 1)


PEER = """
import sys, time
from pathlib import Path
from klgrad.threads import CpuShare
with CpuShare(directory=Path(sys.argv[1])):
    print("registered", flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_klgrad_processes_split_the_cores_and_forget_the_dead(tmp_path):
    """A second registered klgrad process halves this one's share; its CPU is not "other" load; once it is
    killed (no clean exit) its entry is dropped and the share is whole again."""
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "registered"
        with CpuShare(directory=tmp_path, cores=4) as cpu:
            assert cpu.klgrad_pids() == sorted([os.getpid(), peer.pid])
            assert cpu.threads() == 2  # 4 cores, 2 klgrad processes
            peer.kill()
            peer.wait()
            assert cpu.klgrad_pids() == [os.getpid()]
            n = cpu.threads()
            assert n == choose_threads(4, cpu.other_busy, 1)  # one klgrad process again
            assert not (tmp_path / str(peer.pid)).exists()  # the dead peer's entry is removed
        assert not (tmp_path / str(os.getpid())).exists()  # ours is removed on exit
    finally:
        peer.kill()
        peer.wait()


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_proc_readers_agree_with_the_os():
    cpu_s, start = process_seconds(os.getpid())
    assert abs(cpu_s - (os.times().user + os.times().system)) <= 0.05  # two clocks of 1/CLK_TCK = 10 ms ticks
    assert start.isdigit()
    assert machine_busy_seconds() >= cpu_s - 0.05  # the machine's busy time includes ours
    assert process_seconds(2**22 + 1) is None  # above pid_max's default: no such process


def test_config_threads_accepts_auto_int_null_and_names_the_field():
    for value in ("auto", 3, None):
        assert load_config(None, {"train.threads": value}).train.threads == value
    assert load_config("configs/tiny_add.yaml").train.threads == "auto"  # the shipped default
    with pytest.raises(ConfigError, match=r"train\.threads must be an integer or 'auto' or null, got 'two'$"):
        load_config(None, {"train.threads": "two"})
    with pytest.raises(ConfigError, match=r"train\.threads must be greater than or equal to 1, got 0"):
        load_config(None, {"train.threads": 0})


def test_auto_threads_are_recorded_and_given_back(tmp_path):
    """A run with ``threads: auto`` records each step's thread count (the share, between 1 and the cores) and
    leaves torch's thread count as it found it; a fixed count is used as given."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(small(tmp_path, **{"train.threads": "auto", "train.steps": 2}), progress=False)
        assert torch.get_num_threads() == 1
        rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "cpu/threads" in r]
        assert len(rows) == 2
        assert all(1 <= r["cpu/threads"] <= usable_cores() for r in rows)
        train(small(tmp_path / "fixed", **{"train.threads": 1, "train.steps": 1}), progress=False)
        assert [
            r["cpu/threads"] for r in read_jsonl(tmp_path / "fixed" / "run" / "metrics.jsonl") if "cpu/threads" in r
        ] == [1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_work_outside_training_takes_its_share_beside_a_training_process(tmp_path, monkeypatch):
    """``cpu_threads("auto")`` (an evaluation, a grid's final metrics, forgetting) registers this process as a
    klgrad process for its duration, so it and a registered peer (a training run) split the cores; a fixed N is
    used as given; torch's count is given back either way, and None leaves it alone."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a registry of this test's own
    registry = registry_dir()
    registry.mkdir(parents=True)
    before = torch.get_num_threads()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(registry)], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "registered"
        with cpu_threads("auto") as cpu:
            assert cpu.klgrad_pids() == sorted([os.getpid(), peer.pid])
            assert (registry / str(os.getpid())).is_file()
            assert torch.get_num_threads() == choose_threads(usable_cores(), 0.0, 2)  # no load known yet: the split
        assert not (registry / str(os.getpid())).exists()
        assert torch.get_num_threads() == before
        with cpu_threads(1) as none:
            assert none is None
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == before
        with cpu_threads(None):
            assert torch.get_num_threads() == before
            assert not (registry / str(os.getpid())).exists()
    finally:
        peer.kill()
        peer.wait()
        torch.set_num_threads(before)


def test_thread_setting_reads_auto_or_a_whole_number():
    import argparse

    assert thread_setting("auto") == "auto"
    assert thread_setting("3") == 3
    for bad in ("0", "-1", "two", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected auto or a whole number >= 1"):
            thread_setting(bad)
