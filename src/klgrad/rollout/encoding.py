"""Text <-> tokens at the rollout boundary: prompts (raw or through the chat template), left-padded; responses
decoded without padding."""

from __future__ import annotations

import torch
from torch import Tensor

from klgrad.choices import PromptFormat
from klgrad.rollout.batch import Rollout


def uses_chat(prompt_format: PromptFormat, tokenizer) -> bool:
    """Whether prompts go through the chat template; ``chat`` without a template is a ValueError naming
    ``data.prompt_format``."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise ValueError("data.prompt_format is 'chat' but the tokenizer has no chat template (use auto or raw)")
    return prompt_format != "raw" and has_template


def encode_prompts(tokenizer, prompts: list[str], *, chat: bool = False) -> tuple[Tensor, Tensor]:
    """Left-padded prompt tokens: (P, L) ids and (P, L) bool mask.

    ``chat=False``: BOS (when the tokenizer has one) + the prompt's tokens. ``chat=True``: the prompt as one
    user message through the tokenizer's chat template (its own default system message included, if it has one)
    with the assistant's generation prompt appended, tokenised without adding special tokens (the template writes
    its own); the response then ends with the template's end-of-turn token, the tokenizer's EOS.
    """
    if chat:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        return left_pad(tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
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
