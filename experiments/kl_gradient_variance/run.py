"""Variance of KL-gradient estimators at a fixed tiny policy whose exact expected gradient is known.

The audit's tabular problem (klgrad.audit.run.make_problem: V = 4 tokens, T = 4, EOS, 121 responses, float64;
reference at logit distance 0.5). Every response's gradient g_i is computed exactly through the library's loss
code (klgrad.kl.kl_loss_per_sequence, klgrad.kl.analytic), so

  - exact: mean E_q[g] (checked against ∇KL(π‖π_ref)), per-sample tr Cov_q[g] and the variance of g's projection on
    the unit exact gradient; a batch mean of n samples has variance /n, MSE = ‖bias‖² + tr Cov/n;
  - Monte Carlo: R independent batches of n responses drawn from q; the empirical MSE of each estimator against
    the exact gradient, and ratios to a baseline with 95% bootstrap intervals (over batches, paired: the same draws
    feed every estimator of one sampling policy).

Cost: per-sample variance is per unit of compute only if the estimators cost the same per sample. The analytic
head reads both models' next-token distributions; its cost factor c (training step time, analytic / k2) is
measured here on the shipped tiny model (--cost) and the equal-cost ratio is var_ratio · c.

    PYTHONPATH=src python experiments/kl_gradient_variance/run.py            # writes results.json, prints tables
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import Tensor

from klgrad.audit.run import AuditConfig, AuditProblem, make_problem, stale_trajectory
from klgrad.audit.tabular import exact_gradient, token_logps
from klgrad.kl import kl_loss_per_sequence
from klgrad.kl.analytic import analytic_kl_per_sequence, next_token_kl

HERE = Path(__file__).parent


def per_sample_gradients(space, theta: Tensor, loss_fn) -> Tensor:
    """(N, S·V): ∇_θ ℓ_i for every response i, ``loss_fn(theta) -> (N,)``."""
    th = theta.detach().clone().requires_grad_(True)
    losses = loss_fn(th)  # (N,)
    rows = [torch.autograd.grad(losses[i], th, retain_graph=True)[0].reshape(-1) for i in range(losses.shape[0])]
    return torch.stack(rows)  # (N, P)


def estimators(problem: AuditProblem, behaviour: Tensor | None) -> dict:
    """name -> loss_fn(theta) -> (N,), each the library's per-sequence KL loss (on-policy when behaviour is None)."""
    sp, ref = problem.space, problem.ref
    ref_lp = token_logps(sp, ref)  # (N, T)
    old = None if behaviour is None else token_logps(sp, behaviour)  # (N, T)

    def head(name, level, **kw):
        return lambda th: kl_loss_per_sequence(
            name, token_logps(sp, th), ref_lp, sp.mask, old_logp=old, level=level, **kw
        )

    def analytic(level):
        def fn(th):
            kl = next_token_kl(th[sp.state_index], ref[sp.state_index])  # (N, T)
            return analytic_kl_per_sequence(kl, token_logps(sp, th), sp.mask, old_logp=old, level=level)

        return fn

    if behaviour is None:
        return {
            "k1_in_reward@token_to_go": head("k1_in_reward", "token_to_go"),
            "k2_as_loss@sequence": head("k2_as_loss", "sequence"),
            "analytic_kl@token_to_go": analytic("token_to_go"),
            "analytic_kl@sequence": analytic("sequence"),
        }
    return {
        "k1_in_reward@token_to_go/token": head("k1_in_reward", "token_to_go", ratio_level="token"),
        "k1_in_reward@token_to_go/sequence": head("k1_in_reward", "token_to_go", ratio_level="sequence"),
        "k1_in_reward@token_to_go/per_decision": head("k1_in_reward", "token_to_go", ratio_level="per_decision"),
        "k1_in_reward@token_to_go/per_decision_cap2": head(
            "k1_in_reward", "token_to_go", ratio_level="per_decision", ratio_cap=2.0
        ),
        "analytic_kl@token_to_go (prefix ratios)": analytic("token_to_go"),
    }


