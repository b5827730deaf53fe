"""Who may talk to a job's sockets: the job's CURVE keys, the roles they carry, and one ZAP handler.

Every job has its own keys (:class:`JobKeys`): a server key pair that every serving socket
of the job presents (a worker's service host, the embedded registry, a data channel), and
a client key pair per role — one for the coordinator, one shared by the job's workers. A
socket that connects presents its role's key pair and names the server's public key.
ZeroMQ encrypts and authenticates the connection; *who* may connect is decided by the one
:class:`ZapHandler` of the process's context, which answers ZeroMQ's authentication
requests (ZAP, ZeroMQ RFC 27):

* a client key the job knows is admitted, and its role (``"coordinator"`` or
  ``"worker"``) becomes the connection's ``User-Id`` — every message received on it
  carries the role (``frame.get("User-Id")``), so a server checks the role against the
  method called, per message, without trusting anything the peer says;
* any other key, or a mechanism other than CURVE, is refused during the handshake: the
  peer is never served and never gets a reply. Each refusal is counted per peer address
  and reason (:attr:`ZapHandler.rejections`) and logged once per peer and reason per
  :data:`WARN_INTERVAL`, so garbage never floods a terminal.

Why a handler of our own rather than pyzmq's ``zmq.auth`` authenticators: a CURVE server
without any ZAP handler admits *every* client key, so the handler must be running on the
context before the first server socket binds (:func:`ensure_zap_handler` does that once
per context); and the two things this layer needs — the role of a key as the connection's
user id, and refusals counted and rate-limited per peer — are the handler's whole job
(pyzmq's base authenticator logs every denial at debug level and does not pass the peer's
address to a key callback). The ZAP wire protocol it speaks is small and stable.

A process is one role of one job: it installs its :class:`Credentials` once at start
(:func:`install`), and :func:`comm.sockets.make_socket` makes every server or client socket
speak CURVE from then on. The one exception is a process that runs local jobs one after
another (a test session, a notebook: ``coordinator/runtime/harness.py``), whose embedded registry
of an earlier job may still serve that job's workers while a later job runs: its ZAP handler
admits the keys of every job the process serves (:func:`ensure_zap_handler` adds a job's keys,
:func:`release_keys` removes them when the job's harness closes), each key with its own job's
role, so a job's workers are never refused by its own registry because another job started.

[Note: the data plane's two modes]
The tensor stream between workers (the zmq backend's data channels) follows
``CELLMESH_DATA_PLANE`` (:func:`data_plane`, read when the credentials are made; every
process of a job must say the same):

* ``encrypted`` (the default): CURVE like every other socket — the peer is authenticated
  by its key, and every byte is encrypted and authenticated (a change is detected);
* ``authenticated``: ZeroMQ's PLAIN mechanism (ZeroMQ has no MAC-only one) with the job's
  *data-plane token*, an HMAC of the workers' secret key (:func:`data_token`; every holder
  of the job's worker keys can make it, nobody else). The ZAP handler admits a data
  connection whose token is the job's, on the data channels' ZAP domain only (never a
  control socket). What it authenticates: that the process which opened the TCP
  connection knew the token at that moment. What it does not: the bytes are not
  encrypted (an on-path observer reads the tensors), not integrity-protected (an on-path
  attacker can alter or inject them inside an open connection), and the token itself
  crosses the network in clear at every connection, so an on-path observer learns it
  and can then open data connections to the job's workers (never its control plane:
  that stays CURVE). For networks where the path between nodes is trusted and only
  off-path reachability is the threat; it recovers the throughput CURVE costs between
  hosts (docs/benchmarks.md). Same-host bodies go through shared memory either way.

Keys on disk: :meth:`JobKeys.save` writes ``keys.json`` in a directory made ``0700``, the
file ``0600`` (the coordinator's secret is absent from a worker's copy,
:meth:`JobKeys.for_workers`). In a cluster the same files come from a Kubernetes
Secret mounted read-only; they never go into a ConfigMap or a repository.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq
from pydantic import BaseModel, ConfigDict, Field, field_validator
from zmq.utils import z85

from comm import refusals
from comm.wake import WakePipe

__all__ = [
    "DATA_PLANE_ENV",
    "DATA_ZAP_DOMAIN",
    "KEYS_DIR_ENV",
    "KEYS_FILE",
    "ROLES",
    "WARN_INTERVAL",
    "ZAP_DOMAIN",
    "Credentials",
    "DataPlane",
    "JobKeys",
    "KeyPair",
    "Role",
    "ZapHandler",
    "authenticates",
    "credentials_for",
    "data_plane",
    "data_token",
    "ensure_zap_handler",
    "install",
    "installed",
    "is_curve_server",
    "load_credentials",
    "release_keys",
    "secure_client",
    "secure_data_client",
    "secure_data_server",
    "secure_server",
]

log = logging.getLogger(__name__)

Role = Literal["coordinator", "worker"]
ROLES: tuple[Role, ...] = ("coordinator", "worker")
KEYS_FILE = "keys.json"
KEYS_DIR_ENV = "CELLMESH_KEYS_DIR"
"""Where a process finds the job's key files (a local run's run directory, a pod's Secret mount)."""
ZAP_DOMAIN = "cellmesh"
DATA_ZAP_DOMAIN = "cellmesh-data"
"""The data channels' ZAP domain when the data plane is ``authenticated`` (PLAIN is admitted there only)."""
DATA_PLANE_ENV = "CELLMESH_DATA_PLANE"
DataPlane = Literal["encrypted", "authenticated"]
DATA_PLANES: tuple[DataPlane, ...] = ("encrypted", "authenticated")
WARN_INTERVAL = 60.0
"""Seconds between two warnings for the same peer and reason; the refusals in between are counted."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ: where libzmq sends a context's ZAP requests
_ZAP_VERSION = b"1.0"
_POLL_MS = 60_000  # the longest poll: stop() wakes the handler through its pipe at once


def _z85_key(value: str) -> str:
    if len(value) != 40:
        raise ValueError(f"a CURVE key is 40 Z85 characters, got {len(value)}")
    try:
        z85.decode(value.encode())
    except (ValueError, KeyError) as exc:
        raise ValueError(f"not a Z85 key: {exc}") from None
    return value


class KeyPair(BaseModel):
    """One CURVE key pair in Z85 text; ``secret`` is None where only the public half is known."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    public: str = Field(repr=False)
    secret: str | None = Field(default=None, repr=False)

    @field_validator("public")
    @classmethod
    def _check_public(cls, v: str) -> str:
        return _z85_key(v)

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, v: str | None) -> str | None:
        return None if v is None else _z85_key(v)

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public=public.decode(), secret=secret.decode())

    def require_secret(self, role: str) -> bytes:
        if self.secret is None:
            raise PermissionError(f"this process holds no secret key for the {role} role; "
                                  "it cannot act as one")
        return self.secret.encode()


