"""One small update batch on the float64 tiny Llama, shared by the update tests (tests/trainer/test_update.py) and
the framework-preset gradient tests (tests/audit/test_framework_head.py)."""

from __future__ import annotations

import torch

from klgrad.trainer import Batch, make_logprob_fn
from tests.helpers.tiny_llama import BOS, EOS, PAD, V, tiny_llama64

F64 = torch.float64
P, G, L, T = 3, 2, 2, 4  # prompts, group size, prompt width, response width
N = P * G
LOGPROBS = make_logprob_fn(1.0, fast_forward=False)


def make_batch(seed: int = 0, off_policy: bool = False, rewards: bool = True) -> Batch:
    """N = 6 rows: BOS + one prompt token, then a response of 1..4 tokens (EOS last, then padding); reference
    log-probs of the model of seed 11, behaviour log-probs (off-policy) of seed 12; rewards uniform in [0, 1)
    from the same generator, or all 0."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (P,), generator=gen).repeat_interleave(G)  # (N,)
    lengths = torch.tensor([4, 1, 3, 2, 4, 3])  # (N,) response tokens, EOS included
    responses = torch.randint(3, V, (N, T), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (N, T)
    responses[torch.arange(N), lengths - 1] = EOS
    responses = torch.where(mask, responses, PAD)
    input_ids = torch.cat([torch.full((N, 1), BOS), prompts[:, None], responses], dim=1)  # (N, L + T)
    attention_mask = torch.cat([torch.ones(N, L, dtype=torch.long), mask.long()], dim=1)
    with torch.no_grad():
        ref_logp, _ = LOGPROBS(tiny_llama64(seed=11, attn="sdpa"), input_ids, attention_mask, L, False)
        old = (
            LOGPROBS(tiny_llama64(seed=12, attn="sdpa"), input_ids, attention_mask, L, False)[0] if off_policy else None
        )
    r = torch.rand(N, generator=gen, dtype=F64) if rewards else torch.zeros(N, dtype=F64)
    return Batch(input_ids, attention_mask, L, mask, r, ref_logp, old)
