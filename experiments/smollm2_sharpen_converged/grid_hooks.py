"""Downstream evaluation of a finished ``klgrad compare`` run, as a final hook (run before its weights go):

    klgrad compare ... --final-hook downstream=grid_hooks:downstream
    # with this folder (experiments/smollm2_sharpen_converged/) on PYTHONPATH

``downstream(cfg, run_dir)`` runs ``klgrad eval`` (a subprocess of the same interpreter and klgrad) on the run's
newest checkpoint, on two benchmark files written into ``run_dir/downstream/``:

- ``heldout``: the run's own held-out prompts (the task's ``n_eval`` pairs it never trained on);
- ``harder``: the same task with one more digit per operand (50 held-out pairs of ``data.digits + 1``), the
  paper's "harder variant" of its downstream check.

Each problem is answered once greedily and 8 times at the run's sampling temperature and response cap, scored
by the run's correctness reward (``final_number`` for the chat arithmetic tasks), so pass@1 and pass@8 are of
the distribution the run was trained and measured at. The device is ``auto`` (the GPU when there is one). The
returned dict is each benchmark's row of ``eval.json`` (greedy accuracy, pass@1, pass@8, mean length, n).

The hook lives outside the klgrad package on purpose: a grid pins the package's code, and an evaluation added
later does not change what was trained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HARDER_EVAL = 50
"""Held-out problems of the harder variant."""
SAMPLES = 8
"""Samples per problem: pass@1 and pass@8."""


def _write_jsonl(path: Path, examples) -> Path:
    path.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in examples))
    return path


def benchmark_files(cfg, folder: Path) -> list[Path]:
    """The run's held-out prompts and the harder variant's, as JSONL files in ``folder``."""
    from klgrad.data.tasks import make_splits

    folder.mkdir(parents=True, exist_ok=True)
    d = cfg.data
    _, heldout = make_splits(d.task, d.n_train, d.n_eval, d.seed, d.digits)
    _, harder = make_splits(d.task, d.n_train, HARDER_EVAL, d.seed, d.digits + 1)
    return [_write_jsonl(folder / "heldout.jsonl", heldout), _write_jsonl(folder / "harder.jsonl", harder)]


def reward_name(cfg) -> str:
    names = [f.name for f in cfg.reward.functions]
    return "final_number" if "final_number" in names else "accuracy"


def downstream(cfg, run_dir: Path) -> dict:
    """``klgrad eval`` of the run's final policy on :func:`benchmark_files` (module docstring)."""
    run_dir = Path(run_dir)
    out = run_dir / "downstream"
    files = benchmark_files(cfg, out)
    cmd = [sys.executable, "-m", "klgrad", "eval", "--model", f"policy={run_dir}"]
    for f in files:
        cmd += ["--data", str(f)]
    cmd += [
        "--samples", str(SAMPLES),
        "--temperature", str(cfg.rollout.temperature),
        "--max-new-tokens", str(cfg.rollout.max_new_tokens),
        "--reward", reward_name(cfg),
        "--seed", "0",
        "--device", "auto",
        "--out", str(out / "eval"),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "eval" / "eval.json").read_text())
    return {"command": " ".join(cmd[1:]), "eval": report}
