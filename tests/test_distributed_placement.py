"""Where each process of ``klgrad train`` runs (klgrad.distributed.process_placement), and that the accelerator
(Dist.from_env), the trainer's device (resolve_device) and the collectives follow it. No GPU needed: the GPU
count is an argument, and accelerate's Accelerator and torch.cuda.set_device are replaced by recorders."""

from __future__ import annotations

import os
from typing import ClassVar

import pytest
import torch

from klgrad.config import ConfigError
from klgrad.distributed import Dist, Placement, process_placement
from klgrad.trainer import resolve_device
from tests.helpers.extras import reason

# (model.device, processes, LOCAL_RANK, GPUs seen) -> (device, backend)
PLACED = [
    # one process
    ("auto", 1, 0, 0, "cpu", None),
    ("auto", 1, 0, 2, "cuda", None),
    ("cpu", 1, 0, 0, "cpu", None),
    ("cpu", 1, 0, 4, "cpu", None),
    ("cuda", 1, 0, 1, "cuda", None),
    ("cuda:0", 1, 0, 1, "cuda:0", None),
    ("cuda:3", 1, 0, 4, "cuda:3", None),
    # several processes
    ("auto", 2, 0, 2, "cuda:0", "nccl"),
    ("auto", 2, 1, 2, "cuda:1", "nccl"),
    ("auto", 8, 3, 8, "cuda:3", "nccl"),
    ("auto", 16, 7, 8, "cuda:7", "nccl"),  # two nodes of 8: LOCAL_RANK, not RANK, picks the GPU
    ("auto", 2, 1, 0, "cpu", "gloo"),
    ("cpu", 2, 1, 0, "cpu", "gloo"),
    ("cpu", 2, 1, 8, "cpu", "gloo"),  # CPU DDP on a GPU machine when asked
    ("cuda", 2, 0, 2, "cuda:0", "nccl"),
    ("cuda", 4, 3, 4, "cuda:3", "nccl"),
]

REFUSED = [
    # (model.device, processes, LOCAL_RANK, GPUs seen) -> words of the message
    ("cuda", 1, 0, 0, "torch sees no CUDA GPU"),
    ("cuda:0", 1, 0, 0, "torch sees no CUDA GPU"),
    ("cuda:1", 1, 0, 1, "torch sees 1 GPU(s) here, cuda:0 to cuda:0"),
    ("cuda:4", 1, 0, 4, "torch sees 4 GPU(s) here"),
    ("cuda", 2, 1, 0, "torch sees no CUDA GPU"),
    ("auto", 2, 1, 1, "more processes on this node than GPUs (this process has LOCAL_RANK 1, torch sees 1 GPU(s))"),
    ("cuda", 4, 2, 2, "more processes on this node than GPUs (this process has LOCAL_RANK 2, torch sees 2 GPU(s))"),
    ("cuda:0", 2, 0, 2, "with 2 processes would put every process on the same GPU"),
    ("cuda:1", 2, 1, 2, "with 2 processes would put every process on the same GPU"),
    ("mps", 1, 0, 0, "must be auto, cpu, cuda or cuda:N"),
    ("cuda:x", 2, 0, 2, "must be auto, cpu, cuda or cuda:N"),
]


@pytest.mark.parametrize(("setting", "world", "local_rank", "gpus", "device", "backend"), PLACED)
def test_placement_rules(setting, world, local_rank, gpus, device, backend):
    place = process_placement(setting, world, local_rank, gpus)
    assert place == Placement(device, backend)
    assert place.accelerator_cpu == (device == "cpu")


@pytest.mark.parametrize(("setting", "world", "local_rank", "gpus", "words"), REFUSED)
def test_placement_refusals_name_model_device(setting, world, local_rank, gpus, words):
    with pytest.raises(ConfigError, match=r"^model\.device ") as e:
        process_placement(setting, world, local_rank, gpus)
    assert words in str(e.value)


# ----------------------------------------------------------------------------------------------------------
# Dist.from_env and resolve_device take the same placement


