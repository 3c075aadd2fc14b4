"""Kill/resume sweep: SIGKILL ``klgrad train`` at every fault-injection point of every step, resume, compare.

For a small run (default 6 steps, a checkpoint every 2) this script

1. runs ``python -m klgrad train`` once uninterrupted (the reference);
2. for every kill point ``<point>:<step>`` (``rollout``, ``update`` and ``log`` at every step; ``checkpoint_file``
   and ``checkpoint_rename`` at every step that saves a checkpoint) runs the same command with
   ``KLGRAD_KILL_AT=<point>:<step>``, checks that the process died by SIGKILL and that the newest valid
   checkpoint (``klgrad.trainer.latest_checkpoint``) is the expected one and verifies against its
   ``checksums.json``, then runs ``--resume RUN_DIR`` (no fault injection) until it exits 0;
3. compares the finished run with the reference: ``metrics.jsonl`` without the wall-clock keys (``time/*``,
   ``tokens_per_s``), the list of checkpoints, and every checkpoint's ``policy.safetensors`` tensor by tensor,
   bit for bit.

It prints a Markdown table (one row per kill point) and a summary line, and exits 1 if any kill point did not
reproduce the reference. ``--quick`` tries a sample of 8 points (each point kind at least once).

    python tools/kill_resume_sweep.py --quick          # ~1 min on 2 CPU cores
    python tools/kill_resume_sweep.py                  # all 24 points of a 6-step run
    python tools/kill_resume_sweep.py --json sweep.json --jobs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_add.yaml"
SMALL = (
    "--rollout.prompts_per_step", "4",
    "--rollout.group_size", "4",
    "--data.n_eval", "8",
    "--data.n_train", "200",
    "--train.eval_every", "2",
    "--train.tensorboard", "false",
    "--algo.micro_batch_size", "8",
    "--train.threads", "1",
)  # fmt: skip
EVERY_STEP_POINTS = ("rollout", "update", "log")
CHECKPOINT_POINTS = ("checkpoint_file", "checkpoint_rename")
VOLATILE = ("time/", "tokens_per_s")


@dataclass
class Outcome:
    point: str
    step: int
    killed_by_sigkill: bool = False
    exit_code: int | None = None
    latest_after_kill: str | None = None
    latest_expected: str | None = None
    latest_verifies: bool = False
    resumes: int = 0
    resumed_ok: bool = False
    metrics_identical: bool = False
    checkpoints_identical: bool = False
    weights_identical: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        return (
            self.killed_by_sigkill
            and self.latest_verifies
            and self.latest_after_kill == self.latest_expected
            and self.resumed_ok
            and self.metrics_identical
            and self.checkpoints_identical
            and self.weights_identical
        )


def save_steps(steps: int, save_every: int) -> list[int]:
    return [s for s in range(1, steps + 1) if s % save_every == 0 or s == steps]


def all_points(steps: int, save_every: int) -> list[tuple[str, int]]:
    """Every kill point a run reaches: per-step points at every step, checkpoint points where it saves."""
    out = []
    for s in range(1, steps + 1):
        out += [(p, s) for p in EVERY_STEP_POINTS]
        if s in save_steps(steps, save_every):
            out += [(p, s) for p in CHECKPOINT_POINTS]
    return out


def quick_points(steps: int, save_every: int) -> list[tuple[str, int]]:
    """A sample: every point kind, the first, a middle and the last step, mid-run and final checkpoints."""
    saves = save_steps(steps, save_every)
    first_save, last_save = saves[0], saves[-1]
    mid = (steps + 1) // 2
    sample = [
        ("rollout", 1),
        ("update", min(3, steps)),
        ("log", first_save),
        ("checkpoint_file", first_save),
        ("checkpoint_rename", saves[len(saves) // 2]),
        ("rollout", mid + 1 if mid + 1 <= steps else steps),
        ("log", steps),
        ("checkpoint_rename", last_save),
    ]
    return list(dict.fromkeys(sample))


def expected_latest(point: str, step: int, steps: int, save_every: int) -> str | None:
    saved = [s for s in save_steps(steps, save_every) if s < step or (s == step and point == "checkpoint_rename")]
    return f"step_{saved[-1]:06d}" if saved else None


def train_cmd(run_dir: Path, steps: int, save_every: int) -> list[str]:
    return [
        sys.executable, "-m", "klgrad", "train", "--config", CONFIG, *SMALL,
        "--train.steps", str(steps), "--train.save_every", str(save_every), "--train.out_dir", str(run_dir),
    ]  # fmt: skip


def run(cmd: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLGRAD_")}
    env.update(env_extra or {})
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def checksums_verify(ckpt: Path) -> bool:
    try:
        sums = json.loads((ckpt / "checksums.json").read_text())
    except (OSError, ValueError):
        return False
    files = {p.name for p in ckpt.iterdir() if p.is_file() and p.name != "checksums.json"}
    if not isinstance(sums, dict) or set(sums) != files or "policy.safetensors" not in files:
        return False
    return all(hashlib.sha256((ckpt / n).read_bytes()).hexdigest() == d for n, d in sums.items())


def stable_metrics(run_dir: Path) -> list[dict]:
    from klgrad.trainer import read_jsonl

    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_jsonl(run_dir / "metrics.jsonl")]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return wa.keys() == wb.keys() and all(wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]) for k in wa)


def try_point(work: Path, reference: Path, point: str, step: int, steps: int, save_every: int) -> Outcome:
    from klgrad.trainer import latest_checkpoint

    t0 = time.perf_counter()
    out = Outcome(point, step, latest_expected=expected_latest(point, step, steps, save_every))
    run_dir = work / f"kill-{point}-{step}"
    killed = run(train_cmd(run_dir, steps, save_every), {"KLGRAD_KILL_AT": f"{point}:{step}"})
    out.exit_code = killed.returncode
    out.killed_by_sigkill = killed.returncode == -signal.SIGKILL
    if not out.killed_by_sigkill:
        out.notes.append(f"exit {killed.returncode}: {killed.stderr.strip().splitlines()[-1:]}")
    latest = latest_checkpoint(run_dir)
    out.latest_after_kill = latest.name if latest is not None else None
    out.latest_verifies = latest is None or checksums_verify(latest)
    for _ in range(3):
        out.resumes += 1
        resumed = run([sys.executable, "-m", "klgrad", "train", "--resume", str(run_dir)])
        if resumed.returncode == 0:
            out.resumed_ok = True
            break
        out.notes.append(f"resume exit {resumed.returncode}: {resumed.stderr.strip().splitlines()[-1:]}")
    if out.resumed_ok:
        out.metrics_identical = stable_metrics(run_dir) == stable_metrics(reference)
        out.checkpoints_identical = checkpoints(run_dir) == checkpoints(reference)
        out.weights_identical = out.checkpoints_identical and all(
            same_weights(
                run_dir / "checkpoints" / name / "policy.safetensors",
                reference / "checkpoints" / name / "policy.safetensors",
            )
            for name in checkpoints(reference)
        )
    out.seconds = time.perf_counter() - t0
    return out


def table(outcomes: list[Outcome]) -> str:
    yes = {True: "yes", False: "**no**"}
    lines = [
        "| # | kill point | died by SIGKILL | newest valid checkpoint after kill | resumes | metrics identical "
        "| weights identical | reproduced bit for bit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, o in enumerate(outcomes, start=1):
        latest = o.latest_after_kill or "none"
        if o.latest_after_kill != o.latest_expected:
            latest += f" (**expected {o.latest_expected or 'none'}**)"
        if not o.latest_verifies:
            latest += " (**checksums fail**)"
        lines.append(
            f"| {i} | `{o.point}:{o.step}` | {yes[o.killed_by_sigkill]} | {latest} | {o.resumes} "
            f"| {yes[o.metrics_identical]} | {yes[o.weights_identical]} | {yes[o.reproduced]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a sample of 8 kill points instead of all of them")
    p.add_argument("--steps", type=int, default=6, help="steps of the run (default 6)")
    p.add_argument("--save-every", type=int, default=2, help="checkpoint period (default 2)")
    p.add_argument("--jobs", type=int, default=2, help="kill points tried at once (default 2; one core each)")
    p.add_argument("--work", default=None, help="folder for the runs (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="also write the outcomes as JSON here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1 or args.jobs < 1:
        p.error("--steps, --save-every and --jobs must be >= 1")

    points = (quick_points if args.quick else all_points)(args.steps, args.save_every)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="klgrad-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        reference = work / "reference"
        if reference.exists():
            shutil.rmtree(reference)
        ref = run(train_cmd(reference, args.steps, args.save_every))
        if ref.returncode != 0:
            print(f"the uninterrupted reference run failed (exit {ref.returncode}):\n{ref.stderr}", file=sys.stderr)
            return 2
        print(
            f"reference: {args.steps} steps, checkpoints at {save_steps(args.steps, args.save_every)}; trying "
            f"{len(points)} kill points ({'sample' if args.quick else 'all'}), {args.jobs} at a time",
            flush=True,
        )
        for d in work.glob("kill-*"):
            shutil.rmtree(d)
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [
                pool.submit(try_point, work, reference, pt, st, args.steps, args.save_every) for pt, st in points
            ]
            outcomes = [f.result() for f in futures]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(outcomes))
    for o in outcomes:
        for note in o.notes:
            print(f"- `{o.point}:{o.step}`: {note}")
    good = sum(o.reproduced for o in outcomes)
    print(
        f"\n{len(outcomes)} kill points tried, {good} reproduced the uninterrupted run bit for bit "
        f"({time.perf_counter() - t0:.0f} s wall, {args.jobs} jobs)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "save_every": args.save_every,
                    "quick": args.quick,
                    "outcomes": [asdict(o) | {"reproduced": o.reproduced} for o in outcomes],
                },
                indent=1,
            )
        )
    return 0 if good == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