class JobKeys(BaseModel):
    """The keys of one job (see the module docstring).

    ``server`` is the key pair every serving socket of the job presents (its public half
    is what a client must know to connect; knowing it admits nobody); ``coordinator`` and
    ``worker`` are the client key pairs whose public halves the ZAP handler admits, each
    as its role.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    server: KeyPair
    coordinator: KeyPair
    worker: KeyPair

    @classmethod
    def generate(cls) -> JobKeys:
        return cls(server=KeyPair.generate(), coordinator=KeyPair.generate(), worker=KeyPair.generate())

    def pair(self, role: Role) -> KeyPair:
        return self.coordinator if role == "coordinator" else self.worker

    def role_of(self, public_key: bytes) -> Role | None:
        """The role whose public key is ``public_key`` (32 raw bytes or 40 Z85 characters)."""
        text = z85.encode(public_key).decode() if len(public_key) == 32 else public_key.decode()
        for role in ROLES:
            if self.pair(role).public == text:
                return role
        return None

    def for_workers(self) -> JobKeys:
        """What a worker holds: the server pair, the workers' pair, the coordinator's public key."""
        return JobKeys(server=self.server, coordinator=KeyPair(public=self.coordinator.public),
                       worker=self.worker)

    def save(self, directory: Path) -> Path:
        """Write the keys as ``directory/keys.json`` (directory 0700, file 0600); return the file."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / KEYS_FILE
        tmp = directory / f"{KEYS_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.model_dump_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: Path) -> JobKeys:
        """Read ``directory/keys.json``; refuse a file that others may read."""
        path = directory / KEYS_FILE
        try:
            mode = path.stat().st_mode
            text = path.read_text()
        except OSError as exc:
            raise FileNotFoundError(f"the job's keys: cannot read {path} ({exc.strerror}); a local run "
                                    "writes them in its run directory, a pod mounts them from the job's "
                                    "Secret") from None
        if mode & 0o077:
            raise PermissionError(f"the job's keys {path} are readable by others (mode {mode & 0o777:o}); "
                                  f"chmod 600 it")
        return cls.model_validate_json(text)


