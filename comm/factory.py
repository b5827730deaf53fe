"""One entry point that builds a Communicator from a backend name, and the rule that names a group's backend.

[Note: a group's backend]
A group's backend must move the tensors its members hold. NCCL moves CUDA tensors between
GPUs; zmq and gloo move CPU tensors. ``auto`` picks NCCL when every member of the group
holds its tensors on CUDA, else :data:`CPU_BACKEND` (zmq). A CUDA member of a group whose
backend moves CPU tensors (a mixed CPU/CUDA pipeline, or zmq or gloo asked for explicitly)
stages through host memory: it copies what it sends to the CPU and what it receives back to
its device (:func:`wire_device` says where a backend's tensors must be). NCCL asked for a
group with a CPU member is refused: it cannot move CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch

from comm.base import DEFAULT_TIMEOUT, Communicator
from comm.registry.base import Registry
from comm.rendezvous import DEFAULT_LIVENESS_TTL

__all__ = ["BACKENDS", "CPU_BACKEND", "BackendName", "init_communicator", "resolve_backend", "wire_device"]

BackendName = Literal["gloo", "nccl", "zmq", "auto"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl", "zmq", "auto")
CPU_BACKEND = "zmq"  # what ``auto`` picks for a group with a CPU member


def resolve_backend(backend: str, devices: Sequence[str]) -> str:
    """The concrete backend of a group whose members hold their tensors on ``devices`` (one per member).

    See [Note: a group's backend]: ``auto`` is ``nccl`` when every device is CUDA, else zmq.

    Raises:
        ValueError: An unknown backend, or ``nccl`` for a group with a member on the CPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    on_cuda = [torch.device(d).type == "cuda" for d in devices]
    if backend == "auto":
        return "nccl" if on_cuda and all(on_cuda) else CPU_BACKEND
    if backend == "nccl" and not all(on_cuda):
        cpu = [i for i, cuda in enumerate(on_cuda) if not cuda]
        raise ValueError(f"the nccl backend moves CUDA tensors, but member(s) {cpu} of the group hold theirs "
                         "on the CPU: use auto (zmq for a group with a CPU member) or zmq/gloo")
    return backend


def wire_device(backend: str, device: torch.device | str) -> torch.device:
    """Where a member on ``device`` hands ``backend`` its tensors: the device itself for NCCL, else the CPU
    (a CUDA member of a zmq or gloo group stages through host memory)."""
    device = torch.device(device)
    return device if backend == "nccl" else torch.device("cpu")


def init_communicator(
    backend: str,
    *,
    rank: int,
    world_size: int,
    registry: Registry,
    prefix: str = "/cellmesh/default/comm/world",
    timeout: timedelta = DEFAULT_TIMEOUT,
    liveness_ttl: timedelta = DEFAULT_LIVENESS_TTL,
    device: str = "cpu",
    **options: Any,
) -> Communicator:
    """Join a communicator of ``world_size`` ranks that meet under ``prefix`` in ``registry``.

    Every rank calls this with the same ``backend``, ``world_size`` and ``prefix``; the call
    blocks until all ranks arrived (bounded by ``timeout``).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"zmq"`` or ``"auto"`` (NCCL for CUDA, zmq for CPU:
            every rank must then hold its tensors on the same kind of device).
        rank: this process's rank, 0..world_size-1.
        world_size: number of ranks.
        registry: discovery (embedded or etcd); ranks publish their addresses and a liveness
            lease there.
        prefix: a key prefix unique to this communicator (use a new one per job generation).
        timeout: default timeout of every blocking call (300 s unless given).
        liveness_ttl: how long a dead or frozen peer goes unnoticed at most.
        device: for ``auto``: the device this rank's tensors live on.
        options: backend-specific settings, passed to the backend's constructor.

    Raises:
        ValueError: unknown backend, bad rank.
        RegistryTimeoutError: not every rank arrived within ``timeout``.
    """
    name = resolve_backend(backend, [device]) if backend == "auto" else backend
    if name not in BACKENDS:
        raise ValueError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    common: dict[str, Any] = dict(
        rank=rank,
        world_size=world_size,
        registry=registry,
        prefix=prefix,
        timeout=timeout,
        liveness_ttl=liveness_ttl,
    )
    if name == "zmq":
        from comm.zmq.communicator import ZmqCommunicator

        return ZmqCommunicator.create(**common, **options)
    if name == "gloo":
        from comm.torch.gloo import GlooCommunicator

        return GlooCommunicator.create(**common, **options)
    from comm.torch.nccl import NcclCommunicator

    return NcclCommunicator.create(**common, **options)
