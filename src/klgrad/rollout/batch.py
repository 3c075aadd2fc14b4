"""The rollout interface: the batch a sampler returns (:class:`Rollout`) and what the trainer calls on a
rollout engine (:class:`Sampler`). klgrad's samplers (:mod:`klgrad.rollout.samplers`) and the vLLM engine
(:mod:`klgrad.rollout.vllm_engine`) implement it; the trainer depends only on this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class Rollout:
    """Sampled responses for a batch of prompts, groups contiguous.

    Attributes:
        prompt_ids: (N, P) left-padded prompt tokens, one row per response (prompt i repeated G times).
        prompt_mask: (N, P) bool, True on real prompt tokens.
        response_ids: (N, T) response tokens, ``pad_id`` after EOS.
        response_mask: (N, T) bool, True on response tokens (EOS included).
        logp: (N, T) sampler log-probs at the sampling temperature (0 at padding).
        truncated: (N,) bool, True when the response hit max_new_tokens without EOS.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    logp: Tensor
    truncated: Tensor

    @property
    def input_ids(self) -> Tensor:
        """(N, P + T) prompt and response, for a teacher-forced forward."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(N, P + T) bool."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def lengths(self) -> Tensor:
        """(N,) response lengths in tokens."""
        return self.response_mask.sum(-1)


class Sampler(Protocol):
    """What the trainer needs from a rollout engine (a vLLM engine implements the same call)."""

    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        uniforms: Tensor | None = None,
    ) -> Rollout: ...