class FakeAccelerator:
    """Records how it was created; reports the setup a real one would make of it (or ``made``)."""

    made: ClassVar[dict] = {}
    created: ClassVar[list[dict]] = []
    num_processes = 2

    def __init__(self, cpu: bool = False, kwargs_handlers=()):
        from accelerate.utils import DistributedType

        backend = kwargs_handlers[0].backend
        FakeAccelerator.created.append({"cpu": cpu, "backend": backend})
        default = {
            "distributed_type": DistributedType.MULTI_CPU if cpu else DistributedType.MULTI_GPU,
            "backend": backend,
            "device": torch.device("cpu") if cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"])),
        }
        got = {**default, **FakeAccelerator.made}
        self.distributed_type, self.device, self.mixed_precision = got["distributed_type"], got["device"], "no"
        self.state = type("State", (), {"backend": got["backend"]})()


@pytest.fixture
def launched(monkeypatch):
    """A process of a 2-process launch (LOCAL_RANK 1) with ``gpus`` GPUs; returns the set_device calls. Its tests
    skip without accelerate (they run Dist.from_env's accelerate path against a recording stand-in)."""
    accelerate = pytest.importorskip("accelerate", reason=reason("accelerate"))

    for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setattr(FakeAccelerator, "created", [])
    monkeypatch.setattr(FakeAccelerator, "made", {})
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)

    def with_gpus(n: int) -> list[str]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return calls

    return with_gpus


@pytest.mark.parametrize(
    ("setting", "gpus", "device", "cpu", "backend"),
    [
        ("auto", 2, "cuda:1", False, "nccl"),
        ("cuda", 2, "cuda:1", False, "nccl"),
        ("auto", 0, "cpu", True, "gloo"),
        ("cpu", 2, "cpu", True, "gloo"),
    ],
)
def test_accelerator_and_trainer_device_follow_one_placement(launched, setting, gpus, device, cpu, backend):
    set_device_calls = launched(gpus)
    dist = Dist.from_env(setting)
    assert FakeAccelerator.created == [{"cpu": cpu, "backend": backend}]
    assert set_device_calls == ([] if cpu else [device])
    assert resolve_device(setting, dist.world) == torch.device(device)
    assert dist.device == torch.device(device)


def test_launch_with_more_processes_than_gpus_is_refused_before_accelerate(launched):
    launched(1)
    with pytest.raises(ConfigError, match="more processes on this node than GPUs"):
        Dist.from_env("auto")
    assert FakeAccelerator.created == []


@pytest.mark.parametrize(
    "made",
    [
        {"device": torch.device("cuda", 0)},  # e.g. ACCELERATE_TORCH_DEVICE: another GPU than cuda:LOCAL_RANK
        {"backend": "mpi"},
    ],
)
def test_accelerate_disagreeing_with_the_placement_is_refused(launched, monkeypatch, made):
    launched(2)
    monkeypatch.setattr(FakeAccelerator, "made", made)
    with pytest.raises(ValueError, match=r"model.device 'auto' places this process on cuda:1"):
        Dist.from_env("auto")


def test_one_process_has_no_accelerator(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    dist = Dist.from_env("auto")
    assert (dist.accelerator, dist.world, dist.device) == (None, 1, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------------
# collectives hand the backend tensors on the process's device (NCCL reduces GPU tensors only)


class DeviceCheckingAccelerator:
    """Stands for an NCCL accelerator: its device is ``meta`` (not the CPU); it records the device of every
    tensor it is given and answers on the CPU with known values."""

    device = torch.device("meta")
    num_processes = 2
    process_index = 0

    def __init__(self):
        self.seen: list[torch.device] = []

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.device)
        return torch.arange(2 * t.numel()).reshape(2 * t.shape[0], *t.shape[1:]).to(t.dtype).to("cpu")

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        self.seen.append(t.device)
        return torch.full(t.shape, 3.0, dtype=t.dtype)


def test_collectives_run_on_the_process_device_and_return_to_the_caller():
    acc = DeviceCheckingAccelerator()
    dist = Dist(acc)
    assert dist.device == torch.device("meta")
    gathered = dist.gather(torch.ones(2, 3))  # a CPU tensor of the caller
    assert gathered.device == torch.device("cpu")
    assert gathered.shape == (4, 3)
    assert dist.sum([1.0, 2.0]) == [3.0, 3.0]
    assert dist.max(0.5) == 1.0
    assert dist.max_int(7) == 1
    assert dist.all_true(True) is False  # the fake's sum is 3
    assert acc.seen == [torch.device("meta")] * 5
