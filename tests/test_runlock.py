"""One writer per run directory (klgrad.runlock, docs/reliability.md): real processes and real flock, no mocks.

A second ``klgrad train`` on a directory that a running one holds exits 2 at once, naming the directory and the
holder's pid, and leaves every file of the run as it was; a SIGKILLed holder leaves no stale lock; compare, sft
and reproduce refuse a held ``--out`` the same way before doing any work.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klgrad.cli import main
from klgrad.runlock import LOCK_NAME, RunLockedError, holder_pid, run_lock
from klgrad.sft import sft_lock_file
from klgrad.trainer import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TRAIN = (
    "--config", "configs/tiny_add.yaml",
    "--rollout.prompts_per_step", "4",
    "--rollout.group_size", "4",
    "--data.n_eval", "8",
    "--data.n_train", "200",
    "--train.eval_every", "10",
    "--train.tensorboard", "false",
    "--algo.micro_batch_size", "8",
    "--train.threads", "1",
)  # fmt: skip
HOLD = """
import sys, time
from klgrad.runlock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""
"""A process that takes a directory's lock, says so, and sleeps holding it."""


def env() -> dict[str, str]:
    """The test's environment (its PYTHONPATH included) without fault-injection variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KLGRAD_")}


def klgrad(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "klgrad", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), the lock file included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def start_holder(directory: Path) -> subprocess.Popen:
    """A separate process holding ``directory``'s lock (returns once it holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------------------------------------
# the lock itself


def test_lock_writes_pid_refuses_a_second_open_even_in_one_process_and_releases(tmp_path):
    d = tmp_path / "new" / "run"
    with run_lock(d) as path:
        assert path == d / LOCK_NAME
        assert d.is_dir()
        assert holder_pid(path) == os.getpid()
        # flock belongs to the open file description: a second open() in the same process conflicts too
        with pytest.raises(RunLockedError) as e, run_lock(d):
            pass
        assert e.value.directory == d
        assert e.value.pid == os.getpid()
        assert str(d) in str(e.value)
        assert f"pid {os.getpid()}" in str(e.value)
        # the distributed exchange sends it between ranks: it survives pickling
        again = pickle.loads(pickle.dumps(e.value))
        assert (type(again), str(again), again.pid) == (RunLockedError, str(e.value), os.getpid())
    assert path.read_text() == ""  # released: no pid left behind
    with run_lock(d):  # and free again
        pass
    with pytest.raises(ValueError, match="inside"), run_lock(d):  # an exception inside the block releases it too
        raise ValueError("inside")
    with run_lock(d):
        pass


def test_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    d = tmp_path / "run"
    holder = start_holder(d)
    try:
        with pytest.raises(RunLockedError) as e, run_lock(d):
            pass
        assert e.value.pid == holder.pid
    finally:
        holder.kill()  # SIGKILL: no handler, no cleanup code runs
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    assert holder_pid(d / LOCK_NAME) == holder.pid  # the dead holder's pid is still written there ...
    t0 = time.perf_counter()
    with run_lock(d):  # ... but the kernel released its lock: taken at once, no waiting, no stale-lock cleanup
        assert holder_pid(d / LOCK_NAME) == os.getpid()
    assert time.perf_counter() - t0 < 1.0


# ----------------------------------------------------------------------------------------------------------
# klgrad train: a real run holds the lock; a second train / --resume is refused and changes nothing


@pytest.mark.slow
def test_second_train_on_a_running_directory_exits_2_and_leaves_the_run_untouched(tmp_path):
    run, log = tmp_path / "run", tmp_path / "first.log"
    first = subprocess.Popen(
        [sys.executable, "-m", "klgrad", "train", *TRAIN, "--train.steps", "60", "--train.save_every", "2",
         "--train.out_dir", str(run)],
        cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=log.open("w"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "latest").is_file():  # the first run is training, holding the lock
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGSTOP)  # freeze it mid-run, lock held, so nothing below races with it
        before = snapshot(run)
        assert holder_pid(run / LOCK_NAME) == first.pid
        for args in (["--train.out_dir", str(run)], ["--resume", str(run)]):
            t0 = time.perf_counter()
            second = klgrad("train", *TRAIN, "--train.steps", "3", *args)
            assert second.returncode == 2, second.stderr[-3000:]
            assert f"{run} is in use by another klgrad process (pid {first.pid})" in second.stderr
            assert "Traceback" not in second.stderr
            assert snapshot(run) == before  # not a byte of the run changed: metrics, checkpoints, lock file
            assert time.perf_counter() - t0 < 60  # refused at once (the time is the interpreter's imports)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(61))  # every step once
    assert (run / LOCK_NAME).read_text() == ""  # released at the end


# ----------------------------------------------------------------------------------------------------------
# compare, sft, reproduce: a held --out is refused before any work


@pytest.mark.parametrize(
    "command",
    [
        ["compare", "--seeds", "2", "--steps", "1", "--methods", "none,k1_in_reward"],
        ["sft", "--max-steps", "1"],
        ["reproduce", "coefficients"],
    ],
    ids=lambda c: c[0],
)
def test_compare_sft_reproduce_refuse_a_locked_out_with_exit_2(tmp_path, capsys, command):
    out = tmp_path / "out"
    lock_file = sft_lock_file(out) if command[0] == "sft" else out / LOCK_NAME
    with run_lock(out, lock_file=lock_file):
        before = snapshot(tmp_path)
        t0 = time.perf_counter()
        rc = main([*command, "--out", str(out)])
        elapsed = time.perf_counter() - t0
        after = snapshot(tmp_path)
    assert rc == 2
    err = capsys.readouterr().err
    assert f"klgrad {command[0]}: {out} is in use by another klgrad process (pid {os.getpid()})" in err
    assert after == before  # nothing written (sft would save a model, compare would start runs)
    assert elapsed < 60, elapsed  # no training, no model saved: the time is imports
