"""Scaling: one full RL step's time (rollout + reference + update) as G, response length and width grow.

Random-weight models of the embedded architecture (4 layers, heads of 32 dims, MLP 4× wider), 32 prompts of
7 tokens, responses forced to their full length so each row's shape is what was computed. Median of 3 after
one warm-up. The cost curve: rollout grows with the number of decode steps (length) and rows; the update
with positions × params.
"""

from __future__ import annotations

from bench.common import median, print_table, write_json
from bench.step import RLStep, tiny_model

GRID = (
    [("G", g, dict(group=g)) for g in (4, 8, 16, 32)]
    + [("length", t, dict(new_tokens=t)) for t in (8, 32, 128)]
    + [("width", h, dict(hidden=h)) for h in (128, 256, 512)]
)


def main(repeats: int = 3) -> dict:
    rows, results = [], []
    for axis, value, kw in GRID:
        model, tok = tiny_model(kw.get("hidden", 128))
        step = RLStep(model, tok, 32, kw.get("group", 8), kw.get("new_tokens", 8))
        step.run()
        runs = [step.run() for _ in range(repeats)]
        med = {k: median([getattr(r, k) for r in runs]) for k in ("rollout", "ref", "update", "total")}
        results.append({"axis": axis, "value": value, "params": runs[0].params, "tokens": runs[0].tokens, **med})
        rows.append(
            [
                f"{axis} = {value}",
                runs[0].params,
                runs[0].tokens,
                med["rollout"],
                med["ref"],
                med["update"],
                med["total"],
                runs[0].tokens / med["total"],
            ]
        )
    print_table(
        "scaling of one RL step (defaults: G = 8, 8 new tokens, hidden 128; 32 prompts)",
        ["setting", "params", "resp. tokens", "rollout s", "ref s", "update s", "step s", "tok/s"],
        rows,
    )
    write_json("scaling", {"results": results})
    return {"results": results}


if __name__ == "__main__":
    main()