def data_plane(environ: dict[str, str] | None = None) -> DataPlane:
    """``CELLMESH_DATA_PLANE``: ``encrypted`` (default) or ``authenticated``.

    See [Note: the data plane's two modes].

    Raises:
        ValueError: Another value (naming the accepted ones).
    """
    text = (os.environ if environ is None else environ).get(DATA_PLANE_ENV, "").strip() or "encrypted"
    for mode in DATA_PLANES:
        if text == mode:
            return mode
    raise ValueError(f"{DATA_PLANE_ENV}={text!r}: use {' or '.join(DATA_PLANES)} (see docs/security.md)")


def data_token(keys: JobKeys) -> bytes:
    """The job's data-plane token: an HMAC-SHA256 of the workers' secret key (hex, 64 bytes)."""
    secret = z85.decode(keys.worker.require_secret("worker"))
    return hmac.new(secret, b"cellmesh data plane v1", hashlib.sha256).hexdigest().encode()


@dataclass(frozen=True)
class Credentials:
    """What this process holds and acts as: the job's keys (as far as it knows them), its role, and
    its data plane's mode (default: ``CELLMESH_DATA_PLANE``, :func:`data_plane`)."""

    keys: JobKeys
    role: Role
    data_plane: DataPlane = field(default_factory=data_plane)

    def __post_init__(self) -> None:
        self.keys.pair(self.role).require_secret(self.role)
        self.keys.server.require_secret("server")


_installed: Credentials | None = None


def install(credentials: Credentials | None) -> None:
    """Make every socket this process creates from now on speak CURVE as ``credentials`` say.

    A process is one role of one job, so this is set once, at start, before any socket is
    made (:mod:`comm.sockets` reads it); None turns security off (tests of single parts).
    """
    global _installed
    _installed = credentials


def installed() -> Credentials | None:
    """The credentials this process speaks with, or None when its sockets do not authenticate."""
    return _installed


def load_credentials(directory: Path, role: Role) -> Credentials:
    """The credentials in ``directory`` (see :meth:`JobKeys.load`) for ``role``."""
    return Credentials(JobKeys.load(directory), role)


def credentials_for(role: Role, directory: str | None, *, insecure: bool = False) -> Credentials | None:
    """What an entry point (``cellmesh worker``, ``cellmesh coordinator``) speaks with.

    ``directory`` (else ``$CELLMESH_KEYS_DIR``) holds the job's keys; with neither, a process
    starts only when told ``insecure`` (then nothing it serves is authenticated).

    Raises:
        ValueError: no keys and not ``insecure``, naming both ways out.
        FileNotFoundError, PermissionError: the keys cannot be read, or others may read them.
    """
    directory = directory or os.environ.get(KEYS_DIR_ENV) or None
    if directory is not None:
        return load_credentials(Path(directory), role)
    if insecure:
        log.warning("running as a %s WITHOUT authentication (--insecure): anyone who reaches this "
                    "process's ports is served", role)
        return None
    raise ValueError(f"no job keys for this {role}: give --keys-dir DIR or set {KEYS_DIR_ENV} (a local run "
                     "makes them, a cluster mounts them from the job's Secret), or pass --insecure to run "
                     "without authentication on a trusted network")


