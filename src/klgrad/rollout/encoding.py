"""Text <-> tokens at the rollout boundary: BOS + prompt, left-padded; responses decoded without padding."""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.rollout.samplers import Rollout


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """BOS (when the tokenizer has one) + prompt tokens, left-padded: (P, L) ids and (P, L) bool mask."""
    bos = tokenizer.bos_token_id
    rows = [([bos] if bos is not None else []) + tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return left_pad(tokenizer, rows)


def left_pad(tokenizer, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Token rows left-padded with the tokenizer's pad token (its EOS when it has none): (P, L) ids, (P, L) mask."""
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = True
    return ids, mask


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """Response texts (special tokens and padding dropped)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = rollout.response_ids.masked_fill(~rollout.response_mask, pad)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)
