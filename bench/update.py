"""Update phase: achieved FLOP/s of forward + backward + AdamW as a fraction of the fp32 matmul peak.

FLOPs are counted as 6 · params · positions (forward 2, backward 4 per parameter per position run through
the model, prompt included; attention's own L² term is left out, which flatters nobody at these lengths).
klgrad runs each distinct prompt once (shared-prompt log-probs), so two counts are shown: the positions it
actually computes (P·L + N·(T - 1): the hardware efficiency) and the N·(L + T) positions of the batch as a
per-row forward would run them (the effective rate a user sees).
The peak is the best 2048³ fp32 matmul measured in the same run. Rows: the embedded model (hidden 128) on
the embedded default batch (256 rows × 7 prompt + 8 response positions), then wider models, where the same
code meets bigger matmuls.
"""

from __future__ import annotations

from bench.common import matmul_peak_gflops, median, print_table, write_json
from bench.step import RLStep, tiny_model

SETTINGS = [  # (hidden, prompts, group, new tokens)
    (128, 32, 8, 8),
    (128, 32, 8, 32),
    (256, 32, 8, 8),
    (512, 32, 8, 8),
]


def main(repeats: int = 5) -> dict:
    peak = matmul_peak_gflops()
    rows, results = [], []
    for hidden, p, g, t in SETTINGS:
        model, tok = tiny_model(hidden)
        step = RLStep(model, tok, p, g, t)
        for _ in range(2):
            step.run()
        runs = [step.run() for _ in range(repeats)]
        upd = median([r.update for r in runs])
        gflops = 6 * runs[0].params * runs[0].computed / upd / 1e9
        effective = 6 * runs[0].params * runs[0].positions / upd / 1e9
        results.append(
            {
                "hidden": hidden,
                "rows": p * g,
                "new_tokens": t,
                "params": runs[0].params,
                "positions": runs[0].positions,
                "computed_positions": runs[0].computed,
                "effective_gflops": effective,
                "update_s": upd,
                "gflops": gflops,
                "fraction_of_peak": gflops / peak,
            }
        )
        rows.append(
            [
                f"h={hidden}, {p}×{g} rows, {t} new",
                runs[0].params,
                f"{runs[0].computed} / {runs[0].positions}",
                upd,
                gflops,
                gflops / peak,
                effective / peak,
            ]
        )
    print_table(
        f"update phase (forward + backward + AdamW), fp32 matmul peak measured now: {peak:.0f} GFLOP/s",
        ["setting", "params", "positions computed / batch", "median s", "GFLOP/s", "of peak", "effective of peak"],
        rows,
    )
    write_json("update", {"matmul_peak_gflops": peak, "results": results})
    return {"peak": peak, "results": results}


if __name__ == "__main__":
    main()
