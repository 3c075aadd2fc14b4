"""What each step draws, as functions of (seed, step) only: its prompts and its sampling uniforms.

Runs of one seed therefore form a block: whatever their KL head, level, form or β, they answer the same prompts
with the same sampling uniforms (common random numbers), which is what lets ``klgrad compare`` pair its runs by
seed; and every split of a step over processes samples the same responses as one process.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import Tensor

from klgrad.rollout.batch import Rollout


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of ``step``: it draws the step's prompts (and seeds engines with their own RNG)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def draw_prompts(gen: torch.Generator, n_train: int, n_prompts: int) -> list[int]:
    """``n_prompts`` training-set indices drawn with ``gen`` (uniform, with replacement)."""
    return torch.randint(n_train, (n_prompts,), generator=gen).tolist()


def prompt_indices(seed: int, step: int, n_train: int, n_prompts: int) -> list[int]:
    """Indices into the training set of the ``n_prompts`` prompts of ``step``: a function of (seed, step) only.

    Together with :func:`rollout_uniforms` this makes runs of one seed a block of common random numbers.
    """
    return draw_prompts(step_generator(seed, step), n_train, n_prompts)


def prompt_seed(seed: int, step: int, prompt: int) -> int:
    """Seed of the sampling generator of global prompt ``prompt`` at ``step`` (63 bits of a sha256)."""
    digest = hashlib.sha256(f"klgrad-rollout:{seed}:{step}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rollout_uniforms(seed: int, step: int, prompts: slice, group_size: int, max_new_tokens: int) -> Tensor:
    """(len(prompts)·G, max_new_tokens) sampling uniforms of the global prompts ``prompts``, in prompt order.

    Prompt i's G rows come from their own generator seeded by (seed, step, i), and the sampler draws a row's
    tokens from its own logits and uniforms only, so every split of the step over processes samples the same
    responses as one process.
    """
    return torch.cat(
        [
            torch.rand(group_size, max_new_tokens, generator=torch.Generator().manual_seed(prompt_seed(seed, step, i)))
            for i in range(prompts.start, prompts.stop)
        ]
    )  # (n, max_new_tokens)


def pad_responses(rollout: Rollout, width: int, pad_id: int) -> Rollout:
    """Right-pad responses to ``width`` tokens (pad id, masked, log-prob 0): a rank whose responses all ended
    early gets the width of the whole step's batch, as in one process."""
    extra = width - rollout.response_ids.shape[1]
    if extra == 0:
        return rollout
    n = rollout.response_ids.shape[0]

    def pad(x: Tensor, value) -> Tensor:
        return torch.cat([x, torch.full((n, extra), value, dtype=x.dtype, device=x.device)], dim=1)  # (n, width)

    return dataclasses.replace(
        rollout,
        response_ids=pad(rollout.response_ids, pad_id),
        response_mask=pad(rollout.response_mask, False),
        logp=pad(rollout.logp, 0.0),
    )
