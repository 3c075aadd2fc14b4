"""What each final policy of a ``klgrad compare`` grid cost the model elsewhere, measured after the grid: KL in
both directions to the reference on klgrad's shipped general chat prompts (forgetting tracks the forward KL, "RL's
Razor", arXiv 2509.04259), written as ``runs/<run>/forgetting.json`` beside each run's ``final.json``.

    python experiments/smollm2_sharpen_converged/grid_forgetting.py GRID_DIR [--samples N] \
        [--device auto|cpu|cuda] [--only NAME ...]

Each run's newest valid checkpoint is loaded over its starting model (the reference), and
``python -m klgrad.eval.forgetting`` measures both KLs at the run's sampling temperature (responses cut at 64
tokens). The runs share one reference and one seed, so the reference's responses (the forward KL's samples) are
drawn once and only scored against each policy (klgrad.exact.estimators.forgetting_kl). A run that already has
``forgetting.json`` is skipped, so the script resumes; a run whose checkpoints are gone (``--no-checkpoints``) is
reported and skipped. ``experiments/smollm2_sharpen_converged/sharpen_report.py`` tables the files it finds.
Cost: docs/reproduction.md §12 (minutes a run for N = 4 on a 2-core CPU with SmolLM2's short answers).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from tqdm import tqdm

from klgrad.eval.forgetting import main as forgetting_main
from klgrad.trainer.checkpoints import latest_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", type=Path)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt and direction (default 4)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--only", nargs="*", default=None, help="run folder names to measure (default: every run)")
    args = ap.parse_args(argv)
    todo, missing = [], []
    for run in sorted((args.grid / "runs").glob("*")):
        if not (run / "final.json").is_file() or (args.only and run.name not in args.only):
            continue
        if (run / "forgetting.json").is_file():
            continue
        (todo if latest_checkpoint(run) is not None else missing).append(run)
    for run in missing:
        print(f"{run.name}: no valid checkpoint left, skipped", file=sys.stderr)
    for run in tqdm(todo, desc="forgetting", unit="run"):
        tmp = run / "forgetting.json.tmp"
        argv_run = ["--policy", str(run), "--samples", str(args.samples), "--device", args.device, "--out", str(tmp)]
        with contextlib.redirect_stdout(io.StringIO()):  # the JSON goes to the file, the progress bar stays readable
            forgetting_main(argv_run)
        json.loads(tmp.read_text())  # complete JSON before it takes the final name
        tmp.replace(run / "forgetting.json")
    print(f"{len(todo)} measured, {len(missing)} without checkpoints, in {args.grid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
