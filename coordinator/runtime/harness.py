"""The embedded local harness: a registry served from this process and N worker processes on loopback.

``Resources.local(workers=N)`` runs here: :class:`LocalHarness` serves the registry
(:class:`~comm.registry.RegistryServer`, in-process), starts ``python -m services.host.worker``
once per resource worker (named as the resources name them, so a plan's placement names
the processes), and waits, bounded, until every worker's card is in the registry.

Each worker's stdout and stderr go to ``{log_dir}/{name}.log`` (appended; the harness opens
the file and hands it to the child), never to the user's terminal. The workers log at the
level and in the format this process's logging was configured with (``comm/logs.py``'s
``child_env``: a job's ``logging`` section, else ``CELLMESH_LOG_LEVEL``, else INFO). Without
a ``log_dir`` the files go to a temporary directory that :meth:`LocalHarness.close` removes
when every worker exited cleanly and keeps (and names in a warning) when one did not; a
worker that exits before registering is reported with the end of its log.

Trust: a worker builds only the factories the harness names (``factories``: the job's,
:func:`coordinator.runtime.factories.job_factories`; a harness shared by several jobs names
all of theirs), passed as ``--factory`` at start; any other name in an assignment is refused
(``services/factories.py``). The harness makes the job's keys (:class:`comm.auth.JobKeys`) and installs the
coordinator's credentials in this process before it serves anything, so every socket of the
run speaks CURVE and only the job is served; the workers get their copy (no coordinator
secret) in a private temporary directory (``CELLMESH_KEYS_DIR``), removed at close. The
credentials this process held before are restored at close. ``secure=False`` runs without
(tests of single parts).

A worker process that exits on its own (killed, crashed) has its card deleted by the harness as
soon as it is reaped, so the coordinator hears of it at once; a frozen one is noticed when its
lease lapses.

Replacing a worker (:meth:`LocalHarness.replace`, what a session does when one died or froze):
the old process is killed (SIGKILL: a frozen one cannot be trusted to stop sending), its card
deleted, and a new process started under the same name, without the first one's
``worker_env`` (so an injected fault does not fire again); it registers with a new
incarnation and address. ``replacements=False`` makes the harness behave like a node gone
for good: :meth:`replace` then only kills and returns None, and :meth:`restart` brings the
worker back later (a node that returns).

Memory caps (``memory_limits``): each named worker is started with ``--memory-limit`` (see [Note: the
memory cap] in ``comm/memcap.py``); a session caps the local CPU workers it starts at their resource's
``memory_bytes`` when ``runtime.memory_cap`` is on (off by default).

Starting: each worker is forked from the coordinator process's fork server, which imported torch once
([Note: the fork server] in ``coordinator/runtime/forkserver.py``), so a worker or a replacement is up
in a fraction of a second rather than the seconds a fresh interpreter takes to import; ``fork=False``
or ``CELLMESH_FORK_SERVER=0`` starts fresh interpreters (``python -m services.host.worker``).

Teardown (:meth:`LocalHarness.close`, also on errors inside ``with``, at interpreter exit
and from a test's fixture) asks every worker to drain (SIGTERM), waits ``grace``, then
kills what is left (SIGKILL) and reaps it, then stops the registry: every process the
harness started is gone afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from comm import auth
from comm.codec import unpack
from comm.logs import child_env
from comm.registry import RegistryServer
from comm.registry.base import Registry
from coordinator.planning.resources import Resources
from coordinator.runtime import forkserver
from services.host.worker import worker_key
from services.protocol import WorkerCard

WORKER_TARGET = "services.host.worker:run"
WorkerProcess = subprocess.Popen[bytes] | forkserver.ForkedProcess
"""A worker's process: forked from the fork server, or a fresh interpreter."""

