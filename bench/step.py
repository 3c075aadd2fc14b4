"""One RL step built from klgrad's own pieces, phase by phase, on any model and shape.

Used by the update-phase, objective-overhead and scaling benchmarks: rollout (klgrad's sampler), reference
log-probs, then :func:`klgrad.trainer.update` (one on-policy AdamW step over the whole batch, k2_as_loss at
sequence level, GRPO shaping). Responses can be forced to a fixed length (EOS never ends them) so that a
shape in a table is the shape that was computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from klgrad.config import load_config
from klgrad.models import build_char_tokenizer, count_parameters
from klgrad.models.factory import build_tiny_model
from klgrad.rollout.samplers import KlgradSampler
from klgrad.trainer import Batch, make_logprob_fn, update


@dataclass
class StepTimes:
    rollout: float
    ref: float
    update: float
    tokens: int  # response tokens in the batch
    positions: int  # (prompt + response) positions of the batch, N·(L + T)
    computed: int  # positions the model runs: P·L + Σ(|y| − 1) packed (each prompt once), P·L + N·(T − 1) padded
    params: int

    @property
    def total(self) -> float:
        return self.rollout + self.ref + self.update


def tiny_model(hidden: int = 128, layers: int = 4, seed: int = 0):
    """The embedded architecture at another width (heads of 32 dims, MLP 4× wider), random weights."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed, hidden=hidden, layers=layers, heads=hidden // 32, intermediate=4 * hidden)
    return model, tok


def make_prompts(tok, n: int, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """n prompts of ``length`` tokens: BOS then random digits and operators (shape is what matters here)."""
    g = torch.Generator().manual_seed(0)
    body = torch.randint(
        tok.convert_tokens_to_ids("0"), tok.convert_tokens_to_ids("9") + 1, (n, length - 1), generator=g
    )
    ids = torch.cat([torch.full((n, 1), tok.bos_token_id), body], dim=1)
    return ids, torch.ones_like(ids, dtype=torch.bool)


class RLStep:
    """A reusable step: fixed model, optimizer and shapes; ``run()`` times one full step."""

    def __init__(
        self,
        model,
        tok,
        prompts: int = 32,
        group: int = 8,
        new_tokens: int = 8,
        fixed_length: bool = True,
        packing: bool = True,
    ):
        self.model, self.tok = model, tok
        self.ref = type(model)(model.config)
        self.ref.load_state_dict(model.state_dict())
        self.ref.eval().requires_grad_(False)
        self.cfg = load_config(
            None,
            {
                "rollout.prompts_per_step": prompts,
                "rollout.group_size": group,
                "rollout.max_new_tokens": new_tokens,
                "algo.micro_batch_size": prompts * group,
            },
        )
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        eos = -1 if fixed_length else tok.eos_token_id  # -1: never drawn, every response runs to new_tokens
        self.sampler = KlgradSampler(eos, tok.pad_token_id)
        self.ids, self.mask = make_prompts(tok, prompts)
        self.packing = packing
        self.logprob_fn = make_logprob_fn(1.0, packing=packing)
        self.seed = 0

    def rollout(self):
        self.model.eval()
        self.seed += 1
        r = self.sampler.generate(
            self.model,
            self.ids,
            self.mask,
            group_size=self.cfg.rollout.group_size,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            generator=torch.Generator().manual_seed(self.seed),
        )
        self.model.train()
        return r

    def batch(self, r) -> Batch:
        with torch.no_grad():
            ref_logp, _ = self.logprob_fn(self.ref, r.input_ids, r.attention_mask, self.ids.shape[1], False)
        rewards = torch.rand(r.response_ids.shape[0], generator=torch.Generator().manual_seed(self.seed))
        return Batch(r.input_ids, r.attention_mask, self.ids.shape[1], r.response_mask, rewards, ref_logp, None)

    def run(self) -> StepTimes:
        t0 = time.perf_counter()
        r = self.rollout()
        t1 = time.perf_counter()
        b = self.batch(r)
        t2 = time.perf_counter()
        update(self.model, self.opt, b, self.cfg, self.logprob_fn)
        t3 = time.perf_counter()
        n, t = r.response_ids.shape
        if self.packing:  # each prompt once, each response's real tokens but its last (docs/performance.md)
            computed = self.ids.numel() + int((r.response_mask.sum(-1) - 1).clamp(min=0).sum())
        else:
            computed = self.ids.numel() + n * (t - 1)
        return StepTimes(
            t1 - t0,
            t2 - t1,
            t3 - t2,
            int(r.response_mask.sum()),
            r.input_ids.numel(),
            computed,
            count_parameters(self.model),
        )
