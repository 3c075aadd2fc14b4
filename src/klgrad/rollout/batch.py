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
    """What the trainer calls on every rollout engine: :class:`~klgrad.rollout.samplers.KlgradSampler`,
    :class:`~klgrad.rollout.samplers.HFGenerateSampler` and :class:`~klgrad.rollout.vllm_engine.VLLMSampler`.

    Randomness comes from ``generator`` (or the engine's own RNG seeded from it). klgrad's own sampler also takes
    ``uniforms=`` (P·G, max_new_tokens), the per-draw uniforms that make a run independent of how its batch is
    split (:func:`klgrad.trainer.draws.rollout_uniforms`); that keyword is its own, not the protocol's."""

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
    ) -> Rollout:
        """P left-padded prompts -> P·G responses, groups contiguous, log-probs at ``temperature``."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights; the trainer calls it after every update (a
        no-op for an engine that samples from ``model`` itself)."""
        ...
