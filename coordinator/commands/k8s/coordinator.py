"""The job's coordinator: a Deployment of one, its Service, and the volume of its run directory."""

from __future__ import annotations

from coordinator.commands.k8s.checkpoints import (
    checkpoint_claim,
    checkpoint_flags,
    checkpoint_mount,
    checkpoint_volume,
    run_dir,
)
from coordinator.commands.k8s.objects import (
    Manifest,
    Names,
    env,
    field,
    http_probe,
    keys_volume,
    labels,
    limit,
    meta,
    pod_spec,
    resources,
    security,
    service,
    tmp_volume,
)
from coordinator.commands.k8s.options import IMAGE, KEYS_DIR, PORTS, SPEC_DIR, USER_ID, RenderOptions
from coordinator.planning.config import JobConfig

__all__ = ["coordinator_objects"]


def coordinator_objects(o: RenderOptions, n: Names, spec: JobConfig) -> list[Manifest]:
    """``J-coordinator`` (Service and Deployment, strategy Recreate) and the ``J-checkpoints`` claim its
    run directory is on (and, with ``--checkpoints shared``, its checkpoints: ``checkpoints.py``)."""
    ns, job = o.namespace, n.job
    pod_sc, sc = security(USER_ID)
    selected = labels(job, "coordinator")
    svc = service(n.coordinator, job, "coordinator", ns, {"control": "control", "metrics": "metrics"})
    container = {
        "name": "coordinator",
        "image": o.image or IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["cellmesh", "coordinator", f"{SPEC_DIR}/job.yaml"],
        "args": [
            "--registry",
            n.registry,
            "--workers",
            str(o.workers),
            "--port",
            str(PORTS["control"]),
            "--metrics-port",
            str(PORTS["metrics"]),
            "--run-dir",  # stable, on the volume: a restarted coordinator finds its finished run there
            run_dir(job),
            "--progress",
            "lines",
            *checkpoint_flags(o, spec, job),
        ],
        "env": env(
            [
                ("CELLMESH_HOST", field("status.podIP")),
                ("PYTHONPATH", o.python_path),
                ("OMP_NUM_THREADS", limit("coordinator", "limits.cpu")),
                ("CELLMESH_LOG_LEVEL", "INFO"),
                ("CELLMESH_KEYS_DIR", KEYS_DIR),
            ]
        ),
        "ports": [
            {"name": "control", "containerPort": PORTS["control"], "protocol": "TCP"},
            {"name": "metrics", "containerPort": PORTS["metrics"], "protocol": "TCP"},
        ],
        "resources": resources(o.coordinator_cpus, o.coordinator_memory),
        "readinessProbe": http_probe("/readyz", "metrics", period=5, failures=3),
        "livenessProbe": http_probe("/healthz", "metrics", period=10, failures=3),
        "startupProbe": http_probe("/healthz", "metrics", period=2, failures=60),
        "securityContext": sc,
        "volumeMounts": [
            {"name": "job", "mountPath": SPEC_DIR, "readOnly": True},
            checkpoint_mount(),
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(n.coordinator, job, "coordinator", ns),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selected},
            "template": {
                "metadata": {"labels": selected},
                "spec": pod_spec(
                    n.coordinator,
                    pod_sc,
                    container,
                    volumes=[
                        {"name": "job", "configMap": {"name": n.config}},
                        checkpoint_volume(n),
                        tmp_volume(),
                        keys_volume(n.coordinator_keys),
                    ],
                ),
            },
        },
    }
    return [svc, checkpoint_claim(o, n), deployment]
