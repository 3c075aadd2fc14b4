"""Shared benchmark plumbing: machine facts, warm-up + alternating timing, medians, tables and JSON.

Benchmarks are not tests: they print a table of medians and ratios measured in the same process run, each
pair of contenders alternated (A B A B ...) after warm-up, so drift of the machine hits both alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
TRL_OFFLINE_CPU = {
    "bf16": False,  # fp32, as klgrad (these CPUs have no bf16 units)
    "use_cpu": True,
    "use_vllm": False,  # vLLM needs a GPU
    "report_to": "none",  # no network
    "save_strategy": "no",  # no checkpoint writes in the timed steps
    "disable_tqdm": True,
    "logging_steps": 1,
}
"""What TRL's GRPOConfig needs changed from its defaults to run offline on a CPU, untimed writes off: the only
settings the benchmarks change besides the shared workload's."""


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def alternate(fns: dict[str, Callable[[], object]], *, warmup: int = 2, repeats: int = 7) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, interleaved (a b c a b c ...), after ``warmup`` untimed rounds.

    Returns the wall-clock seconds of every timed call, per name.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def step_records() -> Iterator[list[tuple[float, dict]]]:
    """While open, every step record ``klgrad train`` writes (in this process) is appended to the yielded list as
    (``time.perf_counter()`` when written, record): a step ends when its record is written. Instrumentation only:
    the loop writes each record through ``klgrad.trainer.record.write_jsonl``, wrapped here and restored on exit."""
    import klgrad.trainer.record as record

    out: list[tuple[float, dict]] = []
    write = record.write_jsonl

    def timed_write(path, rec):
        write(path, rec)
        if "reward/mean" in rec:  # a step's record (evaluation-only rows have no reward/mean)
            out.append((time.perf_counter(), rec))

    record.write_jsonl = timed_write
    try:
        yield out
    finally:
        record.write_jsonl = write


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Achieved fp32 GFLOP/s of an n×n×n matmul (2n³ flops), best of ``repeats`` after one warm-up: the peak
    the update phase is compared with, measured in the same run."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in header:
        table.add_column(h, justify="right" if h != header[0] else "left")
    for r in rows:
        table.add_row(*[_fmt(x) for x in r])
    Console(width=140).print(table)


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return path
