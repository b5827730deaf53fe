"""The one place cellmesh creates ZeroMQ sockets, so every socket gets the same limits.

Every socket made here has:

* a bounded LINGER (default 1 s): closing a socket with messages queued for a dead
  peer never hangs (ZeroMQ's own default is to wait forever);
* a maximum inbound message size (``MAXMSGSIZE``): a peer that sends a larger frame
  is disconnected by libzmq before the frame is buffered;
* high-water marks (see below);
* ZMTP heartbeats on connection-oriented sockets, so a silent TCP connection is
  noticed and dropped (a frozen peer is still only *reported* by the caller's timeout
  or the liveness lease);
* the job's authentication, once the process installed its credentials
  (:func:`comm.auth.install`): a socket made with ``curve="server"`` is a CURVE server whose
  clients the one ZAP handler admits, one made with ``curve="client"`` presents the
  process's role key. A data channel's socket (``plane="data"``) follows the job's data-plane
  mode instead (CURVE, or PLAIN with the job's token: [Note: the data plane's two modes] in
  ``comm/auth.py``). :func:`bind_port` refuses to bind a TCP socket that does not
  authenticate while credentials are installed, so no socket serves outsiders by omission.

High-water-mark policy (messages, per peer connection):

* data sockets (tensor chunks, at most ``CHUNK_BYTES`` each): ``DATA_HWM``; a sender that
  reaches it waits, bounded by the operation's timeout, so a slow receiver applies
  back-pressure and a dead one produces a timeout, never unbounded memory;
* control sockets (small msgpack messages): ``CONTROL_HWM``; the same waiting rule.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import socket
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import zmq

from comm import auth

__all__ = [
    "CHUNK_BYTES",
    "CONTROL_HWM",
    "CONTROL_MAX_MESSAGE",
    "DATA_HWM",
    "DATA_MAX_MESSAGE",
    "Curve",
    "Plane",
    "SocketLimits",
    "bind_port",
    "default_host",
    "free_port",
    "ipc_endpoint",
    "make_socket",
    "shared_context",
]

HOST_ENV = "CELLMESH_HOST"
LOOPBACK = "127.0.0.1"

# Tensors travel in frames of at most 4 MiB: libzmq allocates one receive buffer per frame, so
# one frame per 64 MiB tensor is slow (fresh pages every time), while with the allocator kept
# from trimming (comm.allocator) 4 MiB frames beat 1 MiB ones at 64 MiB (docs/benchmarks.md).
CHUNK_BYTES = 4 << 20
DATA_MAX_MESSAGE = 4 * CHUNK_BYTES
CONTROL_MAX_MESSAGE = 4 * CHUNK_BYTES
DATA_HWM = 256  # <= 1 GiB of chunks in flight per connection
CONTROL_HWM = 10_000

Curve = Literal["server", "client"]
"""The side a socket takes in the job's CURVE authentication (see :func:`make_socket`)."""
Plane = Literal["control", "data"]
"""What a socket carries: control messages (always CURVE) or tensors (the data-plane mode)."""

_context: zmq.Context[zmq.Socket[bytes]] | None = None
MAX_SOCKETS = 1 << 16  # the most a context is given (libzmq's default: 1,023)


def _socket_budget() -> int:
    """How many sockets the process's context may hold: libzmq's default is 1,023, which a coordinator of
    about a thousand workers (one socket each, and its registry's) runs out of. Each socket needs at
    least one descriptor, so the budget is the descriptor limit, raised to its hard limit first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, MAX_SOCKETS)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, MAX_SOCKETS), hard))
            soft = min(wanted, MAX_SOCKETS)
    return max(1023, min(MAX_SOCKETS, soft if soft != resource.RLIM_INFINITY else MAX_SOCKETS))


def shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process-wide ZeroMQ context (two I/O threads: one per core here), with room for as many
    sockets as the process has descriptors (:func:`_socket_budget`)."""
    global _context
    if _context is None or _context.closed:
        _context = zmq.Context(io_threads=2)
        _context.set(zmq.MAX_SOCKETS, _socket_budget())
    return _context


