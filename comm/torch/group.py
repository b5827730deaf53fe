"""Building gloo and NCCL process groups without torch.distributed's global state.

Every communicator owns its own ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object and
never touches torch.distributed's global default group, so one process may hold several
communicators and any number of sub-groups.

Setup: rank 0 starts a ``TCPStore`` on a free port and puts its address on its
rendezvous card; the other ranks read it from :meth:`Rendezvous.gather` and connect. The
store listens on the communicator's host only (:func:`comm.sockets.default_host`: loopback
in a local run, the pod's address in a cluster): left to itself, torch's ``TCPStore``
listens on every interface, so rank 0 binds the socket itself and hands it over
(``master_listen_fd``). The
process group meets over a ``PrefixStore`` named after the communicator, so sub-groups
(made by ``TorchCommunicator.new_group``) reuse the same store under fresh names.

The backend is given the call's timeout plus :data:`BACKEND_GRACE`, so it cleans up
after itself shortly after cellmesh gave up (and cellmesh's ``CommTimeoutError`` comes
first).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceScatterOptions,
    Store,
    TCPStore,
)
from torch._C._distributed_c10d import Work as C10dWork

from comm.errors import CommError
from comm.registry.base import Registry
from comm.rendezvous import Rendezvous
from comm.sockets import default_host

__all__ = [
    "ABORT_TAG",
    "BACKEND_GRACE",
    "WORLD",
    "C10dWork",
    "Joined",
    "MakeGroup",
    "ProcessGroup",
    "build",
    "guarded",
    "join",
]

# The backend's own timeout runs this much past ours, so our CommTimeoutError comes first.
BACKEND_GRACE = timedelta(seconds=2)
# The receive that aborts a gloo process group uses this tag; user tags stay below it.
ABORT_TAG = (1 << 31) - 1
# The name of a communicator's whole-world process group in the store; sub-groups are "w/1", ...
WORLD = "w"

_T = TypeVar("_T")


class ProcessGroup(Protocol):
    """The c10d backend methods used here (torch's stub of ``Backend`` does not list them)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions, /) -> C10dWork: ...
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions, /) -> C10dWork: ...
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions, /
    ) -> C10dWork: ...
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions, /
    ) -> C10dWork: ...
    def barrier(self, opts: BarrierOptions, /) -> C10dWork: ...
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> C10dWork: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> C10dWork: ...
    def shutdown(self) -> None: ...
    def abort(self) -> None: ...


MakeGroup = Callable[[Store, int, int, timedelta, str], ProcessGroup]
"""``make(store, rank, size, timeout, host)``: a backend's process group (blocks until all connected)."""


def guarded(op: str, fn: Callable[[], _T]) -> _T:
    """Call into c10d; its RuntimeErrors become CommError naming the op."""
    try:
        return fn()
    except RuntimeError as exc:
        raise CommError(f"{op} failed: {exc}") from exc


def build(
    op: str, make: MakeGroup, store: Store, name: str, rank: int, size: int, timeout: timedelta, host: str
) -> ProcessGroup:
    """The process group ``name`` over ``store``: its members meet under that prefix of the store."""
    return guarded(op, lambda: make(PrefixStore(name, store), rank, size, timeout + BACKEND_GRACE, host))


@dataclass(frozen=True)
class Joined:
    """What :func:`join` set up: the shared store, the world's process group and the rendezvous."""

    store: Store
    pg: ProcessGroup
    rendezvous: Rendezvous
    host: str


def join(
    backend: str,
    make: MakeGroup,
    *,
    rank: int,
    world_size: int,
    registry: Registry,
    prefix: str,
    timeout: timedelta,
    liveness_ttl: timedelta,
    host: str | None,
) -> Joined:
    """Meet the other ranks under ``prefix`` and build the world's process group.

    Blocks until every rank arrived and connected (bounded by ``timeout``). On failure
    the rendezvous is left again.

    Raises:
        ValueError: bad rank, or ranks of another backend under the same prefix.
        RegistryTimeoutError: not every rank published its card within ``timeout``.
        CommError: the store or the process group could not be set up.
    """
    host = host or default_host()
    rendezvous = Rendezvous(registry, prefix, rank, world_size, liveness_ttl=liveness_ttl)
    try:
        master: TCPStore | None = None
        card: dict[str, Any] = {"backend": backend}
        if rank == 0:
            master = _serve_store(host, world_size, timeout)
            card["store"] = f"{host}:{master.port}"
        rendezvous.publish(card)
        cards = rendezvous.gather(timeout)
        for r, other in enumerate(cards):
            if other.get("backend") != backend:
                raise ValueError(
                    f"rank {r} joined {prefix!r} with backend {other.get('backend')!r}, "
                    f"this rank uses {backend!r}; every rank must use the same backend"
                )
        if master is None:
            store_host, _, port = str(cards[0]["store"]).rpartition(":")
            store: Store = _join_store(store_host, int(port), world_size, timeout)
        else:
            store = master
        pg = build("create", make, store, WORLD, rank, world_size, timeout, host)
    except BaseException:
        rendezvous.close()
        raise
    return Joined(store=store, pg=pg, rendezvous=rendezvous, host=host)


def _listen(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` alone, on a free port.

    Raises:
        CommError: ``host`` does not resolve or cannot be bound.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise CommError(f"could not listen for the rendezvous TCPStore on {host}: {exc}") from exc
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise CommError(f"could not listen for the rendezvous TCPStore on {host}: {exc}") from exc
    return sock


def _join_store(host: str, port: int, world_size: int, timeout: timedelta) -> TCPStore:
    """A client of rank 0's store at ``host:port``."""
    try:
        return TCPStore(host, port, world_size, False, timeout=timeout, wait_for_workers=False)
    except RuntimeError as exc:
        raise CommError(f"could not reach rank 0's store at {host}:{port} for the rendezvous TCPStore: "
                        f"{exc}") from exc


def _serve_store(host: str, world_size: int, timeout: timedelta) -> TCPStore:
    """Rank 0's store, listening on a free port of ``host`` alone."""
    listener = _listen(host)
    bound = int(listener.getsockname()[1])
    fd = listener.detach()  # the store owns the descriptor from here on and closes it with itself
    try:
        return TCPStore(host, bound, world_size, True, timeout=timeout, wait_for_workers=False,
                        master_listen_fd=fd)
    except RuntimeError as exc:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise CommError(f"could not start the rendezvous TCPStore on {host}:{bound}: {exc}") from exc