def bootstrap_ratio(a: Tensor, b: Tensor, reps: int, gen: torch.Generator) -> tuple[float, float, float]:
    """mean(a)/mean(b) and its 95% paired bootstrap interval over the R batches (a, b: (R,) squared errors)."""
    r = a.shape[0]
    idx = torch.randint(0, r, (reps, r), generator=gen)
    ratios = a[idx].mean(-1) / b[idx].mean(-1)  # (reps,)
    lo, hi = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=ratios.dtype)).tolist()
    return float(a.mean() / b.mean()), lo, hi


def study(problem: AuditProblem, behaviour: Tensor | None, baseline: str, n: int, batches: int, seed: int) -> dict:
    sp, theta = problem.space, problem.theta
    g_star = exact_gradient(sp, "rkl", theta, problem.ref).reshape(-1)  # (P,)
    unit = g_star / g_star.norm()
    sampler = theta if behaviour is None else behaviour
    q = token_logps(sp, sampler).sum(-1).exp()  # (N,) sampling distribution
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(q, batches * n, replacement=True, generator=gen).view(batches, n)  # (R, n)
    out, sq_err = {}, {}
    for name, fn in estimators(problem, behaviour).items():
        G = per_sample_gradients(sp, theta, fn)  # (N, P)
        mean = q @ G  # (P,) exact expectation
        var = float((q * (G - mean).pow(2).sum(-1)).sum())  # tr Cov per sample
        proj = G @ unit  # (N,)
        var_proj = float((q * (proj - proj @ q).pow(2)).sum())
        bias_sq = float((mean - g_star).pow(2).sum())
        est = G[draws].mean(1)  # (R, P) batch means
        sq_err[name] = (est - g_star).pow(2).sum(-1)  # (R,)
        out[name] = dict(
            rel_bias=float((mean - g_star).norm() / g_star.norm()),
            var_per_sample=var,
            var_proj_per_sample=var_proj,
            mse_exact_batch=bias_sq + var / n,
            mse_mc_batch=float(sq_err[name].mean()),
        )
    boot = torch.Generator().manual_seed(seed + 1)
    for name in out:
        out[name]["mse_ratio_to_baseline"] = bootstrap_ratio(sq_err[name], sq_err[baseline], 2000, boot)
    return dict(baseline=baseline, batch_size=n, batches=batches, grad_norm_sq=float(g_star.pow(2).sum()), rows=out)


def exact_across_problems(seeds: list[int]) -> dict:
    """Exact per-sample tr Cov of every estimator, on-policy and from the perturbed behaviour, for other random
    problems (AuditConfig(seed=s)): does the ranking at seed 0 hold?"""
    out = {}
    for seed in seeds:
        base = make_problem(AuditConfig(seed=seed))
        sp = base.space
        row = {}
        for part, behaviour in (("on_policy", None), ("off_policy_perturbed", base.behaviour)):
            q = token_logps(sp, base.theta if behaviour is None else behaviour).sum(-1).exp()  # (N,)
            for name, fn in estimators(base, behaviour).items():
                G = per_sample_gradients(sp, base.theta, fn)  # (N, P)
                row[f"{part}:{name}"] = float((q * (G - q @ G).pow(2).sum(-1)).sum())
        out[str(seed)] = row
    return out