__all__ = ["DEFAULT_LEASE_TTL", "DEFAULT_START_TIMEOUT", "LocalHarness", "memory_limits"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = timedelta(seconds=5)
DEFAULT_START_TIMEOUT = timedelta(seconds=90)
LOG_TAIL_LINES = 20  # of a worker's log, in the error when it exits before registering

_live: weakref.WeakSet[LocalHarness] = weakref.WeakSet()


def memory_limits(resources: Resources) -> dict[str, int]:
    """The cap of each CPU worker of ``resources``: its ``memory_bytes`` (a GPU worker's is device memory,
    which the process cap does not bound)."""
    return {w.name: w.memory_bytes for w in resources.workers if w.device == "cpu"}


class LocalHarness:
    """A registry and one worker process per name, on loopback.

    Args:
        names: The workers' names (e.g. ``Resources.local(2)``'s ``local-0``, ``local-1``).

    Keyword Args:
        job: The job's name (the registry prefix ``/cellmesh/{job}/``).
        lease_ttl: A worker's card vanishes this long after its process stops renewing it.
        threads: ``OMP_NUM_THREADS`` of each worker (torch's intra-op threads).
        python_path: Directories the workers need on ``sys.path`` (where the job's factories live).
        factories: The ``"package.module:function"`` names the workers may build (none: they build
            barriers and parameter servers only).
        env: Extra environment variables for the workers.
        start_timeout: Bounds starting every worker until its card is registered.
        grace: How long :meth:`close` waits for workers to drain before killing them.
        log_dir: Where each worker's output goes (``{name}.log``); None: a temporary directory,
            removed by :meth:`close` unless a worker exited uncleanly.
        worker_env: Extra environment of one worker's first process, by name (fault injection:
            ``services/faults.py``); a replacement does not get it.
        replacements: Whether :meth:`replace` starts a new process (False: a node gone for good).
        fork: Whether workers are forked from this process's fork server (torch already imported: see
            [Note: the fork server] in ``coordinator/runtime/forkserver.py``; ``CELLMESH_FORK_SERVER=0``
            turns it off everywhere) rather than started as fresh interpreters.
        memory_limits: Each named worker's memory cap in bytes (``--memory-limit``: an allocation beyond
            it fails the step; ``comm/memcap.py``), e.g. :func:`memory_limits` of the resource list.
    """

    def __init__(self, names: Sequence[str], *, job: str, lease_ttl: timedelta = DEFAULT_LEASE_TTL,
                 threads: int = 1, python_path: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 start_timeout: timedelta = DEFAULT_START_TIMEOUT,
                 grace: timedelta = timedelta(seconds=5), log_dir: Path | None = None,
                 secure: bool = True, factories: Iterable[str] = (),
                 worker_env: Mapping[str, Mapping[str, str]] | None = None,
                 replacements: bool = True, memory_limits: Mapping[str, int] | None = None,
                 fork: bool = True) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"worker names must be non-empty and unique, got {list(names)}")
        self.names = list(names)
        self.job = job
        self.lease_ttl = lease_ttl
        self.threads = threads
        self.python_path = list(python_path)
        self.factories = sorted(set(factories))
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.grace = grace
        self.log_dir = log_dir
        self._temporary_logs = log_dir is None
        self.procs: dict[str, WorkerProcess] = {}
        self.cards: dict[str, WorkerCard] = {}
        self.exited_at: dict[str, float] = {}  # when a worker's process was last seen to end on its own
        self._server: RegistryServer | None = None
        self._closed = False
        self.secure = secure
        self._keys_dir: Path | None = None
        self._previous_credentials: auth.Credentials | None = None
        self._keys: auth.JobKeys | None = None  # this job's, admitted by the ZAP handler while it runs
        self.worker_env = {name: dict(env) for name, env in (worker_env or {}).items()}
        self.replacements = replacements
        self.memory_limits = dict(memory_limits or {})
        self.fork = fork
        self._env: dict[str, str] = {}
        self._allowed: list[str] = []

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def registry_url(self) -> str:
        assert self._server is not None, "start() first"
        return str(self._server.address)

    @property
    def registry(self) -> Registry:
        """The served registry itself (in this process)."""
        assert self._server is not None, "start() first"
        return self._server.registry

    def log_path(self, name: str) -> Path:
        """Worker ``name``'s log file (its stdout and stderr)."""
        assert self.log_dir is not None, "start() first"
        return self.log_dir / f"{name}.log"

    def start(self) -> LocalHarness:
        """Serve the registry, start the workers (output to their log files), wait until each registered.

        Raises:
            RuntimeError: A worker exited before registering (its exit code and the end of its log).
            TimeoutError: Naming the workers not registered within ``start_timeout``.
        """
        _live.add(self)
        try:
            extra_env = self._install_keys()
            self._server = RegistryServer().start()
            if self.log_dir is None:
                self.log_dir = Path(tempfile.mkdtemp(prefix=f"cellmesh-{self.job}-"))
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # not LOCAL_RANK: a local GPU worker runs on the GPU of its index (planning/devices.py)
            inherited = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
            env = {**inherited, "OMP_NUM_THREADS": str(self.threads), **child_env(), **extra_env, **self.env}
            paths = [*self.python_path, os.getcwd(), env.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
            self._env = env
            self._allowed = [arg for factory in self.factories for arg in ("--factory", factory)]
            for name in self.names:
                self._spawn(name, self.worker_env.get(name, {}))
            self._wait_registered(self.names)
        except BaseException:
            self.close()
            raise
        log.info("[harness %s] %d workers up: %s (logs in %s)", self.job, len(self.names),
                 ", ".join(self.names), self.log_dir)
        return self

    def _install_keys(self) -> dict[str, str]:
        """Make the job's keys, speak them from now on, and hand the workers their copy (see module doc)."""
        if not self.secure:
            return {}
        keys = auth.JobKeys.generate()
        self._keys_dir = Path(tempfile.mkdtemp(prefix=f"cellmesh-{self.job}-keys-"))  # mode 0700
        keys.for_workers().save(self._keys_dir)
        self._previous_credentials = auth.installed()
        self._keys = keys
        auth.install(auth.Credentials(keys, "coordinator"))
        return {auth.KEYS_DIR_ENV: str(self._keys_dir)}

    def _spawn(self, name: str, extra_env: Mapping[str, str], port: int = 0) -> None:
        limit = self.memory_limits.get(name)
        cap = ["--memory-limit", str(limit)] if limit is not None else []
        argv = ["--registry", self.registry_url, "--job", self.job, "--name", name, "--port", str(port),
                "--lease-ttl", str(self.lease_ttl.total_seconds()), *cap, *self._allowed]
        env = {**self._env, **extra_env}
        server = forkserver.shared() if self.fork else None
        forked: WorkerProcess | None = None
        if server is not None:
            try:
                forked = server.spawn(WORKER_TARGET, argv, env=env, log_path=str(self.log_path(name)))
            except (RuntimeError, TimeoutError) as exc:
                log.warning("[harness %s] worker %s starts as a fresh interpreter: %s", self.job, name, exc)
        if forked is not None:
            self.procs[name] = forked
        else:
            with open(self.log_path(name), "ab") as output:  # the child keeps its own descriptor
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "services.host.worker", *argv], env=env, stdin=subprocess.DEVNULL,
                    stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        proc = self.procs[name]
        threading.Thread(target=self._watch_exit, args=(name, proc), daemon=True,
                         name=f"harness-{self.job}-{name}").start()

    def _watch_exit(self, name: str, proc: WorkerProcess) -> None:
        """When ``proc`` exits on its own, delete its card at once: the coordinator then learns of the loss
        now rather than when the lease lapses. (A frozen process still needs the lease.)"""
        proc.wait()
        if self._closed or self.procs.get(name) is not proc:
            return
        self.exited_at[name] = time.time()
        key = self.worker_key(name)
        with contextlib.suppress(Exception):  # the registry may be closing with the harness
            kv = self.registry.get(key)
            if kv is not None and unpack(kv.value, WorkerCard).pid == proc.pid:
                self.registry.delete(key)
                log.info("[harness %s] worker %s (pid %d) exited with code %s", self.job, name, proc.pid,
                         proc.returncode)

    def _wait_registered(self, names: Sequence[str]) -> None:
        prefix = f"/cellmesh/{self.job}/workers/"
        deadline = time.monotonic() + self.start_timeout.total_seconds()
        with self.registry.watch(prefix, start_revision=1) as watch:
            while True:
                for kv in self.registry.list(prefix):
                    card = unpack(kv.value, WorkerCard)
                    if card.name in names and card.pid == self.procs[card.name].pid:
                        self.cards[card.name] = card
                missing = [n for n in names if n not in self.cards]
                if not missing:
                    return
                for name in missing:
                    code = self.procs[name].poll()
                    if code is not None:
                        raise RuntimeError(f"worker {name} exited with code {code} before registering; "
                                           f"the end of its log {self.log_path(name)}:\n{self._tail(name)}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"workers {missing} did not register under {prefix} within "
                                       f"{self.start_timeout.total_seconds():.0f}s")
                watch.get(timedelta(seconds=min(left, 0.5)))

    def _tail(self, name: str) -> str:
        try:
            lines = self.log_path(name).read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"  (unreadable: {exc.strerror})"
        return "\n".join("  " + line for line in lines[-LOG_TAIL_LINES:]) or "  (empty)"

    def address(self, name: str) -> str:
        """Worker ``name``'s service-host address."""
        return self.cards[name].address

    def worker_key(self, name: str) -> str:
        return worker_key(self.job, name)

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Send ``sig`` to worker ``name`` (fault injection).

        A SIGSTOP returns once every thread of the process is stopped: the kernel stops a process's threads
        one by one as each is next scheduled, so on a loaded host its other threads (the socket's I/O
        thread, a service thread) could otherwise still answer a request sent right after ``kill``.

        Raises:
            TimeoutError: With SIGSTOP, a thread still ran after ``timeout``.
        """
        proc = self.procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            if sig == signal.SIGSTOP:
                wait_stopped(proc.pid, timeout, f"worker {name}")

    def replace(self, name: str, timeout: timedelta) -> str | None:
        """Kill worker ``name``'s process (whatever its state) and start a new one under the same name;
        its address once registered, or None if ``replacements`` is off (see the module docstring).

        Raises:
            RuntimeError: The new process exited before registering (the end of its log).
            TimeoutError: It did not register within ``timeout``.
        """
        self._stop_process(name)
        if not self.replacements:
            return None
        return self.restart(name, timeout)

    def restart(self, name: str, timeout: timedelta | None = None) -> str:
        """Start worker ``name`` again (its previous process must be gone); its address once registered.

        Raises:
            RuntimeError: The process exited before registering (the end of its log).
            TimeoutError: It did not register within ``timeout`` (default ``start_timeout``).
        """
        self._stop_process(name)
        started = time.monotonic()
        self._spawn(name, {})
        bound, self.start_timeout = self.start_timeout, timeout or self.start_timeout
        try:
            self._wait_registered([name])
        finally:
            self.start_timeout = bound
        log.info("[harness %s] worker %s restarted (pid %d) in %.1fs", self.job, name, self.procs[name].pid,
                 time.monotonic() - started)
        return self.cards[name].address

    def restart_in_place(self, name: str) -> str:
        """Kill worker ``name`` and start it again at once on the same address, as a kubelet restarts a
        crashed container: the new process registers before the old one's lease lapses (its card is
        replaced, never deleted) and answers where the old one did. Its address once registered (fault
        injection: the coordinator must tell the two processes apart by their incarnation).
        """
        port = int(self.cards[name].address.rsplit(":", 1)[1])
        self.kill(name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[name].wait(5)
        self.cards.pop(name, None)
        self._spawn(name, {}, port)
        self._wait_registered([name])
        return self.cards[name].address

    def _stop_process(self, name: str) -> None:
        """Kill worker ``name``'s process if it runs, reap it and delete its card."""
        proc = self.procs[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        self.cards.pop(name, None)
        with contextlib.suppress(Exception):
            self.registry.delete(self.worker_key(name))

    def close(self) -> None:
        """Drain, then kill, every worker; stop the registry. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped worker cannot drain
        deadline = time.monotonic() + self.grace.total_seconds()
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("[harness %s] worker %s did not drain within %.1fs; killing it", self.job, name,
                            self.grace.total_seconds())
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown(timeout=timedelta(seconds=5))
        if self._keys_dir is not None:
            auth.install(self._previous_credentials)
            if self._keys is not None:  # the registry is down: nothing of this job is served any more
                auth.release_keys(self._keys)
                self._keys = None
            shutil.rmtree(self._keys_dir, ignore_errors=True)
            self._keys_dir = None
        if self._temporary_logs and self.log_dir is not None:
            unclean = sorted(n for n, p in self.procs.items() if p.returncode != 0)
            if unclean:
                log.warning("[harness %s] workers %s did not exit cleanly; their logs are in %s", self.job,
                            unclean, self.log_dir)
            else:
                shutil.rmtree(self.log_dir, ignore_errors=True)
        _live.discard(self)

    def __enter__(self) -> LocalHarness:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for harness in list(_live):
        harness.close()


def wait_stopped(pid: int, timeout: timedelta, what: str) -> None:
    """Wait until every thread of ``pid`` is stopped (state ``T`` or ``t`` in ``/proc``; Linux only: a
    no-op elsewhere) or gone."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        running = []
        for task in tasks.glob("*"):
            try:
                # the state follows the command name's closing parenthesis
                state = (task / "stat").read_text().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue  # the thread (or the process) is gone
            if state not in ("T", "t", "Z", "X"):
                running.append(task.name)
        if not running:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (pid {pid}): threads {running} still not stopped "
                               f"{timeout.total_seconds():.0f}s after SIGSTOP")
        time.sleep(0.001)
