"""The multi-process harness: N long-lived rank processes that run named checks on command.

Usage::

    with RankGroup(world_size=2, backend="gloo") as group:
        results = group.run("tests.multiproc.comm.checks:all_reduce_check", seed=3)
        # results[r] is what rank r's function returned (msgpack-encodable)

How it works:

* The parent hosts the registry (a :class:`~comm.registry.server.RegistryServer` on
  loopback). Each child is a ``multiprocessing`` "forkserver" process (see [Note: ranks from a
  fork server] below) that connects with
  :class:`~comm.registry.remote.RemoteRegistry`, builds its communicator with
  :func:`comm.factory.init_communicator` under a prefix unique to the group, and
  reports ready.
* A command names a function by import path (``"package.module:function"``) plus
  keyword arguments. Commands and replies travel over a ``multiprocessing.Pipe`` as
  msgpack bytes (``send_bytes``/``recv_bytes``): never pickle, never code. The child
  calls ``function(communicator, **kwargs)`` and replies with its result, or with the
  error and its traceback.
* Every wait is bounded and names the ranks that did not answer; a rank that died is
  reported with its exit code. Replies carry the command's id, so a late reply to a
  command that timed out is never taken for the next one's.
* :meth:`RankGroup.kill` sends a signal (SIGKILL, SIGSTOP, ...) for fault tests.
* Teardown (``close``, also on exceptions and at the end of the test session through
  :func:`reap_all`) asks the children to stop, then terminates, then kills each one.

Cross-process limits: arguments and results must be msgpack-encodable (maps, lists,
str, bytes, int, float, bool, None); tuples arrive as lists.

[Note: ranks from a fork server]
A fresh interpreter spends over a second of CPU importing torch before it builds a communicator, and
the conformance suite alone starts some 40 ranks. So the children come from multiprocessing's
fork server, started once per test process with the third-party libraries of :data:`PRELOAD`
imported (never a cellmesh module: several read the environment when imported, and each child
imports them afresh after its environment is in place), with the BLAS and OpenMP thread counts at 1
while they load, so the server has no thread to lose in a fork. A forked child is not the test
process's child, so it gets what ``spawn`` gave it by other means: the parent's environment at
:meth:`RankGroup.start` (then ``OMP_NUM_THREADS=1`` and the group's ``env`` over it) and torch's
intra-op threads set to 1; it watches for its parent's end by the parent's pid, not ``getppid``.
``CELLMESH_TEST_START_METHOD=spawn`` starts fresh interpreters instead (to compare, or to debug).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import itertools
import multiprocessing
import os
import signal
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

import msgpack

__all__ = ["Pending", "RankError", "RankGroup", "RankTimeout", "reap_all"]

DEFAULT_START_TIMEOUT = timedelta(seconds=90)
DEFAULT_RUN_TIMEOUT = timedelta(seconds=60)
# A child with no command for this long (its parent presumably gone) exits.
CHILD_IDLE_LIMIT_S = 900.0
START_METHOD_ENV = "CELLMESH_TEST_START_METHOD"
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy", "zmq", "msgpack", "pydantic")
"""What the fork server imports once for every rank and command (third-party only: [Note: ranks from a fork
server]). ``torch._dynamo`` because torch imports it when the first optimizer is made (2.4 s of CPU here):
every ``cellmesh run`` checks its optimizer and every worker that trains makes one."""
_QUIET_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_server_lock = threading.Lock()

_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()
_ids = itertools.count(1)


class RankError(RuntimeError):
    """A rank failed a command (its traceback is in the message) or died."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeout(RankError, TimeoutError):
    """Some ranks did not answer in time; ``ranks`` lists them."""

    def __init__(self, message: str, *, ranks: Sequence[int]) -> None:
        super().__init__(message, rank=ranks[0])
        self.ranks = list(ranks)


