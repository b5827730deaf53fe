"""One entry point that builds a Communicator from a backend name."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from comm.base import DEFAULT_TIMEOUT, Communicator
from comm.registry.base import Registry
from comm.rendezvous import DEFAULT_LIVENESS_TTL

__all__ = ["BACKENDS", "BackendName", "init_communicator", "resolve_backend"]

BackendName = Literal["gloo", "nccl", "zmq", "auto"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl", "zmq", "auto")


def resolve_backend(backend: str, *, device: str | None = None) -> str:
    """Map ``auto`` to a concrete backend: NCCL for CUDA tensors, gloo for CPU tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device.startswith("cuda") else "gloo"


def init_communicator(
    backend: str,
    *,
    rank: int,
    world_size: int,
    registry: Registry,
    prefix: str = "/cellmesh/default/comm/world",
    timeout: timedelta = DEFAULT_TIMEOUT,
    liveness_ttl: timedelta = DEFAULT_LIVENESS_TTL,
    device: str | None = None,
    **options: Any,
) -> Communicator:
    """Join a communicator of ``world_size`` ranks that meet under ``prefix`` in ``registry``.

    Every rank calls this with the same ``backend``, ``world_size`` and ``prefix``; the call
    blocks until all ranks arrived (bounded by ``timeout``).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"zmq"`` or ``"auto"`` (NCCL for CUDA, gloo for CPU).
        rank: this process's rank, 0..world_size-1.
        world_size: number of ranks.
        registry: discovery (embedded or etcd); ranks publish their addresses and a liveness
            lease there.
        prefix: a key prefix unique to this communicator (use a new one per job generation).
        timeout: default timeout of every blocking call (300 s unless given).
        liveness_ttl: how long a dead or frozen peer goes unnoticed at most.
        device: for ``auto``: the device the tensors live on.
        options: backend-specific settings, passed to the backend's constructor.

    Raises:
        ValueError: unknown backend, bad rank.
        RegistryTimeoutError: not every rank arrived within ``timeout``.
    """
    name = resolve_backend(backend, device=device)
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