@dataclass(frozen=True, slots=True)
class SocketLimits:
    linger: timedelta = timedelta(seconds=1)
    max_message: int = CONTROL_MAX_MESSAGE
    hwm: int = CONTROL_HWM
    heartbeat_ivl: timedelta | None = timedelta(seconds=1)
    heartbeat_timeout: timedelta = timedelta(seconds=3)

    @classmethod
    def data(cls) -> SocketLimits:
        return cls(max_message=DATA_MAX_MESSAGE, hwm=DATA_HWM)

    @classmethod
    def control(cls) -> SocketLimits:
        return cls()


def make_socket(
    kind: int,
    limits: SocketLimits | None = None,
    *,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    identity: bytes | None = None,
    curve: Curve | None = None,
    plane: Plane = "control",
) -> zmq.Socket[bytes]:
    """Create a ZeroMQ socket of ``kind`` (``zmq.PUSH``, ``zmq.ROUTER``, ...) with cellmesh's limits.

    ``curve`` names the socket's side when it talks over TCP or IPC to other processes:
    ``"server"`` for one that binds and serves, ``"client"`` for one that connects. With
    credentials installed (:func:`comm.auth.installed`) it then speaks the job's CURVE;
    without, it is a plain socket. In-process sockets (``inproc://``) leave it None.
    ``plane="data"`` marks a data channel's socket, which speaks the job's data-plane mode
    (``CELLMESH_DATA_PLANE``: CURVE by default, or PLAIN with the job's token).
    """
    limits = limits or SocketLimits.control()
    sock = (context or shared_context()).socket(kind)
    sock.setsockopt(zmq.LINGER, int(limits.linger.total_seconds() * 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message)
    sock.setsockopt(zmq.SNDHWM, limits.hwm)
    sock.setsockopt(zmq.RCVHWM, limits.hwm)
    if limits.heartbeat_ivl is not None:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(limits.heartbeat_ivl.total_seconds() * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(limits.heartbeat_timeout.total_seconds() * 1000))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    credentials = auth.installed()
    if credentials is not None and curve == "server":
        (auth.secure_data_server if plane == "data" else auth.secure_server)(sock, credentials)
    elif credentials is not None and curve == "client":
        (auth.secure_data_client if plane == "data" else auth.secure_client)(sock, credentials)
    return sock


def default_host() -> str:
    """The address this process binds and advertises: ``$CELLMESH_HOST``, else loopback.

    Every server socket of cellmesh (service hosts, data channels, rendezvous stores)
    binds this address unless told otherwise, and peers reach it at the same address. A
    pod sets it to its own IP (the downward API's ``status.podIP``); local runs keep
    ``127.0.0.1``, so nothing is reachable from outside the machine.
    """
    return os.environ.get(HOST_ENV, "").strip() or LOOPBACK


def bind_port(sock: zmq.Socket[bytes], host: str | None = None, port: int = 0) -> str:
    """Bind ``sock`` to ``port`` on ``host`` (0: a free one; ``host`` defaults to
    :func:`default_host`); return the ``tcp://host:port`` address peers connect to."""
    host = host or default_host()
    if auth.installed() is not None and not auth.authenticates(sock):
        raise RuntimeError(f"refusing to bind tcp://{host}:{port or '*'} without authentication: the "
                           "socket was not made with make_socket(..., curve='server') while the job's "
                           "credentials are installed")
    sock.bind(f"tcp://{host}:{port or '*'}")  # '*' lets the OS pick a free port, as port 0 does
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


_ABSTRACT_IPC = platform.system() == "Linux"  # Linux's abstract namespace for Unix sockets


def ipc_endpoint(name: str) -> tuple[str, str | None]:
    """A fresh Unix-socket endpoint for ``name`` (a short label) to bind: ``(endpoint, file)``.

    On Linux it is in the abstract namespace (``ipc://@...``): no file, so nothing is left behind when the
    process is killed (file sockets in the temporary directory piled up by the thousand under fault tests),
    and any process of the host's network namespace reaches it, as it reaches the loopback TCP port the
    same socket binds (the socket's CURVE or PLAIN mechanism is what admits a peer). Elsewhere it is a file
    in the temporary directory, to unlink once closed (``file``; None for the abstract namespace).
    """
    unique = f"cm-{name}-{os.getpid()}-{uuid.uuid4().hex[:16]}"
    if _ABSTRACT_IPC:
        return f"ipc://@{unique}", None
    path = os.path.join(tempfile.gettempdir(), f"{unique}.sock")
    return f"ipc://{path}", path


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (for servers that cannot bind port 0 themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
