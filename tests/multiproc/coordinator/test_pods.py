"""The pod entry points for real: etcd, the coordinator and two workers as the rendered manifests run them.

Each process gets exactly the command, arguments and environment its pod gets from
``cellmesh k8s render`` (addresses and ports rewritten to loopback: tests/harness/pods.py),
with the Debian etcd as the registry. The job trains to the end; its checkpoint must
equal one process training the same model on the same batches.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from comm import auth
from comm.codec import unpack
from comm.registry import connect_registry
from comm.registry.follow import FOLLOW_POLL
from comm.registry.keepalive import OUTAGE_GRACE
from comm.rpc import RpcClient
from coordinator.commands.cli import main as cli_main
from coordinator.commands.jobspec import load_job
from coordinator.commands.k8s.options import SPEC_DIR, RenderOptions
from coordinator.commands.k8s.render import render
from coordinator.commands.rundir import RunRecord
from coordinator.runtime.reference import max_abs_diff, train_reference
from services.host.worker import DEREGISTER_TIMEOUT, DRAIN_TIMEOUT
from services.protocol import Empty, WorkerCard
from tests.harness.http import http_get as _http
from tests.harness.pods import LoopbackCluster, Pod

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(240)]  # `make test` installs etcd: no etcd is a failure

REPO = Path(__file__).resolve().parents[3]
SPEC = """\
name: podjob
steps: 4
model: {factory: charlm:model, kwargs: {width: 32, heads: 2, blocks: 1}}
data: {factory: charlm:data, global_batch: 8, seed: 3}
loss: {factory: charlm:loss}
optimizer: {name: SGD, kwargs: {lr: 0.05}}
plan: {strategy: auto}
runtime: {workers: 2}
"""
FLOAT32_TOLERANCE = 1e-5  # float32 sums in another order than one process's


def _secrets(spec: Path, directory: Path) -> dict[str, Path]:
    """The job's keys, made as a user makes them (``cellmesh k8s keys``): the Secrets the pods mount."""
    assert cli_main(["k8s", "keys", str(spec), "-o", str(directory)]) == 0
    return {"podjob-coordinator-keys": directory / "coordinator", "podjob-worker-keys": directory / "worker"}


def _done(metrics: str) -> bool:
    """The coordinator at ``metrics`` wrote the final state_dict and its record."""
    return "cellmesh_done 1.0" in _http(metrics + "/metrics")[1]


