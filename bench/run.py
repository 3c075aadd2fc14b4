"""Run every klgrad benchmark and print the targets table (issue #5). Not a test: numbers, not asserts.

    python bench/run.py            # everything (about 10-15 min on 2 cores; needs the `trl` extra)
    python bench/run.py rollout memory   # a subset

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


def main(names: list[str]) -> None:
    torch.set_num_threads(2)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    print(machine())
    out, took = {}, {}
    for name in names or list(BENCHES):
        t0 = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        out[name] = BENCHES[name].main()
        took[name] = time.perf_counter() - t0
    rows = []
    if "e2e" in out:
        by_task = ", ".join(f"{x:.2f}× ({task})" for task, x in out["e2e"]["speedup_by_workload"].items())
        rows.append(["end-to-end step vs best TRL GRPOTrainer", "≥ 3×", by_task])
    if "rollout" in out:
        res = out["rollout"]["addition (≤8 new)"]
        x = res["klgrad (fast decode)"]["tok_per_s"] / res["transformers generate"]["tok_per_s"]
        res2 = out["rollout"]["scratchpad (≤32 new)"]
        x2 = res2["klgrad (fast decode)"]["tok_per_s"] / res2["transformers generate"]["tok_per_s"]
        rows.append(["rollout tok/s vs generate, batch 256", "≥ 3×", f"{x:.2f}× (addition), {x2:.2f}× (scratchpad)"])
    if "long_decode" in out:
        ratios = []
        for workload, res in out["long_decode"]["results"].items():
            ratio = res["klgrad (fast decode)"]["tok_per_s"] / res["transformers generate"]["tok_per_s"]
            ratios.append(f"{ratio:.2f}× ({workload.split('(')[1].split(',')[0]})")
        rows.append(["rollout tok/s vs generate, long decodes, EOS suppressed", "≥ 3×", ", ".join(ratios)])
    if "update" in out:
        fr = [r["fraction_of_peak"] for r in out["update"]["results"]]
        rows.append(
            [
                "update phase, fraction of fp32 matmul peak",
                "≥ 60%",
                f"{100 * fr[0]:.0f}% (embedded), {100 * max(fr):.0f}% (best width)",
            ]
        )
    if "objective" in out:
        rows.append(
            ["objective overhead, share of update step", "≤ 3%", f"{100 * out['objective']['worst_share']:.2f}%"]
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
            ]
        )
    if rows:
        print_table("targets (issue #5)", ["measure", "target", "measured"], rows)
    write_json("summary", {"targets": rows, "seconds": took})


if __name__ == "__main__":
    main(sys.argv[1:])
