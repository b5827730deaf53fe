"""The coordinator's side of a hollow fleet: a :class:`~coordinator.runtime.cluster.WorkerPool` of N hollow
workers in one child process (``python -m services.host.hollow``, see ``services/host/hollow.py``).

As :class:`~coordinator.runtime.harness.LocalHarness` does for real worker processes, the pool makes
the job's keys and speaks them from this process (CURVE, the job's ZAP handler), serves the embedded
registry from this process (``registry=None``) or uses the etcd given (``etcd://...``), starts the
fleet with the workers' copy of the keys and waits, bounded, until every card is registered. A lost
worker is not replaced (:meth:`HollowPool.replace` returns None: a node gone for good), so a session
with ``runtime.max_restarts=0`` stops on the first loss: what the benchmark times. :meth:`crash` stops
one worker as ``kill -9`` would (its lease lapses; nobody deletes its card).
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

__all__ = ["HollowPool"]


class HollowPool:
    """``count`` hollow workers named ``local-0``.. (``Resources.local(count)``'s names) in one child process.

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
        log: Where the fleet's stderr goes (default: a temporary file, named in errors, removed at close
            when the fleet exited cleanly).
    """

    def __init__(self, count: int, job: str, *, registry: str | None = None, factories: Sequence[str] = (),
                 lease_ttl: timedelta = timedelta(seconds=5), action_ms: float = 0.0,
                 action_jitter: float = 0.0,
                 start_timeout: timedelta = timedelta(seconds=300), log: Path | None = None) -> None:
        self.names = [f"local-{i}" for i in range(count)]
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
        self._proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
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
    def pid(self) -> int:
        assert self._proc is not None, "start() first"
        return self._proc.pid

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
            with open(self._log, "ab") as output:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "services.host.hollow", "--registry", self.registry_url, "--job",
                     self.job, "--workers", str(len(self.names)), "--lease-ttl",
                     str(self.lease_ttl.total_seconds()), "--action-ms", str(self._action_ms),
                     "--action-jitter", str(self._action_jitter),
                     "--keys-dir", str(self._keys_dir), *factories],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=output, text=True,
                    start_new_session=True)
            threading.Thread(target=self._read, daemon=True, name=f"hollow-{self.job}").start()
            self._wait_registered()
            self.up_seconds = time.monotonic() - started
        except BaseException:
            self.close()
            raise
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._line_ready:
                self._lines.append(line.strip())
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
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"the hollow fleet exited with code {self._proc.returncode} before every "
                                   f"worker registered; its log: {self._log}")
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
        return float(self._command(f"crash {name}", f"crashed {name} ", timeout).split()[-1])

    def _command(self, command: str, answer: str, timeout: timedelta) -> str:
        assert self._proc is not None and self._proc.stdin is not None
        with self._line_ready:
            seen = len(self._lines)
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        deadline = time.monotonic() + timeout.total_seconds()
        with self._line_ready:
            while True:
                for line in self._lines[seen:]:
                    if line.startswith(answer):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the hollow fleet did not answer {command!r} within "
                                       f"{timeout.total_seconds():.0f}s (log: {self._log})")
                self._line_ready.wait(left)

    def close(self, grace: timedelta = timedelta(seconds=20)) -> None:
        """Drain the fleet (SIGTERM, then SIGKILL after ``grace``), stop the registry, restore the keys."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
            try:
                self._proc.wait(grace.total_seconds())
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError, ValueError):
                        stream.close()
            if self._temporary_log and self._proc.returncode == 0 and self._log is not None:
                shutil.rmtree(self._log.parent, ignore_errors=True)
            self._proc = None
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