def measure_cost(repeats: int = 15) -> dict:
    """Median CPU time (one thread, so a shared machine's load does not enter) of one training forward + backward
    on the shipped tiny model, k2-style log-probs (policy
    with grad + reference no-grad) vs the analytic forward (klgrad.logprobs.logprobs_and_next_kl)."""
    from klgrad.logprobs import logprobs_and_next_kl, sequence_logprobs
    from klgrad.models import load_model_and_tokenizer
    from klgrad.trainer import EMBEDDED_DIR

    torch.manual_seed(0)
    torch.set_num_threads(1)
    policy, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    ref, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    ids = torch.randint(3, 20, (8, 40))
    attn = torch.ones_like(ids)

    def k2_step():
        with torch.no_grad():
            r, _ = sequence_logprobs(ref, ids, attn, 8, 1.0, packing=False)
        logp, _ = sequence_logprobs(policy, ids, attn, 8, 1.0, with_entropy=True, packing=False)
        (0.5 * (logp - r).sum(-1).pow(2)).mean().backward()

    def analytic_step():
        logp, _, kl = logprobs_and_next_kl(policy, ids, attn, 8, ref=ref)
        (torch.exp(logp.cumsum(-1) - logp - (logp.cumsum(-1) - logp).detach()) * kl).sum(-1).mean().backward()

    times = {}
    for name, fn in (("k2", k2_step), ("analytic", analytic_step)) * 2:  # interleaved, first pair warms up
        ts = []
        for _ in range(repeats):
            t0 = time.process_time()
            fn()
            ts.append(time.process_time() - t0)
        times[name] = sorted(ts)
    med = {k: v[len(v) // 2] for k, v in times.items()}
    return dict(
        clock="process_time, 1 thread",
        batch=list(ids.shape),
        median_s=med,
        range_s={k: (v[0], v[-1]) for k, v in times.items()},
        factor=med["analytic"] / med["k2"],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="responses per batch")
    ap.add_argument("--batches", type=int, default=512, help="independent batches (>= 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--problem-seeds", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7, 8])
    args = ap.parse_args()
    cfg = AuditConfig()
    base = make_problem(cfg)
    thetas = stale_trajectory(base, 4, cfg.stale_lr, cfg.beta)
    stale = AuditProblem(base.space, thetas[-1], base.ref, base.behaviour, base.rewards)
    result = dict(
        problem=dict(
            vocab=cfg.vocab, length=cfg.length, ref_distance=cfg.ref_distance, responses=base.space.num_sequences
        ),
        on_policy=study(base, None, "k2_as_loss@sequence", args.n, args.batches, args.seed),
        off_policy_stale=study(stale, thetas[0], "k1_in_reward@token_to_go/sequence", args.n, args.batches, args.seed),
        off_policy_perturbed=study(
            base, base.behaviour, "k1_in_reward@token_to_go/sequence", args.n, args.batches, args.seed
        ),
    )
    result["exact_other_problems"] = exact_across_problems(args.problem_seeds)
    if not args.no_cost:
        result["cost"] = measure_cost()
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for part in ("on_policy", "off_policy_stale", "off_policy_perturbed"):
        print(f"\n{part} (baseline {result[part]['baseline']}, n={args.n}, R={args.batches})")
        for name, row in result[part]["rows"].items():
            r, lo, hi = row["mse_ratio_to_baseline"]
            print(
                f"  {name:45s} bias {row['rel_bias']:.1e}  var/sample {row['var_per_sample']:.4f}  "
                f"proj {row['var_proj_per_sample']:.4f}  MSE exact {row['mse_exact_batch']:.5f} "
                f"MC {row['mse_mc_batch']:.5f}  ratio {r:.3f} [{lo:.3f}, {hi:.3f}]"
            )
    print("\nexact per-sample variance, other problems (seed: on-policy analytic@ttg / k2@seq, k1@ttg / k2@seq;")
    print("   perturbed per_decision / sequence, token / sequence)")
    for seed, row in result["exact_other_problems"].items():
        on = "on_policy:"
        off = "off_policy_perturbed:k1_in_reward@token_to_go/"
        print(
            f"  {seed}: {row[on + 'analytic_kl@token_to_go'] / row[on + 'k2_as_loss@sequence']:.3f}, "
            f"{row[on + 'k1_in_reward@token_to_go'] / row[on + 'k2_as_loss@sequence']:.3f}; "
            f"{row[off + 'per_decision'] / row[off + 'sequence']:.3f}, {row[off + 'token'] / row[off + 'sequence']:.3f}"
        )
    if "cost" in result:
        print("\ncost", result["cost"])


if __name__ == "__main__":
    main()
