"""Starting local worker processes from a fork server that already imported torch.

[Note: the fork server]
A worker process spends about 2 s of CPU importing torch, numpy, zmq and pydantic before it runs a
line of cellmesh, and a local run starts one per worker, again for every replacement after a fault.
On a machine with fewer cores than workers those imports queue. A :class:`ForkServer` is one
process (``python -m coordinator.runtime.forkserver``) that imports those libraries once and then
forks a child per request, as multiprocessing's ``forkserver`` start method does:

* Only third-party libraries are preloaded (:data:`PRELOAD`), never a cellmesh module: several
  read the environment when imported (fault injection, the shared-memory threshold), so each child
  imports cellmesh afresh, after its own environment is in place. That costs about 0.3 s.
  It includes what every worker loads before its first assignment anyway (``services/host/worker.py``:
  ``torch.distributed.checkpoint`` and ``torch._dynamo``, which any optimizer's constructor imports),
  another 1-2 s of CPU per worker.
* The server stays single-threaded (its libraries start no thread on import, with the BLAS and
  OpenMP thread counts at 1 while they load); a child sets torch's intra-op threads from its own
  ``OMP_NUM_THREADS``, since OpenMP read the variable when it loaded.
* A child is what ``subprocess.Popen(..., start_new_session=True)`` would start: a session of its
  own, stdin from ``/dev/null``, stdout and stderr appended to its log file, the given environment
  and working directory, ``sys.path`` led by ``PYTHONPATH``'s entries. It runs ``module:function``
  with its arguments (the worker's ``run``, which leaves through ``os._exit``).
* The server reaps its children and reports each exit code; :class:`ForkedProcess` turns them
  into the parts of ``Popen`` the harness uses (``pid``, ``poll``, ``wait``, ``send_signal``,
  ``kill``, ``returncode``: negative for a signal, as ``Popen`` has it).
* The protocol is JSON lines on the server's stdin and stdout (a pipe only this process holds):
  requests ``{"target", "argv", "env", "cwd", "log"}``, replies ``{"spawned": pid}`` or
  ``{"error": text}``, and ``{"exited": pid, "code": n}`` whenever a child ends. The server exits
  when its stdin closes; its children live on in their own sessions, as ``Popen``'s would.

``cellmesh run`` starts the server (:func:`prestart`) as soon as its job spec has loaded, without waiting:
the server's imports run on another core while the run checks its optimizer (which imports
``torch._dynamo``), profiles and plans, so the workers come up about 2 s sooner on this repository's
tiny jobs (9.8 s from the command to the end, from 11.7). A server closed before it forked a child is
killed at once.

A process that has those libraries loaded already, runs one thread and has imported nothing of
cellmesh (the test harness forks each ``cellmesh`` command from such a process) can make its server a
fork of itself instead (:func:`fork_here`): ready at once, without the imports again.

``CELLMESH_FORK_SERVER=0`` turns it off (each worker is then a fresh interpreter). If the server
cannot start or dies, workers are started the plain way, with one warning.

This module imports nothing of cellmesh at module level: the server runs it as ``__main__``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

__all__ = ["ENABLE_ENV", "PRELOAD", "ForkServer", "ForkedProcess", "enabled", "fork_here", "prestart",
           "shared"]

log = logging.getLogger(__name__)

ENABLE_ENV = "CELLMESH_FORK_SERVER"
PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed", "torch.distributed.checkpoint",
           "torch._dynamo", "torch.utils.checkpoint", "numpy", "zmq", "msgpack", "pydantic", "yaml")
"""What the server imports once for every child (third-party only; see the note). It holds
``services.host.worker.RUNTIME_MODULES``, what every worker loads at start, spelled out here because the
server imports no cellmesh module (``tests/unit/coordinator/runtime/test_forkserver_preload.py`` keeps
the two in step)."""
_QUIET_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
START_TIMEOUT_S = 60.0  # the server's imports, on a loaded machine
SPAWN_TIMEOUT_S = 10.0  # one fork and its reply


def enabled() -> bool:
    """Whether local workers are forked from the server (``CELLMESH_FORK_SERVER``, default on)."""
    return os.environ.get(ENABLE_ENV, "1").strip() != "0"


# -- the client side (the coordinator's process) --------------------------------------------


class ForkedProcess:
    """A child of the fork server, with the parts of ``subprocess.Popen`` a harness uses."""

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server._codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the process ended.

        Raises:
            subprocess.TimeoutExpired: It still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server._exited:
            while self.pid not in self._server._codes:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                self._server._exited.wait(left)
            return self._server._codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # an ended child's pid may belong to another process by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The fork server's process, and the requests to it (thread-safe)."""

    def __init__(self, *, start_timeout: float = START_TIMEOUT_S, wait: bool = True,
                 process: _ServerProcess | None = None) -> None:
        """Start the server as a fresh interpreter, or take ``process`` (:func:`fork_here`'s)."""
        if process is None:
            root = _package_root()
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
            env = {**os.environ, **_QUIET_THREADS, "PYTHONPATH": path}
            process = subprocess.Popen(
                [sys.executable, "-m", "coordinator.runtime.forkserver"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._proc = process
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._requests = threading.Lock()
        self._exited = threading.Condition()
        self._codes: dict[int, int] = {}
        self._pids: set[int] = set()
        self._replies: list[dict[str, Any]] = []
        self._reply = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                                        name="cellmesh-forkserver")
        self._reader.start()
        self._ready = False
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the server finished its imports (at once when it has).

        Raises:
            RuntimeError: The server exited first.
            TimeoutError: It is still importing after ``timeout`` seconds.
        """
        if self._ready:
            return
        reply = self._next_reply(timeout, "its imports")
        if "ready" not in reply:
            raise RuntimeError(f"the fork server did not start: {reply}")
        self._ready = True

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            message = json.loads(line)
            if "exited" in message:
                with self._exited:
                    self._codes[int(message["exited"])] = int(message["code"])
                    self._exited.notify_all()
                continue
            if "spawned" in message:  # a new child may reuse an old one's pid: forget the old code
                with self._exited:
                    self._codes.pop(int(message["spawned"]), None)
            with self._reply:
                self._replies.append(message)
                self._reply.notify_all()
        with self._reply:  # the server is gone: no more replies, and no more exit codes
            self._replies.append({"error": "the fork server exited"})
            self._closed = True
            self._reply.notify_all()
        threading.Thread(target=self._watch_orphans, daemon=True, name="cellmesh-forkserver-orphans").start()

    def _watch_orphans(self) -> None:
        """After the server died, learn that its children ended (their codes are lost: 1)."""
        while True:
            with self._exited:
                running = [pid for pid in self._pids if pid not in self._codes]
                for pid in running:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        self._codes[pid] = 1
                        self._exited.notify_all()
            if not running:
                return
            time.sleep(0.1)

    def _next_reply(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._reply:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the fork server (pid {self._proc.pid}) did not answer within "
                                       f"{timeout:.0f}s waiting for {what}")
                self._reply.wait(left)
            return self._replies.pop(0)

    def spawn(self, target: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: str,
              cwd: str | None = None, timeout: float = SPAWN_TIMEOUT_S) -> ForkedProcess:
        """Fork a child that runs ``target`` (``"module:function"``, called with ``argv``).

        Raises:
            RuntimeError: The server refused or is gone (the caller may start the process itself).
            TimeoutError: No reply within ``timeout``.
        """
        request = {"target": target, "argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(),
                   "log": log_path}
        with self._requests:
            if not self.alive:
                raise RuntimeError("the fork server is not running")
            self.wait_ready()
            try:
                self._stdin.write(json.dumps(request).encode() + b"\n")
                self._stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise RuntimeError(f"the fork server is gone: {exc}") from exc
            reply = self._next_reply(timeout, f"forking {target}")
        if "spawned" not in reply:
            raise RuntimeError(f"the fork server could not start {target}: {reply.get('error')}")
        pid = int(reply["spawned"])
        self._pids.add(pid)
        return ForkedProcess(self, pid, [target, *argv])

    def close(self) -> None:
        """Stop the server (its children live on). Idempotent."""
        if self._proc.poll() is None and not self._pids:  # never forked (maybe still importing): no wait
            self._proc.kill()
            self._proc.wait(5)
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._stdin.close()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)


_shared: ForkServer | None = None
_shared_lock = threading.Lock()
_failed = False


class _ServerProcess(Protocol):
    """What :class:`ForkServer` uses of its server's process (``subprocess.Popen``'s, :class:`_Forked`'s)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Forked:
    """A server forked from this process (:func:`fork_here`): ``Popen``'s ``pid``, ``stdin``, ``stdout``,
    ``poll``, ``wait`` and ``kill``."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: ended, its code lost
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


_replaced: list[object] = []  # streams whose descriptors were closed: kept, never collected (nor closed)


def _streams_on_their_descriptors() -> None:
    """``sys.stdin``/``stdout``/``stderr`` on descriptors 0, 1 and 2, as in a fresh interpreter (a
    multiprocessing child's stdin is ``/dev/null`` on another descriptor, which the fork closed)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        stream = getattr(sys, name)
        try:
            ours = stream is not None and stream.fileno() == fd
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            _replaced.append(stream)
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (the process's own stream)


_OWN_PACKAGES = ("cellmesh", "comm", "coordinator", "services")
_MAY_BE_LOADED = {"coordinator", "coordinator.runtime", __name__}


def fork_here() -> None:
    """Make this process's fork server a fork of this process, instead of a fresh interpreter that imports
    :data:`PRELOAD` again: for a process that has those libraries loaded already and nothing of cellmesh
    (a test harness's command forked from its own preloaded server). The server is ready at once.

    Raises:
        RuntimeError: This process runs threads (a fork would copy none of them, maybe mid-lock), has
            imported a cellmesh module (the children must import those afresh, after their environment is
            set: see [Note: the fork server]), or already has its server.
    """
    global _shared
    with _shared_lock:
        if _shared is not None:
            raise RuntimeError("fork_here: this process has its fork server already")
        loaded = sorted(name for name in sys.modules
                        if name.split(".")[0] in _OWN_PACKAGES and name not in _MAY_BE_LOADED)
        if threading.active_count() > 1 or loaded:
            raise RuntimeError(f"fork_here: this process runs {threading.active_count()} thread(s) and has "
                               f"loaded {loaded[:5]}: only a single-threaded process without cellmesh "
                               "modules may become the fork server")
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: what Popen(stdin=PIPE, stdout=PIPE, start_new_session=True) would give
            code = 1
            try:
                os.setsid()
                os.dup2(requests_r, 0)
                os.dup2(replies_w, 1)
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                _streams_on_their_descriptors()
                serve()
                code = 0
            finally:
                os._exit(code)
        os.close(requests_r)
        os.close(replies_w)
        process = _Forked(pid, os.fdopen(requests_w, "wb"), os.fdopen(replies_r, "rb"))
        _shared = ForkServer(wait=False, process=process)
        atexit.register(_shared.close)


def prestart() -> None:
    """Start this process's fork server now, without waiting for its imports: they run beside whatever this
    process does next (a run's own imports, its checks, profiling and planning), and :func:`shared` waits
    for what is left of them. Does nothing when the server is off, already started, or failed before."""
    global _shared, _failed
    if not enabled():
        return
    with _shared_lock:
        if _shared is not None or _failed:
            return
        try:
            _shared = ForkServer(wait=False)
        except OSError as exc:
            _failed = True
            log.warning("local workers start as fresh interpreters: the fork server did not start (%s)", exc)
            return
        atexit.register(_shared.close)


def shared() -> ForkServer | None:
    """This process's fork server, started on first use (or by :func:`prestart`) and ready; None when it is
    off or could not start."""
    global _shared, _failed
    if not enabled():
        return None
    with _shared_lock:
        if _shared is not None and _shared.alive:
            try:
                _shared.wait_ready()
                return _shared
            except (RuntimeError, TimeoutError) as exc:
                _shared.close()
                _shared, _failed = None, True
                log.warning("local workers start as fresh interpreters: the fork server did not start (%s)",
                            exc)
                return None
        if _failed:
            return None
        try:
            _shared = ForkServer()
        except (OSError, RuntimeError, TimeoutError) as exc:
            _failed = True
            log.warning("local workers start as fresh interpreters: the fork server did not start (%s)", exc)
            return None
        atexit.register(_shared.close)
        return _shared


def _package_root() -> str:
    """The directory holding the ``coordinator`` package (the server runs this module from there)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the server side (its own process) ------------------------------------------------------


def _reply(message: Mapping[str, Any]) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(1, data):]


def _child(request: _Request, out: int, selector: selectors.BaseSelector, wake: tuple[int, int]) -> None:
    """In the forked child: become what ``Popen(start_new_session=True)`` starts, run the target."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        # the dispositions a fresh interpreter starts with: SIGPIPE ignored (a write to a peer's closed
        # socket is an EPIPE error, not death), SIGINT a KeyboardInterrupt unless the server's parent
        # ignored it (an ignored signal stays ignored across exec: a background job's children), the others
        # the default
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        interrupt = signal.SIG_IGN if _INHERITED_SIGINT_IGNORED else signal.default_int_handler
        signal.signal(signal.SIGINT, interrupt)
        selector.close()
        for fd in wake:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        env = request.env
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request.cwd)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in [request.cwd, *paths] if p not in sys.path]
        import torch  # preloaded: OpenMP read OMP_NUM_THREADS when the server loaded it

        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1") or 1)))
        module, _, function = request.target.partition(":")
        sys.argv = [module, *request.argv]
        result = getattr(importlib.import_module(module), function)(list(request.argv))
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class _Request:
    """One request, checked and its log opened before the fork (so a bad one is refused, as ``Popen``
    raises in the parent)."""

    def __init__(self, line: bytes) -> None:
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise ValueError("a request is a JSON object")
        self.target, self.cwd, self.log = str(raw["target"]), str(raw["cwd"]), str(raw["log"])
        self.argv = [str(a) for a in raw["argv"]]
        self.env = {str(k): str(v) for k, v in dict(raw["env"]).items()}
        if ":" not in self.target:
            raise ValueError(f"target {self.target!r} is not 'module:function'")
        if not os.path.isdir(self.cwd):
            raise FileNotFoundError(f"no directory {self.cwd}")

    def open_log(self) -> int:
        return os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


_INHERITED_SIGINT_IGNORED = False
"""Whether the server started with SIGINT ignored (as its parent's ``Popen`` children would)."""


def serve() -> None:
    """The server's loop: preload, then fork a child per request line until stdin closes."""
    global _INHERITED_SIGINT_IGNORED
    _INHERITED_SIGINT_IGNORED = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # children's full collections skip the libraries ([Note: a worker's heap and its lease])
    read_wake, write_wake = os.pipe()
    os.set_blocking(write_wake, False)
    os.set_blocking(read_wake, False)
    signal.set_wakeup_fd(write_wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when the server ends
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(read_wake, selectors.EVENT_READ)
    pending = b""
    _reply({"ready": os.getpid()})
    while True:
        for key, _ in selector.select():
            if key.fd == read_wake:
                with contextlib.suppress(BlockingIOError):
                    os.read(read_wake, 4096)
                _reap()
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                _reap()
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = _Request(line)
                    out = request.open_log()
                except Exception as exc:  # a malformed request, no such directory: say so, keep serving
                    _reply({"error": f"{type(exc).__name__}: {exc}"})
                    continue
                try:
                    pid = os.fork()
                except OSError as exc:
                    os.close(out)
                    _reply({"error": f"cannot fork: {exc}"})
                    continue
                if pid == 0:
                    _child(request, out, selector, (read_wake, write_wake))
                os.close(out)
                _reply({"spawned": pid})
        _reap()


if __name__ == "__main__":
    serve()
