"""Run every klgrad benchmark and print the targets table (issues #5 and #16). Not a test: numbers, not asserts.

    python bench/run.py            # everything (about 10-15 min on 2 cores; needs the `trl` extra)
    python bench/run.py rollout e2e update   # a subset ("rollout" includes the long decodes, ≤ 512 new tokens)

Each benchmark prints its own table and writes ``bench/results/<name>.json`` (machine and date included).
Run it on an otherwise idle machine: two processes sharing 2 cores slow each other 2-25×.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/run.py` from the repo root

import torch

from bench import e2e, long_decode, memory, objective, rollout, scaling, update
from bench.common import machine, print_table, write_json

BENCHES = {
    "e2e": e2e,
    "rollout": rollout,
    "long_decode": long_decode,
    "update": update,
    "objective": objective,
    "memory": memory,
    "scaling": scaling,
}


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def _ratios(pairs: list[tuple[str, float]], target: float) -> tuple[str, str]:
    """("2.1× (a), 3.4× (b)", "no: worst 2.1×, 1.4× short") for (workload, ratio) pairs against a target ratio."""
    text = ", ".join(f"{x:.2f}× ({name})" for name, x in pairs)
    worst = min(x for _, x in pairs)
    return text, "yes" if worst >= target else f"no: worst {worst:.2f}×, {target / worst:.2f}× short"


def targets_rows(out: dict) -> list[list[str]]:
    """The speed targets (issues #5 and #16) from the benchmarks that ran: measure, target, measured, met."""
    rows = []
    if "e2e" in out:
        rows.append(
            [
                "end-to-end step vs the faster TRL GRPOTrainer",
                "≥ 3×",
                *_ratios(list(out["e2e"]["speedup_by_workload"].items()), 3.0),
            ]
        )
    pairs = []
    for name, res in out.get("rollout", {}).items():
        pairs.append(
            (name.split(" (")[0], res["klgrad (fast decode)"]["tok_per_s"] / res["transformers generate"]["tok_per_s"])
        )
    for workload, res in out.get("long_decode", {}).get("results", {}).items():
        label = workload.split("(")[1].split(",")[0]  # "≤ 128 new"
        pairs.append((label, res["klgrad (fast decode)"]["tok_per_s"] / res["transformers generate"]["tok_per_s"]))
    if pairs:
        rows.append(["rollout tok/s vs transformers generate, batch 256, every workload", "≥ 3×", *_ratios(pairs, 3.0)])
    if "update" in out:
        fr = [r["fraction_of_peak"] for r in out["update"]["results"]]
        rows.append(
            [
                "update phase, share of the fp32 matmul peak at the embedded width",
                "≥ 60%",
                f"{100 * fr[0]:.0f}% (embedded width), {100 * max(fr):.0f}% (best width)",
                _met(fr[0] >= 0.6) + ("" if fr[0] >= 0.6 else f": {0.6 / fr[0]:.1f}× short"),
            ]
        )
    return rows


def main(names: list[str]) -> None:
    torch.set_num_threads(2)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    print(machine())
    out, took = {}, {}
    names = names or list(BENCHES)
    if "rollout" in names and "long_decode" not in names:  # the rollout targets cover every length up to 512
        names = [*names, "long_decode"]
    for name in names:
        t0 = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        out[name] = BENCHES[name].main()
        took[name] = time.perf_counter() - t0
    rows = targets_rows(out)
    if "objective" in out:
        rows.append(
            [
                "objective overhead, share of update step",
                "≤ 3%",
                f"{100 * out['objective']['worst_share']:.2f}%",
                _met(out["objective"]["worst_share"] <= 0.03),
            ]
        )
    if "memory" in out:
        m = out["memory"]
        r1 = m["klgrad"]["peak_extra_bytes"] / m["naive"]["peak_extra_bytes"]
        grad = 4 * memory.B * memory.T * memory.V  # the logits' gradient, which both paths must hold
        r2 = m["klgrad +backward"]["peak_extra_bytes"] / m["naive +backward"]["peak_extra_bytes"]
        r3 = (m["klgrad +backward"]["peak_extra_bytes"] - grad) / (m["naive +backward"]["peak_extra_bytes"] - grad)
        rows.append(
            [
                "real-vocab log-prob peak memory vs naive",
                "≤ 25%",
                f"{100 * r1:.1f}% (fwd), {100 * r2:.1f}% (fwd+bwd), {100 * r3:.1f}% (fwd+bwd less the logits' grad)",
                _met(max(r1, r2) <= 0.25),
            ]
        )
    if rows:
        print_table("targets", ["measure", "target", "measured", "met"], rows)
    write_json("summary", {"targets": rows, "seconds": took})


if __name__ == "__main__":
    main(sys.argv[1:])
