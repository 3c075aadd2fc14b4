"""The ceiling of SmolLM2's update on this CPU: the fp32 rate of the model's own matrix products against the
2048³ product the update is compared with, all in one process, alternated.

The packed update's products have M = the batch's packed positions (~430-770 for ``configs/smollm2_sharpen.yaml``)
and K, N from the model's widths (576 hidden, 1,536 MLP, 960 fused q/k/v, 49,152 vocabulary): skinny next to a
2048³ product, so they run below its rate whatever the trainer does. Each shape is timed forward (X·W), as a
weight gradient (Gᵀ·X, K = positions) and as an input gradient (G·W, N = the input width). ~1 minute.
"""

from __future__ import annotations

import time

import torch

from bench.common import matmul_peak_gflops, median, print_table, write_json

POSITIONS = 466
"""Rows of a product: the real response tokens of a typical SmolLM2 batch (461-539 measured in bench/real.py)."""
SHAPES = {  # name -> (input width K, output width N)
    "q/k/v (fused)": (576, 960),
    "o_proj": (576, 576),
    "gate/up (fused)": (576, 3072),
    "down_proj": (1536, 576),
    "lm_head": (576, 49152),
}


def rate(m: int, k: int, n: int, repeats: int = 7) -> dict[str, float]:
    """GFLOP/s of the forward X(m,k)·W(k,n), the weight gradient Xᵀ(k,m)·G(m,n), the input gradient G(m,n)·Wᵀ(n,k)."""
    x, w, g = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    products = {"forward": lambda: x @ w, "weight grad": lambda: x.t() @ g, "input grad": lambda: g @ w.t()}
    out = {}
    for name, fn in products.items():
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = 2 * m * k * n / median(times) / 1e9
    return out


def main() -> dict:
    peak_before = matmul_peak_gflops()
    rates = {name: rate(POSITIONS, k, n) for name, (k, n) in SHAPES.items()}
    peak_after = matmul_peak_gflops()
    peak = max(peak_before, peak_after)
    rows = [
        [f"{name} [{POSITIONS}, {k}] × [{k}, {n}]", *(f"{r:.0f} ({r / peak:.0%})" for r in rates[name].values())]
        for name, (k, n) in SHAPES.items()
    ]
    print_table(
        f"SmolLM2's products vs the 2048³ peak ({peak_before:.0f} before, {peak_after:.0f} after), GFLOP/s",
        ["product", "forward", "weight grad", "input grad"],
        rows,
    )
    write_json("shapes", {"positions": POSITIONS, "peak_gflops": [peak_before, peak_after], "rates_gflops": rates})
    return {"peak": peak, "rates": rates}


if __name__ == "__main__":
    main()
