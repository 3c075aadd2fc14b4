"""Objective overhead: the full klgrad objective vs a bare policy-gradient loss on the same tensors.

Both run forward + backward from per-token log-probs (B, T) that require grad, as inside the update step:
bare = -Σ m·A·logp / Σ m; klgrad = :func:`klgrad.objective.policy_objective` (PPO clip, KL head, the chosen
level and form, aggregation). The overhead is reported as a share of the measured update step of the
embedded default (forward + backward + AdamW of the model on the same batch).
"""

from __future__ import annotations

import torch

from bench.common import alternate, median, print_table, write_json
from bench.step import RLStep, tiny_model
from klgrad.config import KLConfig
from klgrad.objective import ObjectiveSpec, decoupled_advantages, policy_objective

HEADS = ["k1_in_reward", "k2_as_loss", "k3_as_loss", "k3_in_reward", "k1_as_loss", "mse_in_reward"]
LEVELS = ["sequence", "token_to_go", "token"]


def main(repeats: int = 30) -> dict:
    model, tok = tiny_model(128)
    step = RLStep(model, tok, 32, 8, 8, fixed_length=False)
    for _ in range(2):
        step.run()
    update_s = median([step.run().update for _ in range(7)])
    r = step.rollout()
    b = step.batch(r)
    n, t = b.mask.shape
    logp0 = b.ref_logp + 0.05 * torch.randn(n, t)
    adv = decoupled_advantages(b.rewards, b.mask, 8, "grpo", None, None)

    def bare():
        logp = logp0.clone().requires_grad_()
        loss = -(torch.where(b.mask, adv * logp, 0.0).sum() / b.mask.sum())
        loss.backward()

    def full(head: str, level: str):
        spec = ObjectiveSpec(KLConfig(head=head, beta=0.5, level=level, form="decoupled"))

        def fn():
            logp = logp0.clone().requires_grad_()
            policy_objective(logp, b.ref_logp, b.mask, adv, spec).loss.backward()

        return fn

    fns = {"bare PG": bare} | {f"{h}/{lv}": full(h, lv) for h in HEADS for lv in LEVELS}
    times = alternate(fns, warmup=3, repeats=repeats)
    base = median(times["bare PG"])
    rows, results = [], {}
    for k, ts in times.items():
        extra = median(ts) - base
        results[k] = {"median_s": median(ts), "overhead_s": extra, "share_of_update": extra / update_s}
        rows.append([k, median(ts) * 1e3, extra * 1e3, 100 * extra / update_s])
    worst = max(v["share_of_update"] for k, v in results.items() if k != "bare PG")
    print_table(
        f"objective overhead vs bare PG loss ({n}×{t} tokens); embedded update step {update_s * 1e3:.0f} ms",
        ["objective", "fwd+bwd ms", "extra ms", "% of update step"],
        rows,
    )
    print(f"worst head/level overhead: {100 * worst:.2f}% of the update step")
    write_json("objective", {"update_s": update_s, "results": results, "worst_share": worst})
    return {"update_s": update_s, "worst_share": worst}


if __name__ == "__main__":
    main()
