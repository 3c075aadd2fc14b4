"""The analytic KL head's cost on SmolLM2 (``configs/smollm2_sharpen.yaml``'s batch): one update's step time and peak
memory with ``kl.head: analytic_kl`` (token_to_go) against ``k2_as_loss`` (sequence), same rollout batch.

Each head runs in its own process (peak memory is the process's: CUDA's max_memory_allocated on a GPU, ru_maxrss on
CPU), the two alternated ``--pairs`` times; the row is the median step time and the peak of each, and the ratios
(issue goal: ≤ 1.3× the step, ≤ 1.2× the memory). What dominates: the analytic forward holds both models'
(B, T, V) response logits for the micro-batch (klgrad.logprobs.logprobs_and_next_kl), so the extra memory is one
more (B, T, V) float32 buffer plus the KL kernel's chunked workspace, and the extra time one reference forward
inside the update (the k2 path reads its reference log-probs from the batch).

Not run yet: on the shared 2-core CPU of the session that wrote it, one pair did not finish within 5 minutes; run it on
a quiet machine or a GPU.

    python -m bench.analytic_cost                  # both heads, 3 pairs, writes bench/results/analytic_cost.json
    python -m bench.analytic_cost --one analytic_kl  # one process's row (what the driver runs)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from bench.common import median, write_json
from bench.real import config
from klgrad.logprobs import logprobs_and_next_kl
from klgrad.models.sources import reference_path
from klgrad.rollout.encoding import encode_prompts
from klgrad.rollout.samplers import KlgradSampler
from klgrad.trainer import Batch, make_logprob_fn, update
from klgrad.trainer.setup import load_data, load_policy_and_reference, make_optimizer
from klgrad.trainer.update import PolicyLogprobs

HEADS = {"k2_as_loss": {"kl.level": "sequence"}, "analytic_kl": {"kl.level": "token_to_go"}}


def one(head: str, steps: int = 3) -> dict:
    """Median time of ``steps`` updates (after one warm-up) and the process's peak memory, for ``head``."""
    cfg = config("full", **{"kl.head": head, "kl.clip_eps": None, **HEADS[head]})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    r = cfg.rollout
    policy, ref, tok = load_policy_and_reference(cfg, reference_path(cfg), device)
    train, _ = load_data(cfg)
    ids, mask = encode_prompts(tok, [e.prompt for e in train[: r.prompts_per_step]], chat=True)
    ids, mask = ids.to(device), mask.to(device)
    policy.eval()
    with torch.no_grad():
        roll = KlgradSampler(tok.eos_token_id, tok.pad_token_id).generate(
            policy,
            ids,
            mask,
            group_size=r.group_size,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            generator=torch.Generator(device=device).manual_seed(0),
        )
    policy.train()
    optimizer, _ = make_optimizer(cfg, policy)
    fn = make_logprob_fn(r.temperature, packing=cfg.train.packing)
    with torch.no_grad():
        ref_logp, _ = fn(ref, roll.input_ids, roll.attention_mask, ids.shape[1], False)
    rewards = torch.rand(roll.response_ids.shape[0], generator=torch.Generator().manual_seed(0)).to(device)
    batch = Batch(roll.input_ids, roll.attention_mask, ids.shape[1], roll.response_mask, rewards, ref_logp, None)
    analytic_fn = None
    if head == "analytic_kl":

        def analytic_fn(model, input_ids, attention_mask, response_start):
            return logprobs_and_next_kl(
                model, input_ids, attention_mask, response_start, ref=ref, temperature=r.temperature
            )

    train_model = PolicyLogprobs(policy, fn, analytic_fn)
    update(policy, optimizer, batch, cfg, fn, train_model=train_model)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        update(policy, optimizer, batch, cfg, fn, train_model=train_model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return dict(
        head=head,
        device=str(device),
        step_s=median(times),
        times=times,
        peak_bytes=int(peak),
        responses=int(roll.response_ids.shape[0]),
        tokens=int(roll.response_mask.sum()),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=tuple(HEADS))
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    rows: dict[str, list[dict]] = {h: [] for h in HEADS}
    for _ in range(args.pairs):
        for head in HEADS:
            out = subprocess.run(
                [sys.executable, "-m", "bench.analytic_cost", "--one", head], check=True, capture_output=True, text=True
            ).stdout
            rows[head].append(json.loads(out.strip().splitlines()[-1]))
    step = {h: median([r["step_s"] for r in rs]) for h, rs in rows.items()}
    peak = {h: max(r["peak_bytes"] for r in rs) for h, rs in rows.items()}
    payload = dict(
        rows=rows,
        step_s=step,
        peak_bytes=peak,
        step_ratio=step["analytic_kl"] / step["k2_as_loss"],
        memory_ratio=peak["analytic_kl"] / peak["k2_as_loss"],
    )
    print(json.dumps({k: payload[k] for k in ("step_s", "peak_bytes", "step_ratio", "memory_ratio")}, indent=2))
    write_json("analytic_cost", payload)


if __name__ == "__main__":
    main()