def _wait(what: str, check: Callable[[], bool], cluster: LoopbackCluster, timeout: float) -> None:
    """Poll ``check`` until true; fail early if a pod process that should be running exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        for name, proc in cluster.procs.items():
            if proc.poll() is not None and name not in cluster.stopped:
                raise AssertionError(
                    f"{name} exited with {proc.returncode} while waiting for {what}\n{cluster.logs()}"
                )
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{cluster.logs()}")


def _start_etcd_and_workers(cluster: LoopbackCluster) -> Pod:
    """Start the etcd pod and the worker pods; wait until each worker is ready; return the etcd pod."""
    etcd = cluster.pods["podjob-etcd-0"]
    cluster.start("podjob-etcd-0")
    _wait(
        "etcd's /readyz",
        lambda: _http(f"http://127.0.0.1:{etcd.port('client')}/health")[0] == 200,
        cluster,
        60,
    )
    for name in ("podjob-worker-1", "podjob-worker-0"):  # out of order: ranks, not start order, place
        cluster.start(name)
    for name in ("podjob-worker-0", "podjob-worker-1"):
        health = f"http://127.0.0.1:{cluster.pods[name].port('health')}"
        _wait(f"{name}'s /readyz", lambda h=health: _http(h + "/readyz")[0] == 200, cluster, 90)
        assert _http(health + "/healthz")[0] == 200
        worker_metrics = _http(health + "/metrics")[1]
        assert "cellmesh_worker_ready 1.0" in worker_metrics
        assert "cellmesh_worker_services 0.0" in worker_metrics
    return etcd


def test_rendered_pods_train_a_job_with_etcd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "podjob.yaml"
    spec.write_text(SPEC)
    files = render(RenderOptions(job=spec, workers=2, namespace="ml"))
    objects = [o for objs in files.values() for o in objs]
    secrets = _secrets(spec, tmp_path / "keys")
    with LoopbackCluster(objects, tmp_path, secrets=secrets) as cluster:
        assert sorted(cluster.pods) == [
            "podjob-coordinator-pod",
            "podjob-etcd-0",
            "podjob-worker-0",
            "podjob-worker-1",
        ]
        etcd = _start_etcd_and_workers(cluster)
        registry = connect_registry(f"etcd://127.0.0.1:{etcd.port('client')}")
        try:
            cards = {
                c.name: c
                for c in (unpack(kv.value, WorkerCard) for kv in registry.list("/cellmesh/podjob/workers/"))
            }
        finally:
            registry.close()
        assert {n: (c.rank, c.world_size, c.cpus) for n, c in cards.items()} == {
            "podjob-worker-0": (0, 2, 2),
            "podjob-worker-1": (1, 2, 2),
        }  # RANK from the pod index, CPUs from limits

        coordinator = cluster.pods["podjob-coordinator-pod"]
        cluster.start(coordinator.name)
        metrics = f"http://127.0.0.1:{coordinator.port('metrics')}"
        _wait(
            "the coordinator's record of the finished job",
            lambda: _done(metrics),
            cluster,
            150,
        )
        auth.install(auth.load_credentials(secrets["podjob-coordinator-keys"], "coordinator"))
        try:  # the control port serves the job's coordinator key only
            control = f"tcp://127.0.0.1:{coordinator.port('control')}"
            client = RpcClient(control, timeout=timedelta(seconds=10))
        finally:
            auth.install(None)
        try:
            status, _ = client.call("coordinator", "status", Empty(), RunRecord)
        finally:
            client.close()
        assert (status.phase, status.step, status.steps) == ("done", 4, 4)
        assert status.workers == ["podjob-worker-0", "podjob-worker-1"]
        assert _http(metrics + "/readyz")[0] == 200 and "cellmesh_step 4.0" in _http(metrics + "/metrics")[1]
        checkpoint = Path(status.output)
        assert checkpoint.is_file() and checkpoint.is_relative_to(tmp_path)
        record = json.loads(checkpoint.with_name("run.json").read_text())  # the run directory's
        assert record["phase"] == "done" and record["step"] == 4

        # SIGTERM, as a deletion does: the coordinator (done) and the workers (drained) exit 0
        codes = {
            name: cluster.stop(name) for name in (coordinator.name, "podjob-worker-0", "podjob-worker-1")
        }
        assert codes == dict.fromkeys(codes, 0), cluster.logs()

        # a coordinator pod restarted after the job finished finds its record and does not train again
        cluster.start(coordinator.name)
        _wait(
            "the restarted coordinator",
            lambda: _done(metrics),
            cluster,
            60,
        )
        assert cluster.stop(coordinator.name) == 0
        assert "already finished" in cluster.tail(coordinator.name), cluster.logs()

    monkeypatch.syspath_prepend(str(REPO / "examples"))  # the image's PYTHONPATH, for the reference here
    loaded = load_job(cluster.paths[SPEC_DIR] / "job.yaml")  # the spec the pods mounted
    reference = train_reference(loaded.job, 4)
    state = torch.load(checkpoint, weights_only=True)
    model = loaded.job.build_model()
    model.load_state_dict(state, strict=True)
    assert max_abs_diff(state, reference.state_dict) < FLOAT32_TOLERANCE


def test_the_workers_of_a_killed_coordinator_leave_and_its_successor_trains_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL the coordinator pod mid-training (an eviction): its workers see its presence key lapse and
    leave on their own (Kubernetes restarts them), and its successor trains the job from the start. The job
    is long enough (a step takes 1-5 ms here) for the kill to land mid-training on a loaded machine: a
    coordinator that finished closes its presence cleanly, and its workers rightly wait for the next."""
    steps = 1000
    spec = tmp_path / "podjob.yaml"
    # data parallel: both workers hold services (auto may pick one worker on a loaded machine)
    spec.write_text(SPEC.replace("steps: 4", f"steps: {steps}")
                    .replace("strategy: auto", "strategy: data_parallel"))
    objects = [o for objs in render(RenderOptions(job=spec, workers=2)).values() for o in objs]
    with LoopbackCluster(objects, tmp_path, secrets=_secrets(spec, tmp_path / "keys")) as cluster:
        _start_etcd_and_workers(cluster)
        coordinator = cluster.pods["podjob-coordinator-pod"]
        metrics = f"http://127.0.0.1:{coordinator.port('metrics')}"

        def step() -> int:
            match = re.search(r"^cellmesh_step ([0-9.]+)$", _http(metrics + "/metrics")[1], re.M)
            return int(float(match.group(1))) if match else 0

        cluster.start(coordinator.name)
        _wait("a few committed steps", lambda: step() >= 3, cluster, 150)
        cluster.procs[coordinator.name].kill()  # no cleanup, no goodbye
        cluster.procs[coordinator.name].wait(10)
        killed = time.monotonic()
        told = cluster.tail(coordinator.name, 5)
        assert f"step {steps}/{steps}" not in told and "done:" not in told, f"killed when done:\n{told}"
        assert step() == 0  # gone
        workers = ("podjob-worker-0", "podjob-worker-1")
        # the presence lapses within the job's runtime.lease_ttl_s (5 s) while the registry answers; a worker
        # whose registry answered late (a loaded machine: the whole suite on two cores) holds the deletion
        # for the outage grace and reads it at its follower's next poll ([Note: registry outages]); then it
        # drains: the request in hand for at most DRAIN_TIMEOUT, its card's deletion DEREGISTER_TIMEOUT
        most = 5 + (OUTAGE_GRACE + FOLLOW_POLL + DRAIN_TIMEOUT + DEREGISTER_TIMEOUT).total_seconds() + 10
        codes = {}
        for name in workers:
            try:
                codes[name] = cluster.procs[name].wait(max(1.0, most - (time.monotonic() - killed)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not leave within {most:.0f} s of its coordinator's kill:\n"
                            f"{cluster.logs()}")
        left = time.monotonic() - killed
        assert codes == dict.fromkeys(workers, 0), cluster.logs()
        answered = True
        for name in workers:
            last = cluster.tail(name, 3)
            assert "its coordinator" in last and "is gone" in last, cluster.logs()
            answered &= "while the registry answers" in last
        assert left < (10 if answered else most), (left, cluster.logs())

        for name in workers:
            cluster.start(name)  # as their StatefulSet restarts them
        cluster.start(coordinator.name)
        _wait(
            "the successor's finished job",
            lambda: _done(metrics),
            cluster,
            150,
        )
        assert step() == steps

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    loaded = load_job(cluster.paths[SPEC_DIR] / "job.yaml")  # the spec the pods mounted
    run_dir = tmp_path / "podjob-coordinator-pod_var_lib_cellmesh" / "podjob"  # the manifests' --run-dir
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert max_abs_diff(state, train_reference(loaded.job, steps).state_dict) < FLOAT32_TOLERANCE
