"""`cellmesh k8s render` for recovery: checkpoints on a volume all pods write, lost worker pods back in time.

The coordinator's rendered command line is read back by cellmesh's own parser and applied to the
spec in the ConfigMap, so the tests check the checkpoint policy the coordinator pod would run with.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from coordinator.commands.cli import _parser, _settings
from coordinator.commands.jobspec import JobSpecError, read_spec
from coordinator.commands.k8s.lint import Expect, lint
from coordinator.commands.k8s.options import CHECKPOINT_SECONDS, RenderOptions
from coordinator.commands.k8s.render import render
from coordinator.commands.run import DEFAULT_CHECKPOINT_SECONDS
from coordinator.commands.rundir import RunDir
from coordinator.planning.config import JobConfig
from services.host.worker import DEREGISTER_TIMEOUT, Worker
from tests.unit.coordinator.commands.test_k8s import CHARLM, _find, _objects

Manifest = dict[str, Any]
KUBELET_FIRST_BACKOFF_S = 10  # the kubelet restarts a container at once, then after 10 s, 20 s, 40 s...
WORKER_START_S = 15  # a generous bound on a worker's start: imports, registry, first card


def _pod(objects: list[Manifest], kind: str, suffix: str) -> dict[str, Any]:
    return dict(_find(objects, kind, suffix)["spec"]["template"]["spec"])


def _coordinator_config(objects: list[Manifest]) -> tuple[JobConfig, list[str]]:
    """The config the coordinator pod runs with: its rendered arguments parsed by `cellmesh`'s own
    parser, applied over the ConfigMap's spec; and those arguments."""
    container = _pod(objects, "Deployment", "-coordinator")["containers"][0]
    argv = [*container["command"][1:], *container["args"]]
    settings = _settings(_parser().parse_args(argv))
    spec = JobConfig.model_validate(yaml.safe_load(_find(objects, "ConfigMap", "-job")["data"]["job.yaml"]))
    return spec.updated(settings), container["args"]


