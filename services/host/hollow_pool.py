"""The coordinator's side of a hollow fleet: a :class:`~coordinator.runtime.cluster.WorkerPool` of N hollow
workers in child processes of up to ``per_process`` workers each (``python -m services.host.hollow``, see
``services/host/hollow.py``).

As :class:`~coordinator.runtime.harness.LocalHarness` does for real worker processes, the pool makes
the job's keys and speaks them from this process (CURVE, the job's ZAP handler), serves the embedded
registry from this process (``registry=None``) or uses the etcd given (``etcd://...``), starts the
fleet with the workers' copy of the keys and waits, bounded, until every card is registered. A lost
worker is not replaced (:meth:`HollowPool.replace` returns None: a node gone for good), so a session
with ``runtime.max_restarts=0`` stops on the first loss: what the benchmark times. :meth:`crash` stops
one worker as ``kill -9`` would (its lease lapses; nobody deletes its card).

[Note: a fleet in several processes] One interpreter runs about six threads per hollow worker (its
service host, registry lease, pipeline door and rank lease, the clients' waits). When a placement wakes
hundreds of them at once, they queue for the one GIL, and a waiting thread wakes every switch interval
(5 ms) to ask for it: 512 workers in one process put about 700 threads in the run queue (a load average
of 800 on 2 cores), and the leases' refreshes waited past their 30 s. A fleet of ``per_process``
(:data:`PER_PROCESS`) workers a process keeps that queue to what one process of them makes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from comm import auth
from comm.codec import unpack
from comm.registry import RegistryServer, connect_registry
from comm.registry.base import Registry
from services.host.hollow import SHM_ENV
from services.host.worker import worker_key
from services.protocol import WorkerCard

__all__ = ["PER_PROCESS", "HollowPool"]

PER_PROCESS = 128
"""Hollow workers per fleet process by default ([Note: a fleet in several processes])."""


class HollowPool:
    """``count`` hollow workers named ``local-0``.. (``Resources.local(count)``'s names) in child processes of
    ``per_process`` workers each (the last may hold fewer).

    Args:
        count: How many workers.
        job: The job's name (the registry prefix).

    Keyword Args:
        registry: An ``etcd://`` URL, or None to serve the embedded registry from this process.
        factories: The factories the workers may build (the job's; a hollow stage builds its stage once
            per process for its tensors' names and shapes).
        lease_ttl: The workers' leases.
        action_ms: How long a hollow forward takes (a backward twice).
        action_jitter: Each compute action lasts up to this fraction longer, at random (stragglers).
        start_timeout: Bounds the start until every card is registered.
        per_process: Workers per fleet process ([Note: a fleet in several processes]).
        log: Where the fleet's stderr goes (default: a temporary file, named in errors, removed at close
            when the fleet exited cleanly).
    """

    def __init__(self, count: int, job: str, *, registry: str | None = None, factories: Sequence[str] = (),
                 lease_ttl: timedelta = timedelta(seconds=5), action_ms: float = 0.0,
                 action_jitter: float = 0.0,
                 start_timeout: timedelta = timedelta(seconds=300), per_process: int = PER_PROCESS,
                 log: Path | None = None) -> None:
        if per_process < 1:
            raise ValueError(f"per_process must be at least 1, got {per_process}")
        self.names = [f"local-{i}" for i in range(count)]
        self.per_process = per_process
        self.job = job
        self.lease_ttl = lease_ttl
        self._url = registry
        self._factories = list(factories)
        self._action_ms = action_ms
        self._action_jitter = action_jitter
        self._start_timeout = start_timeout
        self._log = log
        self._temporary_log = log is None  # removed at close when the fleet exited cleanly
        self._server: RegistryServer | None = None
        self._registry: Registry | None = None
        self._keys: auth.JobKeys | None = None
        self._keys_dir: Path | None = None
        self._previous: auth.Credentials | None = None
        self._procs: list[subprocess.Popen[str]] = []  # fleet k holds workers k * per_process ..
        self._lines: list[list[str]] = []  # each fleet's stdout lines
        self._line_ready = threading.Condition()
        self.cards: dict[str, WorkerCard] = {}
        self.up_seconds = 0.0  # from spawning the fleet until every card was registered

    @property
    def registry(self) -> Registry:
        assert self._registry is not None, "start() first"
        return self._registry

    @property
    def registry_url(self) -> str:
        if self._server is not None:
            return str(self._server.address)
        assert self._url is not None
        return self._url

    @property
    def pids(self) -> list[int]:
        """The fleet processes' ids."""
        assert self._procs, "start() first"
        return [proc.pid for proc in self._procs]

    def address(self, name: str) -> str:
        return self.cards[name].address

    def replace(self, name: str, timeout: timedelta) -> str | None:
        return None  # a hollow worker is not replaced: the job stops (or plans anew) without it

    def start(self) -> HollowPool:
        """Keys, registry, the fleet; wait until every worker's card is registered.

        Raises:
            RuntimeError: The fleet exited first (the end of its log).
            TimeoutError: Naming how many registered within ``start_timeout``.
        """
        try:
            self._keys = auth.JobKeys.generate()
            self._keys_dir = Path(tempfile.mkdtemp(prefix=f"cellmesh-{self.job}-keys-"))
            self._keys.for_workers().save(self._keys_dir)
            self._previous = auth.installed()
            auth.install(auth.Credentials(self._keys, "coordinator"))
            if self._url is None:
                self._server = RegistryServer().start()
                self._registry = self._server.registry
            else:
                self._registry = connect_registry(self._url)
            if self._log is None:
                self._log = Path(tempfile.mkdtemp(prefix=f"cellmesh-{self.job}-")) / "hollow.log"
            started = time.monotonic()
            factories = [arg for f in self._factories for arg in ("--factory", f)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CELLMESH_LOG_LEVEL": "WARNING", SHM_ENV: "0",
                   auth.KEYS_DIR_ENV: str(self._keys_dir),
                   "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")]
                                                 if p)}
            for k, first in enumerate(range(0, len(self.names), self.per_process)):
                workers = min(self.per_process, len(self.names) - first)
                with open(self._log, "ab") as output:
                    self._procs.append(subprocess.Popen(
                        [sys.executable, "-m", "services.host.hollow", "--registry", self.registry_url,
                         "--job", self.job, "--workers", str(workers), "--first", str(first), "--lease-ttl",
                         str(self.lease_ttl.total_seconds()), "--action-ms", str(self._action_ms),
                         "--action-jitter", str(self._action_jitter),
                         "--keys-dir", str(self._keys_dir), *factories],
                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=output, text=True,
                        start_new_session=True))
                self._lines.append([])
                threading.Thread(target=self._read, args=(k,), daemon=True,
                                 name=f"hollow-{self.job}-{k}").start()
            self._wait_registered()
            self.up_seconds = time.monotonic() - started
        except BaseException:
            self.close()
            raise
        return self

    def _read(self, k: int) -> None:
        stdout = self._procs[k].stdout
        assert stdout is not None
        for line in stdout:
            with self._line_ready:
                self._lines[k].append(line.strip())
                self._line_ready.notify_all()

    def _wait_registered(self) -> None:
        prefix = f"/cellmesh/{self.job}/workers/"
        deadline = time.monotonic() + self._start_timeout.total_seconds()
        wanted = set(self.names)
        while True:
            for kv in self.registry.list(prefix):
                card = unpack(kv.value, WorkerCard)
                if card.name in wanted:
                    self.cards[card.name] = card
            if len(self.cards) == len(wanted):
                return
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a hollow fleet process exited with code {proc.returncode} before "
                                       f"every worker registered; the fleet's log: {self._log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.cards)} of {len(wanted)} hollow workers registered under "
                                   f"{prefix} within {self._start_timeout.total_seconds():.0f}s; the "
                                   f"fleet's log: {self._log}")
            time.sleep(0.2)

    def crash(self, name: str, timeout: timedelta = timedelta(seconds=10)) -> float:
        """Stop worker ``name`` as ``kill -9`` would; when it stopped (``time.time()``, the fleet's word).

        Raises:
            TimeoutError: The fleet did not confirm within ``timeout``.
        """
        k = self.names.index(name) // self.per_process
        return float(self._command(k, f"crash {name}", f"crashed {name} ", timeout).split()[-1])

    def _command(self, k: int, command: str, answer: str, timeout: timedelta) -> str:
        """Send fleet process ``k`` ``command``; its first line after it that starts with ``answer``."""
        stdin = self._procs[k].stdin
        assert stdin is not None
        with self._line_ready:
            seen = len(self._lines[k])
        stdin.write(command + "\n")
        stdin.flush()
        deadline = time.monotonic() + timeout.total_seconds()
        with self._line_ready:
            while True:
                for line in self._lines[k][seen:]:
                    if line.startswith(answer):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the hollow fleet did not answer {command!r} within "
                                       f"{timeout.total_seconds():.0f}s (log: {self._log})")
                self._line_ready.wait(left)

    def close(self, grace: timedelta = timedelta(seconds=20)) -> None:
        """Drain the fleet (SIGTERM, then SIGKILL after ``grace``), stop the registry, restore the keys."""
        for proc in self._procs:  # every fleet drains at once
            if proc.poll() is None:
                proc.terminate()
        clean = True
        deadline = time.monotonic() + grace.total_seconds()
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            clean = clean and proc.returncode == 0
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError, ValueError):
                        stream.close()
        if self._procs and self._temporary_log and clean and self._log is not None:
            shutil.rmtree(self._log.parent, ignore_errors=True)
        self._procs = []
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown(timeout=timedelta(seconds=5))
            self._server = None
        elif self._registry is not None:
            self._registry.close()
        self._registry = None
        if self._keys_dir is not None:
            auth.install(self._previous)
            if self._keys is not None:
                auth.release_keys(self._keys)
                self._keys = None
            shutil.rmtree(self._keys_dir, ignore_errors=True)
            self._keys_dir = None

    def worker_key(self, name: str) -> str:
        return worker_key(self.job, name)

    def __enter__(self) -> HollowPool:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
