"""Whether two ``klgrad train`` run directories hold the same run: the guard of a trainer refactor.

    python tools/same_run.py RUN_A RUN_B

Same run: every metrics.jsonl record and summary.json value equal (exact float equality) apart from wall-clock
timings, and every tensor of the last checkpoint (``checkpoints/latest``: policy weights, AdamW state, a reference
or stale snapshots when saved) bit-identical, its state.json equal. Timings (``time/*``, ``tokens_per_s``,
``mean_step_time_s``) differ between any two runs and are ignored, and so is :data:`NOT_COMPARED`. Prints each
difference; exits 0 when there is none, 1 otherwise.

On one machine, with a fixed thread count (``--train.threads 2``), klgrad's loop is deterministic, so a refactor that
keeps the arithmetic keeps every bit (issue 60's check: 8 steps of configs/tiny_add.yaml before and after).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING_KEYS = ("tokens_per_s", "mean_step_time_s")
"""Keys (besides ``time/*``) that measure wall-clock time."""
NOT_COMPARED = ("config.train.out_dir", "torch_rng")
"""Where each run was written, and the process's global torch generator (saved with the AdamW state; its state
differs between two processes, and no step draws from it: sampling uses per-step generators, trainer/draws.py)."""


def is_timing(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return name.startswith("time/") or name in TIMING_KEYS or key in NOT_COMPARED


def flat(data: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts and lists as ``{"a.b[0]": leaf}``."""
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    if isinstance(data, list):
        return {k: v for i, value in enumerate(data) for k, v in flat(value, f"{prefix[:-1]}[{i}].").items()}
    return {prefix[:-1]: data}


def value_differences(a: object, b: object, where: str) -> list[str]:
    fa, fb = flat(a), flat(b)
    keys = [k for k in dict.fromkeys([*fa, *fb]) if not is_timing(k)]
    return [
        f"{where}: {k}: {fa.get(k, '<absent>')!r} != {fb.get(k, '<absent>')!r}" for k in keys if fa.get(k) != fb.get(k)
    ]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint file's tensors by dotted name (safetensors, or a torch state dict such as optim.pt)."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return flat_tensors(torch.load(path, map_location="cpu", weights_only=True))


def flat_tensors(data: object, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in flat_tensors(value, f"{prefix}{key}.").items()}
    if isinstance(data, list | tuple):
        return {k: v for i, value in enumerate(data) for k, v in flat_tensors(value, f"{prefix}{i}.").items()}
    return {prefix[:-1]: data}


def tensor_differences(a: Path, b: Path) -> list[str]:
    ta, tb = tensors(a), tensors(b)
    out = [f"{a.name}: {k} in one checkpoint only" for k in sorted(ta.keys() ^ tb.keys())]
    for k in sorted(k for k in ta.keys() & tb.keys() if not is_timing(k)):
        x, y = ta[k], tb[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            out.append(f"{a.name}: {k} differs")
    return out


def last_checkpoint(run: Path) -> Path:
    pointer = run / "checkpoints" / "latest"
    return run / "checkpoints" / pointer.read_text().strip()


def differences(run_a: Path, run_b: Path) -> list[str]:
    """Every difference between the two runs (empty: the same run)."""
    out = []
    rows_a, rows_b = (
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (run_a, run_b)
    )
    if len(rows_a) != len(rows_b):
        out.append(f"metrics.jsonl: {len(rows_a)} records != {len(rows_b)}")
    for a, b in zip(rows_a, rows_b, strict=False):
        out += value_differences(a, b, f"metrics.jsonl step {a.get('step')}")
    summary_a, summary_b = (json.loads((run / "summary.json").read_text()) for run in (run_a, run_b))
    out += value_differences(summary_a, summary_b, "summary.json")
    ckpt_a, ckpt_b = last_checkpoint(run_a), last_checkpoint(run_b)
    if ckpt_a.name != ckpt_b.name:
        out.append(f"last checkpoint: {ckpt_a.name} != {ckpt_b.name}")
    names = sorted({p.name for p in [*ckpt_a.iterdir(), *ckpt_b.iterdir()] if p.suffix in (".safetensors", ".pt")})
    for name in names:
        if not (ckpt_a / name).is_file() or not (ckpt_b / name).is_file():
            out.append(f"{name} in one checkpoint only")
            continue
        out += tensor_differences(ckpt_a / name, ckpt_b / name)
    state_a, state_b = (json.loads((c / "state.json").read_text()) for c in (ckpt_a, ckpt_b))
    out += value_differences(state_a, state_b, "state.json")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    diffs = differences(args.run_a, args.run_b)
    for line in diffs:
        print(line)
    print("same run" if not diffs else f"{len(diffs)} difference(s)")
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
