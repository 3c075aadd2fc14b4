"""``klgrad train`` on a shared CPU: the embedded default's step time beside one busy process, beside another
``klgrad train``, and alone; klgrad's defaults (``train.threads: auto``) against the fixed 2 threads shipped
before, and against OpenMP's passive wait policy.

Each situation runs ``klgrad train --config configs/tiny_add.yaml`` in a fresh process (so environment
variables such as ``OMP_WAIT_POLICY`` take effect at OpenMP's start) for ``warmup + steps`` steps, evaluation
and checkpoints off, and takes the median ``time/step`` of the last ``steps`` steps from its ``metrics.jsonl``.
"Busy" situations first start ``python -c "while True: pass"`` (one process, one thread, in the same session,
as a job started from the same shell would be); "beside another klgrad train" starts a long ``klgrad train``
of the same settings 8 s before (half the steps are timed there); "beside klgrad eval" starts ``klgrad eval`` of
the embedded model on 40 addition problems in a loop, 5 s before, with ``--threads auto`` (its default: it registers
and takes its share) or ``--threads 2`` (every core, as it ran before it shared). The competitor is killed when the
run ends.
Situations alternate in rounds, so drift of the machine hits every situation alike.

Targets (issue "Fast on a real model, and under load"): with klgrad's defaults the median step beside the busy
process is at most 1.6× the median step alone; alone it is as fast as the fixed 2 threads (within that
setting's own round-to-round spread); two trainers side by side each get about half the machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_add.yaml"
BUSY = "while True: pass"

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
SITUATIONS: dict[str, tuple[str | None, dict[str, str], list[str]]] = {
    # name: (competitor: None, "busy" or "klgrad"; environment; flags of the timed run and of a klgrad competitor)
    "alone, klgrad defaults": (None, {}, []),
    "busy, klgrad defaults": ("busy", {}, []),
    "beside another klgrad train, klgrad defaults": ("klgrad", {}, []),
    "alone, 2 threads (before)": (None, {}, ["--train.threads", "2"]),
    "busy, 2 threads (before)": ("busy", {}, ["--train.threads", "2"]),
    "beside another klgrad train, 2 threads each (before)": ("klgrad", {}, ["--train.threads", "2"]),
    "alone, 2 threads, OMP_WAIT_POLICY=PASSIVE": (None, PASSIVE, ["--train.threads", "2"]),
    "busy, 2 threads, OMP_WAIT_POLICY=PASSIVE": ("busy", PASSIVE, ["--train.threads", "2"]),
    "busy, 1 thread": ("busy", {}, ["--train.threads", "1"]),
    "beside klgrad eval, klgrad defaults": ("eval", {}, []),
    "beside klgrad eval on every core (before)": ("eval-all", {}, []),
}
"""The shipped config says ``train.threads: auto``: "klgrad defaults" passes no thread flag."""


def train_cmd(steps: int, out: str, flags: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "klgrad", "train", "--config", str(CONFIG),
        "--train.steps", str(steps), "--train.eval_every", "0", "--train.save_every", "1000000",
        "--train.tensorboard", "false", "--train.out_dir", out, *flags,
    ]  # fmt: skip


def eval_cmd(out: str, threads: str) -> list[str]:
    """``klgrad eval`` of the embedded model on 40 addition problems (written into ``out`` once), 16 samples each."""
    from klgrad.data import make_splits

    data = Path(out, "add40.jsonl")
    if not data.exists():
        _, heldout = make_splits("addition", 0, 40, seed=0)
        data.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in heldout))
    return [
        sys.executable, "-m", "klgrad", "eval", "--data", str(data), "--samples", "16", "--max-new-tokens", "16",
        "--device", "cpu", "--threads", threads, "--out", f"{out}/eval",
    ]  # fmt: skip


def start_competitor(kind: str | None, env: dict[str, str], flags: list[str], out: str) -> subprocess.Popen | None:
    """``while True: pass``, or a long ``klgrad train`` of the same settings (started, then given 8 s to load
    and reach its steps)."""
    if kind is None:
        return None
    if kind == "busy":
        proc = subprocess.Popen([sys.executable, "-c", BUSY])
        time.sleep(0.5)  # let it take its core
        return proc
    if kind in ("eval", "eval-all"):
        threads = "auto" if kind == "eval" else "2"
        loop = f"while true; do {' '.join(eval_cmd(out, threads))}; done"
        proc = subprocess.Popen(["bash", "-c", loop], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        time.sleep(5)
        return proc
    proc = subprocess.Popen(
        train_cmd(100_000, f"{out}/competitor", flags),
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(8)
    return proc


def train_step_times(steps: int, env: dict[str, str], flags: list[str], competitor: str | None) -> list[float]:
    """``time/step`` of every step of one ``klgrad train`` run (the embedded default), beside a competitor."""
    with tempfile.TemporaryDirectory() as out:
        other = start_competitor(competitor, env, flags, out)
        try:
            subprocess.run(
                train_cmd(steps, f"{out}/run", flags),
                env={**os.environ, **env},
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        finally:
            if other is not None:
                if other.args[0] == "bash":  # an eval loop: its whole process group
                    os.killpg(other.pid, 9)
                else:
                    other.kill()
                other.wait()
        rows = [json.loads(line) for line in Path(out, "run", "metrics.jsonl").read_text().splitlines()]
        return [r["time/step"] for r in rows if "time/step" in r]


def main(rounds: int = 3, steps: int = 20, warmup: int = 3, situations: list[str] | None = None) -> dict:
    names = situations or list(SITUATIONS)
    times: dict[str, list[float]] = {n: [] for n in names}
    medians_per_round: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            competitor, env, flags = SITUATIONS[name]
            n = steps if competitor != "klgrad" else steps // 2  # two trainers at once: half the steps will do
            t = train_step_times(n + warmup, env, flags, competitor)[warmup:]
            times[name] += t
            medians_per_round[name].append(statistics.median(t))
            print(f"  {name}: median {statistics.median(t):.3f} s/step", flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    alone = med[names[0]]
    rows = [[n, len(times[n]), med[n], med[n] / alone] for n in names]
    print_table(
        f"klgrad train, embedded default, median s/step of {steps} steps per run, {rounds} runs per situation",
        ["situation", "steps", "median s/step", "× alone (klgrad defaults)"],
        rows,
    )
    slowdown = med["busy, klgrad defaults"] / alone if "busy, klgrad defaults" in med else None
    before = "alone, 2 threads (before)"
    result = {
        "steps_per_run": steps,
        "rounds": rounds,
        "times_s": times,
        "median_s": med,
        "medians_per_round": medians_per_round,
        "busy_slowdown": slowdown,
        "alone_vs_before": alone / med[before] if before in med else None,
    }
    write_json("contention", result)
    return result


if __name__ == "__main__":
    main()