@dataclass
class ZapHandler:
    """Answers the ZAP requests of one ZeroMQ context with the job's keys (see module docstring).

    ``keys`` may be replaced at any time (:meth:`set_keys`): a revoked key is refused from
    the next handshake on. Start it before any server socket of the context binds. ``others``
    are the keys of the other jobs this process serves (see the module docstring), admitted too.
    """

    context: zmq.Context[zmq.Socket[bytes]]
    keys: JobKeys | None = None
    others: list[JobKeys] = field(default_factory=list)
    rejections: Counter[tuple[str, str]] = field(default_factory=Counter)
    admitted: Counter[str] = field(default_factory=Counter)
    _warned: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _wake: WakePipe | None = None  # stop() wakes it: the handler sleeps until a request or stop

    def start(self, timeout: float = 5.0) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []
        self._wake = WakePipe()  # [Note: a wake pipe] in comm/wake.py
        self._thread = threading.Thread(target=self._serve, args=(ready, failure), name="cellmesh-zap",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the ZAP handler did not bind {_ZAP_ENDPOINT} within {timeout} s")
        if failure:
            raise RuntimeError(f"the ZAP handler could not start: {failure[0]}") from failure[0]

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._wake is not None:
            self._wake.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self._wake is not None:
                self._wake.close()  # else it closes when the handler is collected
                self._wake = None

    def set_keys(self, keys: JobKeys | None) -> None:
        """Admit ``keys`` only (a new generation: every other key is refused from now on)."""
        with self._lock:
            self.keys = keys
            self.others = []

    def add_keys(self, keys: JobKeys) -> None:
        """Admit ``keys`` too (another job of this process); the newest added are the current ``keys``."""
        with self._lock:
            if self.keys is not None and self.keys != keys and self.keys not in self.others:
                self.others.append(self.keys)
            if keys in self.others:
                self.others.remove(keys)
            self.keys = keys

    def remove_keys(self, keys: JobKeys) -> None:
        """Stop admitting ``keys`` (their job ended); the latest other job's become the current ones."""
        with self._lock:
            if keys in self.others:
                self.others.remove(keys)
            elif self.keys == keys:
                self.keys = self.others.pop() if self.others else None

    def _all_keys(self) -> list[JobKeys]:
        with self._lock:
            return [k for k in (self.keys, *self.others) if k is not None]

    def rejected(self) -> int:
        with self._lock:
            return sum(self.rejections.values())

    def _serve(self, ready: threading.Event, failure: list[BaseException]) -> None:
        try:
            sock = self.context.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            failure.append(exc)
            ready.set()
            return
        ready.set()
        assert self._wake is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(_POLL_MS)).get(sock):
                    continue
                request = sock.recv_multipart()
                sock.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request: ``[version, id, status, text, user id, metadata]``."""
        if len(request) < 6:
            return [_ZAP_VERSION, b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        peer = address.decode("utf-8", "replace") or "?"
        if version != _ZAP_VERSION:
            return [_ZAP_VERSION, request_id, b"500", b"unsupported ZAP version", b"", b""]
        every = self._all_keys()
        role: Role | Literal["data"] | None = None
        if mechanism == b"PLAIN" and domain == DATA_ZAP_DOMAIN.encode():
            role, reason = None, "no job keys loaded yet"
            for keys in every:
                role, reason = self._data_member(keys, request)
                if role is not None:
                    break
        elif mechanism != b"CURVE":
            reason = f"mechanism {mechanism.decode('ascii', 'replace')} (the job speaks CURVE only)"
        elif len(request) < 7 or len(request[6]) != 32:
            reason = "malformed CURVE credentials"
        elif not every:
            reason = "no job keys loaded yet"
        else:
            role = next((r for keys in every if (r := keys.role_of(request[6])) is not None), None)
            reason = "a key that is not the job's"
        if role is None:
            self._refuse(peer, reason)
            return [_ZAP_VERSION, request_id, b"400", b"not admitted", b"", b""]
        with self._lock:
            self.admitted[role] += 1
        return [_ZAP_VERSION, request_id, b"200", b"OK", role.encode(), b""]

    @staticmethod
    def _data_member(keys: JobKeys | None, request: list[bytes]) -> tuple[Literal["data"] | None, str]:
        """A PLAIN data connection: admitted as ``data`` (a member of the job, role unknown) by the token."""
        if keys is None:
            return None, "no job keys loaded yet"
        if len(request) < 8:
            return None, "malformed PLAIN credentials"
        if keys.worker.secret is None or not hmac.compare_digest(request[7], data_token(keys)):
            return None, "a data-plane token that is not the job's"
        return "data", ""

    def _refuse(self, peer: str, reason: str) -> None:
        refusals.REFUSALS.count("connection", reason)  # the process's count, for /metrics
        now = time.monotonic()
        with self._lock:
            self.rejections[(peer, reason)] += 1
            last = self._warned.get((peer, reason))
            if last is not None and now - last < WARN_INTERVAL:
                return
            self._warned[(peer, reason)] = now
            count = self.rejections[(peer, reason)]
        log.warning("refused a connection from %s: %s (%d so far; next warning for it in %.0f s at the "
                    "earliest)", peer, reason, count, WARN_INTERVAL)


_handlers: dict[int, ZapHandler] = {}
_handlers_lock = threading.Lock()


def ensure_zap_handler(context: zmq.Context[zmq.Socket[bytes]], keys: JobKeys) -> ZapHandler:
    """The context's ZAP handler, started on first use, admitting ``keys`` (and the process's other jobs')."""
    with _handlers_lock:
        handler = _handlers.get(id(context))
        if handler is None or handler.context is not context or handler.context.closed:
            handler = ZapHandler(context, keys)
            handler.start()
            _handlers[id(context)] = handler
        else:
            handler.add_keys(keys)
        return handler


