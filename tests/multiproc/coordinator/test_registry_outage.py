"""Registry outages and orphaned workers, with real processes.

* etcd stopped (SIGSTOP) for 10 s (over three leases) while a job trains: every lease lapses and
  etcd revokes them all the moment it resumes. Training goes on (the data plane never needs etcd),
  nobody quits, the cards come back with new leases, and the final parameters are the one-process reference's.
* A coordinator killed with SIGKILL: its workers leave within their lease (+2 s), each with one
  WARNING line in its log and exit code 0, whether the registry died with the coordinator (the
  embedded one) or outlived it (etcd: the coordinator's presence key lapsed).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from comm.codec import unpack
from comm.registry import OUTAGE_GRACE
from coordinator.runtime.cluster import ClusterWorkers
from coordinator.runtime.records import StepRecord
from coordinator.runtime.reference import max_abs_diff, train_reference
from services.protocol import WorkerCard
from tests.harness import commands
from tests.harness.etcd import EtcdServer, etcd_available
from tests.harness.workers import WorkerProcess, start_worker
from tests.multiproc.coordinator.outage_coordinator import FACTORIES, make_job

ROOT = Path(__file__).resolve().parents[3]
OUTAGE = 10.0  # seconds etcd is stopped: over three of the workers' leases, so every lease lapses
PACE = 0.25  # the shortest step: the callback sleeps the rest, so the outage spans ~40 steps, not thousands
STEPS = 75  # PACE * STEPS = 19 s: a few steps before, the outage, then more than OUTAGE_GRACE after
LEASE = 3.0  # the workers' lease, seconds
TOL64 = 1e-9


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    if not etcd_available():
        pytest.fail("the etcd server binary is not installed: run `make etcd` (apt-get install etcd-server)")
    with EtcdServer() as server:
        yield server
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)  # never leave it stopped for stop() to wait on


def _lines(path: Path, count: int, proc: commands.Started, log: Path, timeout: float = 60.0) -> list[str]:
    """The first ``count`` lines ``proc`` wrote to ``path``, waited for (bounded; its log if it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        lines = text.split("\n")[:-1]  # whole lines only
        if len(lines) >= count:
            return lines[:count]
        assert proc.poll() is None, f"the coordinator exited ({proc.returncode}): {log.read_text()}"
        assert time.monotonic() < deadline, f"{len(lines)} of {count} lines within {timeout:.0f}s: {text!r}"
        time.sleep(0.02)


def start_workers(url: str, job: str, count: int, logs: Path) -> list[WorkerProcess]:
    """``count`` workers started at once (each imports torch), logging at INFO to ``logs/NAME.log``."""
    names = [f"w{i}" for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda name: start_worker(
            url, job, name, lease_ttl=LEASE, factories=FACTORIES, log=logs / f"{name}.log",
            env={"CELLMESH_LOG_LEVEL": "INFO"}), names))


def problems(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]


@pytest.mark.etcd
@pytest.mark.timeout(150)
def test_training_goes_on_through_an_etcd_outage(etcd: EtcdServer, tmp_path: Path) -> None:
    workers = start_workers(etcd.url, "outage", 2, tmp_path)
    try:
        with ClusterWorkers(etcd.url, "outage", 2, timeout=timedelta(seconds=30)) as pool:
            pids = {name: card.pid for name, card in pool.cards.items()}
            assert pids == {w.name: w.proc.pid for w in workers}
            job = make_job(pool.resources())
            marks: dict[str, float] = {}
            last = [time.monotonic()]

            def drive(record: StepRecord) -> None:
                """Pace the steps; stop etcd after step 5, resume it OUTAGE seconds later."""
                time.sleep(max(0.0, PACE - (time.monotonic() - last[0])))
                last[0] = time.monotonic()
                done = job.steps_done + 1
                if done == 5:
                    os.kill(etcd.pid or 0, signal.SIGSTOP)
                    marks["stopped"], marks["stopped_at"] = time.monotonic(), done
                elif "stopped" in marks and "resumed" not in marks and last[0] - marks["stopped"] >= OUTAGE:
                    os.kill(etcd.pid or 0, signal.SIGCONT)
                    marks["resumed"], marks["resumed_at"] = time.monotonic(), done

            with job.attach(pool):
                result = job.fit(STEPS, callback=drive)
            trained_after = time.monotonic() - marks["resumed"]
            cards = {kv.key.rsplit("/", 1)[1]: unpack(kv.value, WorkerCard)
                     for kv in pool.registry.list("/cellmesh/outage/workers/")}
    finally:
        for w in workers:
            alive = w.proc.poll() is None
            w.stop()
            assert alive, f"worker {w.name} quit (exit code {w.proc.returncode})"
    assert marks["resumed_at"] - marks["stopped_at"] >= 20, marks  # steps went on while etcd was stopped
    assert trained_after > OUTAGE_GRACE.total_seconds() + 1, trained_after  # a held loss would have shown
    # every worker is the process it was, registered again (the outage cost every lease)
    assert {name: card.pid for name, card in cards.items()} == pids
    logs = {w.name: (tmp_path / f"{w.name}.log").read_text() for w in workers}
    for name, log in logs.items():
        renewed = f"of worker {name}'s card while it could not be refreshed"
        assert renewed in log, f"{name}: the outage did not cost its lease:\n{log}"
        assert not problems(log), f"{name}:\n{log}"
    # no step lost or repeated: the one-process reference on the same batches
    ref = train_reference(job, STEPS)
    assert len(result.losses) == STEPS
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL64, f"max abs diff {diff:.3g} after {STEPS} steps"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < TOL64 * 100


@pytest.mark.timeout(90)
@pytest.mark.parametrize("registry", ["embedded", pytest.param("etcd", marks=pytest.mark.etcd)])
def test_a_coordinator_killed_mid_training_leaves_its_workers_quitting_quietly(
        registry: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url = request.getfixturevalue("etcd").url if registry == "etcd" else "serve"
    out = tmp_path / "coordinator.out"
    coordinator = commands.start(
        [sys.executable, "-m", "tests.multiproc.coordinator.outage_coordinator", url, "orphans", "2"],
        cwd=ROOT, stdout=out, stderr=tmp_path / "coordinator.log", env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers: list[WorkerProcess] = []
    try:
        url = _lines(out, 1, coordinator, tmp_path / "coordinator.log")[0]
        workers = start_workers(url, "orphans", 2, tmp_path)
        steps = _lines(out, 6, coordinator, tmp_path / "coordinator.log")[1:]
        assert steps == ["step"] * 5, steps  # training is under way
        logged = {w.name: (tmp_path / f"{w.name}.log").stat().st_size for w in workers}
        coordinator.kill()
        killed = time.monotonic()
        exited: dict[str, float] = {}
        while len(exited) < len(workers) and time.monotonic() - killed < LEASE + 10:
            for w in workers:
                if w.name not in exited and w.proc.poll() is not None:
                    exited[w.name] = time.monotonic() - killed
            time.sleep(0.02)
    finally:
        coordinator.kill()
        coordinator.wait(10)
        for w in workers:
            w.stop()
    assert sorted(exited) == ["w0", "w1"], f"still running {LEASE + 10:.0f}s after the kill: {exited}"
    for w in workers:
        assert exited[w.name] <= LEASE + 2, exited
        assert w.proc.returncode == 0
        log = (tmp_path / f"{w.name}.log").read_text()
        after = log.encode()[logged[w.name]:].decode().splitlines()
        assert len(after) == 1, after  # one line, naming why
        assert " WARNING " in after[0] and "coordinator" in after[0] and "is gone" in after[0], after
        assert not problems(log), log