def _pack(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@dataclass
class Pending:
    """Commands sent to ``ranks`` that have not been collected yet."""

    command_id: int
    fn: str
    ranks: list[int]


class RankGroup:
    """``world_size`` rank processes with a communicator each, alive across many commands.

    Args:
        world_size: number of ranks.
        backend: the communicator backend every child builds (``gloo``, ``zmq``, ``nccl``).

    Keyword Args:
        timeout: the communicators' default timeout (default 60 s).
        liveness_ttl: the rendezvous lease TTL (default 10 s; fault tests use 1 s).
        start_timeout: bound on spawning the children and building the communicators.
        options: extra keyword arguments for ``init_communicator`` (msgpack-encodable).
        env: environment variables set in each child before it imports cellmesh (torch is already imported:
            see [Note: ranks from a fork server]).
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        *,
        timeout: timedelta = timedelta(seconds=60),
        liveness_ttl: timedelta = timedelta(seconds=10),
        start_timeout: timedelta = DEFAULT_START_TIMEOUT,
        options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.liveness_ttl = liveness_ttl
        self.start_timeout = start_timeout
        self.options = dict(options or {})
        self.env = dict(env or {})
        self.prefix = f"/cellmesh/test/{uuid.uuid4().hex[:12]}/comm/world"
        self.pids: list[int] = []
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._server: Any = None
        self._closed = False
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> RankGroup:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def registry_address(self) -> str:
        return str(self._server.address)

    @property
    def registry(self) -> Any:
        """The parent's in-process registry (what the children see through the server)."""
        return self._server.registry

    def start(self) -> RankGroup:
        """Start the registry server and the children; return once every rank is ready.

        Raises:
            RankError: a child failed to build its communicator (with its traceback).
            RankTimeout: naming the ranks not ready within ``start_timeout``.
        """
        from comm.registry.server import RegistryServer

        _live_groups.add(self)
        try:
            self._server = RegistryServer().start()
            ctx = _context()
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                config = _pack({
                    "rank": rank,
                    "world_size": self.world_size,
                    "backend": self.backend,
                    "registry": self._server.address,
                    "prefix": self.prefix,
                    "timeout_s": self.timeout.total_seconds(),
                    "liveness_ttl_s": self.liveness_ttl.total_seconds(),
                    "options": self.options,
                    "env": self.env,
                    "parent_env": dict(os.environ),
                    "parent_pid": os.getpid(),
                })
                proc = ctx.Process(
                    target=_child_main, args=(config, child_end), name=f"rank-{rank}", daemon=True
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
                self.pids.append(proc.pid or -1)
            self._collect(0, list(range(self.world_size)), self.start_timeout, what="start")
        except BaseException:
            self.close()
            raise
        return self

    def request_stop(self) -> None:
        """Ask every child to stop, without waiting (:meth:`close` then waits): groups closed together
        stop side by side rather than one after the other."""
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    conn.send_bytes(_pack({"id": 0, "cmd": "stop"}))

    def close(self, timeout: timedelta = timedelta(seconds=20)) -> None:
        """Stop every child (ask, then SIGTERM, then SIGKILL) and the registry server. Idempotent.

        ``timeout`` bounds the clean exits (a few hundred ms each when the machine is quiet; tests check
        the exit codes, and a machine loaded several times over has taken over 5 s to tear a communicator
        down)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.request_stop()
        deadline = time.monotonic() + timeout.total_seconds()
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            _stop_process(proc)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown(timedelta(seconds=5))
        _live_groups.discard(self)

    # -- commands -----------------------------------------------------------------------

    def submit(self, fn: str, *, ranks: Iterable[int] | None = None, **kwargs: Any) -> Pending:
        """Send ``fn(communicator, **kwargs)`` to ``ranks`` (default all) without waiting."""
        chosen = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        if self._closed:
            raise RuntimeError("RankGroup is closed")
        command_id = next(_ids)
        message = _pack({"id": command_id, "cmd": "run", "fn": fn, "kwargs": kwargs})
        for r in chosen:
            try:
                self._conns[r].send_bytes(message)
            except (OSError, ValueError) as exc:
                raise RankError(f"rank {r}: could not send {fn}: {exc}{self._exit_note(r)}", rank=r) from exc
        return Pending(command_id, fn, chosen)

    def collect(
        self,
        pending: Pending,
        *,
        ranks: Iterable[int] | None = None,
        timeout: timedelta = DEFAULT_RUN_TIMEOUT,
    ) -> list[Any]:
        """Wait (bounded) for the ranks of ``pending`` (or the subset ``ranks``, e.g. the
        survivors of a fault); return their results in rank order.

        Raises:
            RankError: naming every rank whose function raised (with tracebacks) or died.
            RankTimeout: naming the ranks that did not answer within ``timeout``.
        """
        chosen = pending.ranks if ranks is None else sorted(set(ranks))
        stray = set(chosen) - set(pending.ranks)
        if stray:
            raise ValueError(f"ranks {sorted(stray)} were not sent {pending.fn}")
        results = self._collect(pending.command_id, chosen, timeout, what=pending.fn)
        return [results[r] for r in chosen]

    def run(
        self,
        fn: str,
        *,
        ranks: Iterable[int] | None = None,
        timeout: timedelta = DEFAULT_RUN_TIMEOUT,
        **kwargs: Any,
    ) -> list[Any]:
        """:meth:`submit` then :meth:`collect`."""
        return self.collect(self.submit(fn, ranks=ranks, **kwargs), timeout=timeout)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to rank ``rank``'s process (fault injection)."""
        os.kill(self.pids[rank], sig)

    def alive(self, rank: int) -> bool:
        return self._procs[rank].is_alive()

    @property
    def exitcodes(self) -> list[int | None]:
        """Each child's exit code (None while running; 0 after a clean stop, -N if killed by N)."""
        return [proc.exitcode for proc in self._procs]

    # -- plumbing -----------------------------------------------------------------------

    def _exit_note(self, rank: int) -> str:
        proc = self._procs[rank]
        if proc.is_alive():
            return ""
        return f" (process exited with code {proc.exitcode})"

    def _collect(self, command_id: int, ranks: list[int], timeout: timedelta, *, what: str) -> dict[int, Any]:
        deadline = time.monotonic() + timeout.total_seconds()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        waiting = set(ranks)
        while waiting:
            for r in sorted(waiting):
                conn = self._conns[r]
                try:
                    ready = conn.poll(0)
                except (OSError, ValueError):
                    ready = False
                if ready:
                    try:
                        reply = _unpack(conn.recv_bytes())
                    except (EOFError, OSError) as exc:
                        self._procs[r].join(0.5)  # the pipe closes just before the exit
                        errors[r] = f"pipe closed ({exc!r}){self._exit_note(r)}"
                        waiting.discard(r)
                        continue
                    if reply.get("id") != command_id:
                        continue  # a late reply to an earlier command that timed out
                    waiting.discard(r)
                    if reply.get("ok"):
                        results[r] = reply.get("result")
                    else:
                        errors[r] = str(reply.get("error"))
                elif not self._procs[r].is_alive() and not conn.poll(0):
                    errors[r] = f"died{self._exit_note(r)}"
                    waiting.discard(r)
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankTimeout(
                    f"{what}: ranks {sorted(waiting)} did not answer within "
                    f"{timeout.total_seconds():.1f}s" + (f"; errors from others: {errors}" if errors else ""),
                    ranks=sorted(waiting),
                )
            multiprocessing.connection.wait(
                [self._conns[r] for r in waiting], timeout=min(left, 0.1)
            )
        if errors:
            first = min(errors)
            detail = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise RankError(f"{what} failed on ranks {sorted(errors)}:\n{detail}", rank=first)
        return results


def _context() -> multiprocessing.context.BaseContext:
    """The start method's context; the fork server started (once) with :data:`PRELOAD` imported, quietly."""
    method = os.environ.get(START_METHOD_ENV, "forkserver").strip() or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'forkserver' (the default) or 'spawn'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        with _server_lock:
            ctx.set_forkserver_preload(list(PRELOAD))
            saved = {name: os.environ.get(name) for name in _QUIET_THREADS}
            os.environ.update(_QUIET_THREADS)  # the server inherits them while it imports
            try:
                forkserver.ensure_running()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
    return ctx


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_process(proc: BaseProcess) -> None:
    """SIGTERM, then SIGKILL, with short bounded joins; a stopped process is continued first."""
    if proc.is_alive():
        with contextlib.suppress(Exception):
            proc.terminate()
        if proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        proc.join(2)
    if proc.is_alive():
        with contextlib.suppress(Exception):
            proc.kill()
        proc.join(2)


def reap_all() -> None:
    """Tear down every RankGroup still open and any stray multiprocessing child (session end)."""
    for group in list(_live_groups):
        with contextlib.suppress(Exception):
            group.close(timedelta(seconds=1))
    for proc in multiprocessing.active_children():
        _stop_process(proc)


# -- the child ----------------------------------------------------------------------------


def _child_main(config_bytes: bytes, conn: Connection) -> None:
    """Entry point of a rank process: build the communicator, then serve commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which tears down
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    config = _unpack(config_bytes)
    os.environ.clear()  # a forked rank has the fork server's environment: put the parent's in place
    os.environ.update(config["parent_env"])
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(config["env"])
    comm: Any = None
    registry: Any = None
    try:
        import torch

        from comm.allocator import tune_malloc

        tune_malloc()
        torch.set_num_threads(1)
        from comm.factory import init_communicator
        from comm.registry.remote import RemoteRegistry

        rank = int(config["rank"])
        if config["backend"] == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        registry = RemoteRegistry(config["registry"])
        comm = init_communicator(
            config["backend"],
            rank=rank,
            world_size=int(config["world_size"]),
            registry=registry,
            prefix=config["prefix"],
            timeout=timedelta(seconds=config["timeout_s"]),
            liveness_ttl=timedelta(seconds=config["liveness_ttl_s"]),
            **config["options"],
        )
        _reply(conn, {"id": 0, "ok": True, "result": {"pid": os.getpid()}})
    except BaseException:
        with contextlib.suppress(Exception):
            _reply(conn, {"id": 0, "ok": False, "error": traceback.format_exc()})
        return
    try:
        _serve(conn, comm, int(config["parent_pid"]))
    finally:
        with contextlib.suppress(Exception):
            comm.close()
        with contextlib.suppress(Exception):
            registry.close()


def _serve(conn: Connection, comm: Any, parent_pid: int) -> None:
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < CHILD_IDLE_LIMIT_S:
        if not conn.poll(1.0):
            if not _parent_alive(parent_pid):
                return  # orphaned
            continue
        try:
            message = _unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return
        idle_since = time.monotonic()
        command_id = message.get("id")
        if message.get("cmd") == "stop":
            return
        try:
            fn = _resolve(str(message["fn"]))
            result = fn(comm, **message.get("kwargs", {}))
            reply = {"id": command_id, "ok": True, "result": result}
            _reply(conn, reply)
        except BaseException:
            _reply(conn, {"id": command_id, "ok": False, "error": traceback.format_exc()})


def _reply(conn: Connection, reply: dict[str, Any]) -> None:
    try:
        data = _pack(reply)
    except (TypeError, ValueError) as exc:
        data = _pack({"id": reply.get("id"), "ok": False,
                      "error": f"result is not msgpack-encodable: {exc}: {reply.get('result')!r:.500}"})
    conn.send_bytes(data)


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"function path {path!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module_name), attr)