def _claim_at(pod: dict[str, Any], directory: str) -> str | None:
    """The claim mounted (writable) where ``directory`` is, in ``pod``'s one container."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod["volumes"] if "persistentVolumeClaim" in v}
    for mount in pod["containers"][0]["volumeMounts"]:
        if PurePosixPath(directory).is_relative_to(mount["mountPath"]) and not mount.get("readOnly"):
            return claims.get(mount["name"])
    return None


def _spec(tmp_path: Path, checkpoint: dict[str, Any]) -> Path:
    data = yaml.safe_load(CHARLM.read_text())
    data["checkpoint"] = checkpoint
    path = tmp_path / "charlm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shared_checkpoints_are_on_one_volume_every_pod_writes() -> None:
    objects = _objects(render(RenderOptions(job=CHARLM, workers=4, namespace="ml", checkpoints="shared",
                                            checkpoint_size="20Gi", checkpoint_class="efs")))
    assert lint(objects, Expect(workers=4)) == []
    config, args = _coordinator_config(objects)
    directory = config.checkpoint.directory
    assert directory is not None
    # where a restarted coordinator looks first: its run directory's checkpoints/
    assert Path(directory) == RunDir(Path(config.logging.run_dir or "")).checkpoints
    assert config.checkpoint.every_seconds == DEFAULT_CHECKPOINT_SECONDS
    assert config.checkpoint.every_steps is None
    coordinator, worker = _pod(objects, "Deployment", "-coordinator"), _pod(objects, "StatefulSet", "-worker")
    claim = _find(objects, "PersistentVolumeClaim", "-checkpoints")
    assert _claim_at(coordinator, directory) == _claim_at(worker, directory) == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "efs"
    etcd = _find(objects, "StatefulSet", "-etcd")["spec"]["volumeClaimTemplates"][0]["spec"]
    assert etcd["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in etcd  # etcd keeps its own
    # one user and group in every pod: a file one writes, the others replace and delete
    contexts = [p["securityContext"] for p in (coordinator, worker)]
    assert {(c["runAsUser"], c["fsGroup"]) for c in contexts} == {(10001, 10001)}
    # the spec in the ConfigMap is the user's, unchanged: the policy travels as coordinator flags
    assert yaml.safe_load(_find(objects, "ConfigMap", "-job")["data"]["job.yaml"]).get("checkpoint") == (
        read_spec(CHARLM).model_dump(exclude_none=True).get("checkpoint"))
    assert "--checkpoint-dir" in args


def test_a_cluster_checkpoints_as_often_as_cellmesh_run_by_default() -> None:
    assert CHECKPOINT_SECONDS == DEFAULT_CHECKPOINT_SECONDS  # the parser may not import run.py (torch)


def test_the_specs_frequency_wins_and_its_directory_is_replaced(tmp_path: Path) -> None:
    spec = _spec(tmp_path, {"directory": "ckpt", "every_steps": 50, "keep": 2})
    objects = _objects(render(RenderOptions(job=spec, workers=2, checkpoints="shared")))
    assert lint(objects, Expect(workers=2)) == []
    config, args = _coordinator_config(objects)
    assert config.checkpoint.every_steps == 50 and config.checkpoint.every_seconds is None
    assert config.checkpoint.keep == 2
    assert config.checkpoint.directory == str(RunDir(Path(config.logging.run_dir or "")).checkpoints)
    assert "--checkpoint.every-seconds" not in args


def test_by_default_the_volume_is_the_coordinators_alone() -> None:
    objects = _objects(render(RenderOptions(job=CHARLM, workers=2)))
    config, args = _coordinator_config(objects)
    assert config.checkpoint.directory is None and config.checkpoint.every_seconds is None
    assert not any(a.startswith("--checkpoint") for a in args)
    claim = _find(objects, "PersistentVolumeClaim", "-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    worker = _pod(objects, "StatefulSet", "-worker")
    assert not any("persistentVolumeClaim" in v for v in worker["volumes"])
    assert _claim_at(_pod(objects, "Deployment", "-coordinator"), config.logging.run_dir or "") == (
        claim["metadata"]["name"])


def test_a_spec_with_checkpoints_needs_a_shared_volume(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path, {"directory": "/data/ckpt"})
    with pytest.raises(JobSpecError, match="--checkpoints shared"):
        render(RenderOptions(job=spec, workers=2))
    from coordinator.commands.cli import main

    assert main(["k8s", "render", str(spec), "--workers", "2", "-o", str(tmp_path / "out")]) == 2
    assert "checkpoint.directory is '/data/ckpt'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--checkpoints must be one of none, shared"):
        RenderOptions(job=CHARLM, workers=1, checkpoints="local")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--checkpoint-size '2GB'"):
        RenderOptions(job=CHARLM, workers=1, checkpoint_size="2GB")


def test_the_command_says_what_the_render_means_for_recovery(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.commands.cli import main

    assert main(["k8s", "render", str(CHARLM), "--workers", "2", "-o", str(tmp_path / "a")]) == 0
    assert "goes back to step 0" in " ".join(capsys.readouterr().out.split())
    assert main(["k8s", "render", str(CHARLM), "--workers", "2", "--checkpoints", "shared",
                 "--checkpoint-class", "nfs", "-o", str(tmp_path / "b")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the note is wrapped for a terminal
    assert f"every {DEFAULT_CHECKPOINT_SECONDS:g} s" in out and "ReadWriteMany" in out
    pvc = yaml.safe_load((tmp_path / "b" / "manifests" / "coordinator.yaml").read_text().split("---\n")[1])
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}},
                           "storageClassName": "nfs"}


def test_a_lost_worker_pod_is_back_within_the_replace_timeout() -> None:
    """The coordinator waits runtime.replace_timeout_s for a lost worker to register again: a frozen
    one is restarted, and a deleted pod made again, well within it."""
    objects = _objects(render(RenderOptions(job=CHARLM, workers=4)))
    sts = _find(objects, "StatefulSet", "-worker")
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # a pod made again waits on no other
    wait = JobConfig.model_validate(yaml.safe_load(CHARLM.read_text())).runtime.replace_timeout_s
    # a drained worker leaves before SIGKILL: Worker.drain's bound, then deregistering
    drain = inspect.signature(Worker.drain).parameters["timeout"].default + DEREGISTER_TIMEOUT
    assert drain.total_seconds() <= pod["terminationGracePeriodSeconds"]
    assert pod["terminationGracePeriodSeconds"] + WORKER_START_S <= wait
    liveness = pod["containers"][0]["livenessProbe"]
    frozen = (liveness["periodSeconds"] * liveness["failureThreshold"] + liveness["timeoutSeconds"]
              + liveness["terminationGracePeriodSeconds"])
    assert frozen + KUBELET_FIRST_BACKOFF_S + WORKER_START_S <= wait
    # every pod keeps its volumes' ownership unless their root differs: no recursive change on restart
    workloads = (("StatefulSet", "-worker"), ("Deployment", "-coordinator"), ("StatefulSet", "-etcd"))
    for kind, suffix in workloads:
        assert _pod(objects, kind, suffix)["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def _storage_mutations() -> dict[str, tuple[Callable[[list[Manifest]], None], str]]:
    def worker_mounts(objs: list[Manifest]) -> list[dict[str, Any]]:
        mounts: list[dict[str, Any]] = _pod(objs, "StatefulSet", "-worker")["containers"][0]["volumeMounts"]
        return mounts  # the manifest's own list: changes to it change the manifest

    def worker_unmounted(objs: list[Manifest]) -> None:
        mounts = worker_mounts(objs)
        mounts[:] = [m for m in mounts if m["name"] != "checkpoints"]

    def worker_read_only(objs: list[Manifest]) -> None:
        mounts = worker_mounts(objs)
        next(m for m in mounts if m["name"] == "checkpoints")["readOnly"] = True

    def one_writer(objs: list[Manifest]) -> None:
        _find(objs, "PersistentVolumeClaim", "-checkpoints")["spec"]["accessModes"] = ["ReadWriteOnce"]

    def relative(objs: list[Manifest]) -> None:
        args = _find(objs, "Deployment", "-coordinator")["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--checkpoint-dir") + 1] = "ckpt"

    return {
        "worker unmounted": (worker_unmounted, "does not mount the checkpoint directory"),
        "worker read-only": (worker_read_only, "does not mount the checkpoint directory"),
        "one writer": (one_writer, "make it ReadWriteMany"),
        "relative": (relative, "'ckpt' is relative"),
    }


@pytest.mark.parametrize("name", sorted(_storage_mutations()))
def test_lint_catches_checkpoints_the_workers_cannot_write(name: str) -> None:
    mutate, message = _storage_mutations()[name]
    objects = copy.deepcopy(_objects(render(RenderOptions(job=CHARLM, workers=3, checkpoints="shared"))))
    assert lint(objects, Expect(workers=3)) == []
    mutate(objects)
    assert any(message in p for p in lint(objects, Expect(workers=3))), lint(objects, Expect(workers=3))


def test_lint_catches_a_spec_that_checkpoints_where_only_the_coordinator_mounts() -> None:
    objects = copy.deepcopy(_objects(render(RenderOptions(job=CHARLM, workers=2))))
    config = _find(objects, "ConfigMap", "-job")
    config["data"]["job.yaml"] += "checkpoint:\n  directory: /var/lib/cellmesh/charlm/checkpoints\n"
    problems = lint(objects, Expect(workers=2))
    assert any(p.startswith("StatefulSet/charlm-worker: does not mount the checkpoint directory")
               for p in problems), problems
    assert not any(p.startswith("Deployment/") for p in problems), problems
