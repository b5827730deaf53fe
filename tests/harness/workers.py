"""Worker processes for tests: the real `python -m services.host.worker` entry point, always cleaned up.

Each is forked from the harness's fork server ([Note: commands from a fork server] in ``commands.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from comm.codec import unpack
from comm.registry import RegistryServer, connect_registry
from services.host.worker import worker_key
from services.protocol import WorkerCard
from tests.harness import commands

__all__ = ["WorkerProcess", "registry_server", "start_worker"]


class WorkerProcess:
    """A running worker: its process, card and address."""

    def __init__(self, proc: commands.Started, card: WorkerCard, name: str) -> None:
        self.proc = proc
        self.card = card
        self.name = name
        self.address = card.address

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_worker(registry_address: str, job: str, name: str, *, lease_ttl: float = 2.0,
                 timeout: float = 30.0, factories: Sequence[str] = (), job_spec: str | None = None,
                 env: Mapping[str, str] | None = None, insecure: bool = True,
                 log: Path | None = None) -> WorkerProcess:
    """Start a worker process and wait (bounded) until its card is in the registry (any registry URL).

    ``factories`` (``--factory``) and ``job_spec`` (``--job-spec``) are what it may build; ``env``
    adds to its environment. ``insecure``: without keys (these tests' parts); else the worker
    reads them from ``CELLMESH_KEYS_DIR`` in ``env``. ``log``: the file its log (stderr) goes to
    (default: this process's stderr).
    """
    allowed = [arg for factory in factories for arg in ("--factory", factory)]
    if insecure:
        allowed.append("--insecure")
    if job_spec is not None:
        allowed += ["--job-spec", job_spec]
    proc = commands.start(
        [sys.executable, "-m", "services.host.worker", "--registry", registry_address, "--job", job,
         "--name", name, "--lease-ttl", str(lease_ttl), *allowed],
        env={**os.environ, "OMP_NUM_THREADS": "1", "CELLMESH_LOG_LEVEL": "WARNING", **(env or {})},
        stdout=commands.DEVNULL, stderr=log, append=True)
    registry = connect_registry(registry_address)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kv = registry.get(worker_key(job, name))
            if kv is not None:
                return WorkerProcess(proc, unpack(kv.value, WorkerCard), name)
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited with {proc.returncode} before registering")
            time.sleep(0.05)
        proc.kill()
        raise TimeoutError(f"worker {name} did not register within {timeout:.0f}s")
    finally:
        registry.close()


@contextmanager
def registry_server() -> Iterator[RegistryServer]:
    server = RegistryServer()
    server.start()
    try:
        yield server
    finally:
        server.shutdown(timeout=timedelta(seconds=5))
