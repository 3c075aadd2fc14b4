"""tools/gpu_budget.sh, the budget every prepared GPU command runs its work under: it returns when the work ends,
or stops the work's whole process groups (children included) when the budget is spent."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bash(script: str, timeout: float = 60) -> tuple[str, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", "-c", f"set -u; source tools/gpu_budget.sh; BUDGET_POLL_S=0.1; export BUDGET_POLL_S; {script}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout
    return out, time.monotonic() - t0


def test_work_that_ends_in_time_returns_without_being_stopped():
    out, took = run_bash(
        'setsid sleep 0.3 & a=$!; setsid sleep 0.5 & b=$!; run_within_budget "$(date +%s)" 30 "$a" "" "$b"'
    )
    assert "budget reached" not in out
    assert took < 10  # the wait ended with the work (0.5 s), not at the 30 s budget


def test_the_budget_stops_each_group_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    script = (
        # a leader whose child would outlive it unless the whole group is stopped
        f"setsid bash -c 'sleep 60 & echo $! > {pids}; wait' & a=$!; "
        "setsid sleep 60 & b=$!; "
        # the budget starts once both lead their groups and the child runs (setsid runs after the fork)
        'leads() { [ "$(ps -o pgid= -p "$1" | tr -d " ")" = "$1" ]; }; '
        f"for i in $(seq 300); do leads $a && leads $b && [ -s {pids} ] && break; sleep 0.1; done; "
        'run_within_budget "$(date +%s)" 1 "$a" "$b"; sleep 0.3; '
        # running, not a zombie: the killed child, orphaned with its parent, waits for init to reap it, and
        # kill -0 succeeds on a zombie (that made this test fail 1 run in 3 on a busy machine)
        'running() { s=$(ps -o stat= -p "$1" 2>/dev/null); [ -n "$s" ] && [ "${s:0:1}" != Z ]; }; '
        'running "$a" && echo "a alive"; running "$b" && echo "b alive"; '
        f'running "$(cat {pids})" && echo "child alive"; true'
    )
    out, took = run_bash(script)
    assert "budget reached: stopping" in out
    assert "alive" not in out
    assert took < 45  # stopped within ~2 s of the start (1 s budget, whole-second clock), not after the work's 60 s
