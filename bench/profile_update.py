"""Profile one packed update of SmolLM2 (``configs/smollm2_sharpen.yaml``'s batch, k2_as_loss, GRPO shaping): three
timed updates, one forward / backward / AdamW step timed apart, then ``torch.profiler``'s table of one update.

``python -m bench.profile_update [full|lora]``; ``bench/results/smollm2_update_profile.txt`` is one run's output.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.real import config
from klgrad.models.sources import reference_path
from klgrad.objective import ObjectiveSpec
from klgrad.rollout.encoding import encode_prompts
from klgrad.rollout.samplers import KlgradSampler
from klgrad.trainer import Batch, make_logprob_fn, update
from klgrad.trainer.setup import load_data, load_policy_and_reference, make_optimizer
from klgrad.trainer.update import PolicyLogprobs


def main(mode: str = "full") -> None:
    torch.set_num_threads(2)
    cfg = config(mode, **{"algo.micro_batch_size": 32})
    r = cfg.rollout
    policy, ref, tok = load_policy_and_reference(cfg, reference_path(cfg), torch.device("cpu"))
    train, _ = load_data(cfg)
    ids, mask = encode_prompts(tok, [e.prompt for e in train[: r.prompts_per_step]], chat=True)
    policy.eval()
    with torch.no_grad():
        roll = KlgradSampler(tok.eos_token_id, tok.pad_token_id).generate(
            policy,
            ids,
            mask,
            group_size=r.group_size,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            generator=torch.Generator().manual_seed(0),
        )
    policy.train()
    optimizer, _ = make_optimizer(cfg, policy)
    spec = ObjectiveSpec.from_config(cfg)
    rewards = torch.rand(roll.response_ids.shape[0], generator=torch.Generator().manual_seed(0))
    fn = make_logprob_fn(r.temperature, packing=True)
    with torch.no_grad():
        ref_logp, _ = fn(ref, roll.input_ids, roll.attention_mask, ids.shape[1], False)
    batch = Batch(roll.input_ids, roll.attention_mask, ids.shape[1], roll.response_mask, rewards, ref_logp, None)
    for _ in range(2):  # warm-up
        update(policy, optimizer, batch, cfg, spec, fn)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        update(policy, optimizer, batch, cfg, spec, fn)
        times.append(time.perf_counter() - t0)
    print("update", times)
    t0 = time.perf_counter()
    logp, ent = PolicyLogprobs(policy, fn)(batch.input_ids, batch.attention_mask, batch.response_start, True)
    t1 = time.perf_counter()
    torch.where(batch.mask, logp + 0.01 * ent, 0.0).sum().backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    print("fwd", t1 - t0, "bwd", t2 - t1, "adamw", t3 - t2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update(policy, optimizer, batch, cfg, spec, fn)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "full")