def release_keys(keys: JobKeys) -> None:
    """No ZAP handler of this process admits ``keys`` any more (their job ended: see the module docstring)."""
    with _handlers_lock:
        for handler in _handlers.values():
            handler.remove_keys(keys)


def secure_server(sock: zmq.Socket[bytes], credentials: Credentials) -> None:
    """Make ``sock`` (not yet bound) a CURVE server of the job whose clients the ZAP handler admits."""
    ensure_zap_handler(sock.context, credentials.keys)  # before bind: without a handler CURVE admits anyone
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, credentials.keys.server.require_secret("server"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, credentials.keys.server.public.encode())


def secure_client(sock: zmq.Socket[bytes], credentials: Credentials) -> None:
    """Make ``sock`` (not yet connected) a CURVE client presenting ``credentials.role``'s key pair."""
    pair = credentials.keys.pair(credentials.role)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.require_secret(credentials.role))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public.encode())
    sock.setsockopt(zmq.CURVE_SERVERKEY, credentials.keys.server.public.encode())


def secure_data_server(sock: zmq.Socket[bytes], credentials: Credentials) -> None:
    """A data channel's serving socket: CURVE, or PLAIN on :data:`DATA_ZAP_DOMAIN` ([Note: the data plane's
    two modes])."""
    if credentials.data_plane == "encrypted":
        secure_server(sock, credentials)
        return
    ensure_zap_handler(sock.context, credentials.keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, DATA_ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.PLAIN_SERVER, 1)


def secure_data_client(sock: zmq.Socket[bytes], credentials: Credentials) -> None:
    """A data channel's connecting socket, in the mode of the server's (the job's) data plane."""
    if credentials.data_plane == "encrypted":
        secure_client(sock, credentials)
        return
    sock.setsockopt(zmq.PLAIN_USERNAME, credentials.role.encode())
    sock.setsockopt(zmq.PLAIN_PASSWORD, data_token(credentials.keys))


def is_curve_server(sock: zmq.Socket[bytes]) -> bool:
    return bool(sock.getsockopt(zmq.CURVE_SERVER))


def authenticates(sock: zmq.Socket[bytes]) -> bool:
    """Whether ``sock`` admits only the job's peers (a CURVE server, or a PLAIN data server of the job)."""
    return is_curve_server(sock) or bool(sock.getsockopt(zmq.PLAIN_SERVER))
