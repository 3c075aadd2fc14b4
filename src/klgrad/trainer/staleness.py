"""Stale rollouts (``rollout.staleness: k``): step t samples with the policy of k updates back, π_{max(t−k, 0)}.

This is what an asynchronous trainer does (TRL's async GRPO ``max_staleness``, NeMo-RL async GRPO, AReaL's
decoupled PPO): the samples of step t were drawn by an older policy while the trainer moved on. klgrad reproduces
it in one process by keeping the last k + 1 snapshots of the trainable parameters (:class:`StaleSnapshots`) and
swapping the oldest into the policy for the rollout and the behaviour pass (:func:`behaviour_weights`). The
update then sees an off-policy batch whose behaviour log-probs o_t are the old policy's, so every KL head's
importance ratio ρ = π_θ/π_{t−k} and clip are taken against the policy that drew the samples.

Memory: k + 1 copies of the trainable parameters (full fine-tuning: k + 1 copies of the model's weights; LoRA:
of the adapter's A and B only), on the parameters' device; no second model. A checkpoint stores the last k
snapshots (``stale.safetensors``) so a resumed run samples from the very same old policies.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

Snapshot = dict[str, Tensor]
"""Detached copies of a model's trainable parameters, by name."""

STALE_FILE = "stale.safetensors"
"""A checkpoint's stale snapshots, key ``{age}/{parameter name}`` (age 0 the oldest)."""


def snapshot(model: torch.nn.Module) -> Snapshot:
    """Detached copies of the parameters that train (all of them, or a LoRA adapter's), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_snapshot(model: torch.nn.Module, snap: Snapshot) -> None:
    """Copy ``snap`` into ``model``'s parameters in place (the optimizer keeps its references and state)."""
    params = dict(model.named_parameters())
    for name, value in snap.items():
        params[name].copy_(value)


class StaleSnapshots:
    """The policies π_{t−k} .. π_t of step t (fewer in the first k steps), oldest first: ``deque(maxlen=k + 1)``.

    ``behaviour`` is the oldest, π_{max(t−k, 0)}: with k = 0 the current policy itself.
    """

    def __init__(self, k: int, kept: list[Snapshot] | None = None) -> None:
        self.k = k
        self.queue: deque[Snapshot] = deque(kept or [], maxlen=k + 1)

    def push(self, model: torch.nn.Module) -> None:
        """Append the current policy's snapshot (the oldest beyond k + 1 falls off)."""
        self.queue.append(snapshot(model))

    @property
    def behaviour(self) -> Snapshot:
        return self.queue[0]

    @property
    def current(self) -> Snapshot:
        return self.queue[-1]

    def to_save(self) -> list[Snapshot]:
        """What a checkpoint after step t keeps: the last k snapshots π_{t−k+1} .. π_t, enough for step t + 1 to
        find π_{t+1−k}."""
        return list(self.queue)[-self.k :] if self.k else []


@contextlib.contextmanager
def behaviour_weights(model: torch.nn.Module, stale: StaleSnapshots) -> Iterator[None]:
    """For the block, ``model`` holds the behaviour policy π_{max(t−k, 0)}; after it, the current π_t again.

    Pushes π_t first, so ``stale`` then holds π_{t−k} .. π_t. With k = 0 nothing is copied.
    """
    if stale.k == 0:
        yield
        return
    stale.push(model)
    load_snapshot(model, stale.behaviour)
    try:
        yield
    finally:
        load_snapshot(model, stale.current)


def save_stale(snaps: list[Snapshot], path: Path) -> None:
    """``snaps`` into one safetensors file, key ``{age}/{name}``."""
    save_file({f"{age}/{name}": t.contiguous() for age, snap in enumerate(snaps) for name, t in snap.items()}, path)


def load_stale(path: Path, device: torch.device | str = "cpu") -> list[Snapshot]:
    """The snapshots :func:`save_stale` wrote, oldest first."""
    flat = load_file(str(path), device=str(device))
    snaps: dict[int, Snapshot] = {}
    for key, t in flat.items():
        age, name = key.split("/", 1)
        snaps.setdefault(int(age), {})[name] = t
    return [snaps[a] for a in sorted(snaps)]
