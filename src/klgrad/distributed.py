"""Processes for ``klgrad train`` under ``accelerate launch``: who am I, which rows are mine, and collectives.

One process (``klgrad train``, ``python -m klgrad train``): :class:`Dist` without an accelerator; every
collective is the identity and accelerate is never imported, so a single-process run is the plain path.
Several processes (``WORLD_SIZE > 1``, set by torchrun, which ``accelerate launch --multi_gpu`` and
``configs/accelerate/ddp_cpu.yaml`` use): one ``accelerate.Accelerator(cpu=True)``, DDP over gloo.

Global batch rule (docs/distributed.md): ``rollout.prompts_per_step`` is the global number of prompts; rank r
owns the contiguous whole groups of prompts ``[r·P/W, (r+1)·P/W)``, so :meth:`Dist.gather` (concatenation in
rank order) rebuilds the step's batch in prompt order.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klgrad.config import Config, ConfigError


def is_main_process() -> bool:
    """True in a single process and on rank 0 of a launched group (reads torchrun's ``RANK``)."""
    return int(os.environ.get("RANK", "0")) == 0


def check_config(cfg: Config, world: int) -> None:
    """Settings a run of ``world`` processes cannot reproduce exactly; raises ConfigError naming the field."""
    if world == 1:
        return
    p, m = cfg.rollout.prompts_per_step, cfg.algo.mini_batches
    if p % world:
        raise ConfigError(
            f"rollout.prompts_per_step must be divisible by the number of processes ({world}) so every process "
            f"gets whole groups of the global batch, got {p}"
        )
    if (p // world) % m:
        raise ConfigError(
            f"algo.mini_batches must divide prompts_per_step / number of processes = {p // world} so each "
            f"mini-batch takes the same prompts from every process, got {m}"
        )
    if cfg.rollout.engine != "klgrad":
        raise ConfigError(
            f"rollout.engine {cfg.rollout.engine!r} draws from its own RNG, so a split batch would sample "
            "other responses than one process; distributed runs need 'klgrad'"
        )


@dataclass
class Dist:
    """This process's place in the run; ``accelerator`` is None in a single process."""

    accelerator: Any = None

    @classmethod
    def from_env(cls) -> Dist:
        """A single process unless launched with several (``WORLD_SIZE > 1``)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            if _accelerate_cpu_multi_process_request():
                raise ValueError(
                    "accelerate launch --cpu --num_processes N starts ONE process in accelerate 1.x (its multi-CPU "
                    "launcher is mpirun); launch `accelerate launch --config_file configs/accelerate/ddp_cpu.yaml "
                    "-m klgrad train ...` or `accelerate launch --multi_gpu --num_processes N -m klgrad train ...` "
                    "(docs/distributed.md)"
                )
            return cls()
        sharded = [k for k in _SHARDED_ENGINES if os.environ.get(k, "").lower() in ("1", "true", "yes")]
        if sharded:
            raise ValueError(
                f"only DDP is supported under accelerate launch; the launch asked for {sharded[0]} (FSDP, "
                "DeepSpeed and Megatron shard the weights that the sampler and reference passes read whole: "
                "docs/distributed.md)"
            )
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        accelerator = Accelerator(cpu=True)  # the trainer keeps models and rollouts on the CPU
        if accelerator.distributed_type != DistributedType.MULTI_CPU or accelerator.mixed_precision != "no":
            raise ValueError(
                f"only DDP on CPU processes (MULTI_CPU, no mixed precision) is supported; accelerate set up "
                f"{accelerator.distributed_type} with mixed_precision={accelerator.mixed_precision!r} "
                "(FSDP and GPU placement: docs/distributed.md)"
            )
        return cls(accelerator)

    @property
    def rank(self) -> int:
        return 0 if self.accelerator is None else self.accelerator.process_index

    @property
    def world(self) -> int:
        return 1 if self.accelerator is None else self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> slice:
        """This rank's contiguous part of ``n`` items (``n`` divisible by the world size)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def local_rows(self, x: Tensor) -> Tensor:
        """This rank's rows of a gathered (N, ...) tensor."""
        return x[self.shard(x.shape[0])]

    def gather(self, x: Tensor) -> Tensor:
        """(n, ...) on every rank -> (world·n, ...) in rank order (equal shapes on every rank)."""
        if self.accelerator is None:
            return x
        return self.accelerator.gather(x.contiguous()).to(x.device)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Picklable ``obj`` of every rank, in rank order."""
        if self.accelerator is None:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so integer counts below 2**53 stay exact)."""
        if self.accelerator is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        return self.accelerator.reduce(t, "sum").tolist()

    def max(self, value: float) -> float:
        """Maximum over ranks."""
        if self.accelerator is None:
            return value
        return float(self.accelerator.gather(torch.tensor([value], dtype=torch.float64)).max())

    def max_int(self, value: int) -> int:
        if self.accelerator is None:
            return value
        return int(self.accelerator.gather(torch.tensor([value])).max())

    def all_true(self, flag: bool) -> bool:
        return self.sum([0.0 if flag else 1.0])[0] == 0.0

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """(training model, optimizer): DDP-wrapped and accelerate's optimizer, or both unchanged."""
        if self.accelerator is None:
            return model, optimizer
        return self.accelerator.prepare(model, optimizer)

    def no_sync(self, model: torch.nn.Module, sync: bool):
        """Skip DDP's gradient all-reduce for this forward/backward unless ``sync`` (the last micro-batch)."""
        if self.accelerator is None or sync:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> Tensor:
        """Global gradient norm (after DDP's all-reduce every rank holds the same gradients), clipped."""
        if self.accelerator is None:
            params = [p for p in model.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)


_SHARDED_ENGINES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
"""Environment flags accelerate launch sets for engines that shard the model (the CPU Accelerator ignores them)."""


def _accelerate_cpu_multi_process_request() -> bool:
    """``accelerate launch --cpu --num_processes N>1`` without mpirun: one process with MASTER_ADDR set."""
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return use_cpu and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ
