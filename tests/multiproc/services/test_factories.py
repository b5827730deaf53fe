"""A worker builds only its job's factories, whoever asks: job B's and ``os:system`` are refused unimported.

The worker runs with the job's keys, and the test process assigns as the coordinator (the
key allowed to assign): authentication passes, the allow-list still refuses. Job B's module
writes a marker file when imported, so "nothing was imported" is a fact on disk, not a
message; ``os:system`` is asked to create a file, which must not appear.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm import auth
from comm.rpc import RpcClient, RpcError
from services.protocol import Assignment, AssignmentReply, Empty, WorkerStatus
from tests.harness.workers import WorkerProcess, registry_server, start_worker

pytestmark = pytest.mark.timeout(90)

JOB_MODULE = '''\
import torch
from torch import nn

def model():
    return [nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)]

def data():
    return torch.randn(8, 3), torch.randn(8, 1)

def loss():
    return nn.MSELoss()
'''


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two jobs' modules (B's marks its import) and job A's spec file; names of the modules."""
    root = tmp_path_factory.mktemp("factories")
    tag = uuid.uuid4().hex[:8]
    a, b = f"job_a_{tag}", f"job_b_{tag}"
    (root / f"{a}.py").write_text(JOB_MODULE)
    marker = root / "job_b_imported"
    (root / f"{b}.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + JOB_MODULE)
    spec = root / "job_a.yaml"
    spec.write_text(f"name: job-a\nmodel: {{factory: '{a}:model'}}\ndata: {{factory: '{a}:data'}}\n"
                    f"loss: {{factory: '{a}:loss'}}\n")
    return {"a": a, "b": b, "root": str(root), "spec": str(spec), "marker": str(marker)}


@pytest.fixture(scope="module")
def worker(jobs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A worker of job A with the job's keys; this process holds the coordinator's."""
    keys = auth.JobKeys.generate()
    keys_dir = tmp_path_factory.mktemp("keys")
    keys.for_workers().save(keys_dir)
    auth.install(auth.Credentials(keys, "coordinator"))
    try:
        with registry_server() as server:
            env = {auth.KEYS_DIR_ENV: str(keys_dir),
                   "PYTHONPATH": os.pathsep.join([jobs["root"], os.environ.get("PYTHONPATH", "")])}
            w = start_worker(server.address, "job-a", "a0", job_spec=jobs["spec"], env=env, insecure=False)
            try:
                yield w
            finally:
                w.stop()
    finally:
        auth.install(None)


def _assign(client: RpcClient, service: str, model: str, data: str, loss: str,
            kwargs: dict[str, str] | None = None) -> AssignmentReply:
    options = dict(stage=0, num_stages=1, data=data, loss=loss, factory_kwargs=kwargs or {})
    reply, _ = client.call("worker", "assign", Assignment(service=service, kind="compute", factory=model,
                                                          nodes=[0, 3], options=options), AssignmentReply)
    return reply


def test_refuses_other_jobs_and_system_factories_unimported_and_keeps_serving(
        worker: WorkerProcess, jobs: dict[str, str], tmp_path: Path) -> None:
    a, b = jobs["a"], jobs["b"]
    touched = tmp_path / "os_system_ran"
    refused = {
        f"{b}:model": (f"{b}:model", f"{a}:data", f"{a}:loss", None),
        f"{b}:data": (f"{a}:model", f"{b}:data", f"{a}:loss", None),  # a foreign name in any field
        "os:system": ("os:system", f"{a}:data", f"{a}:loss", {"command": f"touch {touched}"}),
    }
    with RpcClient(worker.address) as client:
        for name, (model, data, loss, kwargs) in refused.items():
            with pytest.raises(RpcError) as err:
                _assign(client, "foreign", model, data, loss, kwargs)
            assert err.value.code == "bad_request"
            assert f"{name!r} is not a factory of this worker's job" in err.value.message, err.value
            assert f"{a}:model" in err.value.message and jobs["spec"] in err.value.message, err.value
        assert not Path(jobs["marker"]).exists(), "job B's module was imported"
        assert not touched.exists(), "os.system ran"
        # still serving, and it builds its own job's factories
        reply = _assign(client, "own", f"{a}:model", f"{a}:data", f"{a}:loss")
        assert reply.address == worker.address
        status, _ = client.call("worker", "status", Empty(), WorkerStatus)
        assert status.services == ["own"]
    assert worker.proc.poll() is None
