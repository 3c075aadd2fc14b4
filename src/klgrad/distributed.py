"""Processes for ``klgrad train`` under ``accelerate launch``: who am I, which rows are mine, and collectives.

One process (``klgrad train``, ``python -m klgrad train``): :class:`Dist` without an accelerator; every
collective is the identity and accelerate is never imported, so a single-process run is the plain path.
Several processes (``WORLD_SIZE > 1``, set by torchrun, which ``accelerate launch --multi_gpu`` and
``configs/accelerate/ddp_cpu.yaml`` use): one ``accelerate.Accelerator`` per process, DDP over NCCL with each
process on its own GPU (``cuda:LOCAL_RANK``), or over gloo on the CPU. :func:`process_placement` decides which,
from ``model.device``, the number of processes, the local rank and the GPUs torch sees; the trainer's device
(:func:`klgrad.trainer.setup.resolve_device`) and the accelerator both follow it.

Global batch rule (docs/distributed.md): ``rollout.prompts_per_step`` is the global number of prompts; rank r
owns the contiguous whole groups of prompts ``[r·P/W, (r+1)·P/W)``, so :meth:`Dist.gather` (concatenation in
rank order) rebuilds the step's batch in prompt order.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

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


@dataclass(frozen=True)
class Placement:
    """Where one process of a run trains (:func:`process_placement`)."""

    device: str
    """``cpu``, ``cuda`` (one process: torch's current GPU) or ``cuda:N``."""
    backend: Literal["nccl", "gloo"] | None
    """The process group's backend; None in a single process (no process group)."""

    @property
    def accelerator_cpu(self) -> bool:
        """Whether the process's ``Accelerator`` is created with ``cpu=True`` (gloo on the CPU)."""
        return self.device == "cpu"


def process_placement(setting: str, world: int, local_rank: int, cuda_count: int) -> Placement:
    """The device and process-group backend of one process, from ``model.device`` (``setting``), the number of
    processes ``world``, this process's ``LOCAL_RANK`` on its node and the number of GPUs torch sees there.

    One process: ``auto`` = ``cuda`` when there is a GPU, else ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` as
    given (a GPU that is not there is an error). Several processes: ``cpu``, or ``auto`` without a GPU, is CPU
    DDP over gloo; ``auto`` or ``cuda`` with GPUs is ``cuda:LOCAL_RANK`` over NCCL, one GPU per process (an
    error when the node has more processes than GPUs); ``cuda:N`` is an error (every process would share GPU
    N). Errors are :class:`ConfigError` naming ``model.device``.
    """
    pinned = re.fullmatch(r"cuda:([0-9]+)", setting)
    if setting not in ("auto", "cpu", "cuda") and pinned is None:
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {setting!r}")
    if setting == "cpu" or (setting == "auto" and cuda_count == 0):
        return Placement("cpu", None if world <= 1 else "gloo")
    if cuda_count == 0:
        raise ConfigError(f"model.device {setting!r}: torch sees no CUDA GPU here (use auto or cpu)")
    if world <= 1:
        if pinned is not None and int(pinned[1]) >= cuda_count:
            raise ConfigError(
                f"model.device {setting!r}: torch sees {cuda_count} GPU(s) here, cuda:0 to cuda:{cuda_count - 1}"
            )
        return Placement("cuda" if pinned is None else setting, None)
    if pinned is not None:
        raise ConfigError(
            f"model.device {setting!r} with {world} processes would put every process on the same GPU; use auto "
            "or cuda (each process takes cuda:LOCAL_RANK) or cpu (docs/distributed.md)"
        )
    if local_rank >= cuda_count:
        raise ConfigError(
            f"model.device {setting!r}: more processes on this node than GPUs (this process has LOCAL_RANK "
            f"{local_rank}, torch sees {cuda_count} GPU(s)); launch at most {cuda_count} processes per node, or "
            "set model.device cpu for CPU DDP (docs/distributed.md)"
        )
    return Placement(f"cuda:{local_rank}", "nccl")


def this_process_placement(setting: str, world: int) -> Placement:
    """:func:`process_placement` of this process: its ``LOCAL_RANK`` (torchrun's; 0 when unset) and the number
    of GPUs torch sees."""
    return process_placement(setting, world, int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())


@dataclass
class Dist:
    """This process's place in the run; ``accelerator`` is None in a single process."""

    accelerator: Any = None

    @classmethod
    def from_env(cls, device: str) -> Dist:
        """A single process unless launched with several (``WORLD_SIZE > 1``); then an accelerator placed by
        :func:`this_process_placement` of ``device`` (``model.device``), the same placement the trainer's
        device comes from."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
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
        place = this_process_placement(device, world)
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, InitProcessGroupKwargs

        if not place.accelerator_cpu:
            torch.cuda.set_device(place.device)  # NCCL's communicator and every later allocation on this GPU
        handler = InitProcessGroupKwargs(backend=place.backend)
        accelerator = Accelerator(cpu=place.accelerator_cpu, kwargs_handlers=[handler])
        expected = DistributedType.MULTI_CPU if place.accelerator_cpu else DistributedType.MULTI_GPU
        got = (accelerator.distributed_type, accelerator.state.backend, accelerator.mixed_precision)
        if got != (expected, place.backend, "no") or not same_device(accelerator.device, place.device):
            raise ValueError(
                f"model.device {device!r} places this process on {place.device} ({expected}, {place.backend}, no "
                f"mixed precision); accelerate set up {got[0]} with backend {got[1]!r}, mixed_precision={got[2]!r} "
                f"on {accelerator.device} (only DDP without accelerate's mixed precision is supported: "
                "docs/distributed.md)"
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

    @property
    def device(self) -> torch.device:
        """Where this process's collectives run: the accelerator's device (``cuda:LOCAL_RANK`` under NCCL, which
        reduces GPU tensors only; the CPU under gloo), the CPU in a single process."""
        return torch.device("cpu") if self.accelerator is None else self.accelerator.device

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
        return self.accelerator.gather(x.contiguous().to(self.device)).to(x.device)

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
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.accelerator.reduce(t, "sum").tolist()

    def max(self, value: float) -> float:
        """Maximum over ranks."""
        if self.accelerator is None:
            return value
        return float(self.accelerator.gather(torch.tensor([value], dtype=torch.float64, device=self.device)).max())

    def max_int(self, value: int) -> int:
        if self.accelerator is None:
            return value
        return int(self.accelerator.gather(torch.tensor([value], device=self.device)).max())

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


def same_device(a: torch.device, b: str) -> bool:
    """Whether ``a`` is the device ``b`` names (any index of the CPU; ``cuda`` without an index: any GPU)."""
    want = torch.device(b)
    return a.type == want.type and (want.type == "cpu" or want.index is None or a.index == want.index)


_SHARDED_ENGINES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
"""Environment flags accelerate launch sets for engines that shard the model (the DDP Accelerator ignores them)."""


def _accelerate_cpu_multi_process_request() -> bool:
    """``accelerate launch --cpu --num_processes N>1`` without mpirun: one process with MASTER_ADDR set."""
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return use_cpu and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ
