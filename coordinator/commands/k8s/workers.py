"""The job's workers: a StatefulSet of N pods and the headless Service that names them.

Each pod gets torchrun's and Kubeflow Trainer's variables (``RANK`` from the pod index,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` = worker 0, ``PET_*``) and probes on the
worker's own ``/readyz`` and ``/healthz``. It mounts the job's spec (the ConfigMap the
coordinator reads) and is started with ``--job-spec``: a worker builds only the factories that
spec names (``services/factories.py``).
"""

from __future__ import annotations

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
from coordinator.commands.k8s.options import KEYS_DIR, PORTS, SPEC_DIR, USER_ID, RenderOptions

__all__ = ["worker_objects"]


def worker_objects(o: RenderOptions, n: Names) -> list[Manifest]:
    """The headless ``J-workers`` Service (pod ``J-worker-i`` is ``J-worker-i.J-workers``), ``J-worker``."""
    ns, job = o.namespace, n.job
    pod_sc, sc = security(USER_ID)
    selected = labels(job, "worker")
    svc = service(
        n.workers_svc, job, "worker", ns, {"control": "control", "dist": "dist"}, headless=True
    )
    world, master, port = str(o.workers), n.master, str(PORTS["dist"])
    variables = env(
        [
            ("POD_NAME", field("metadata.name")),
            ("CELLMESH_HOST", field("status.podIP")),
            ("RANK", field("metadata.labels['apps.kubernetes.io/pod-index']")),
            ("WORLD_SIZE", world),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", master),
            ("MASTER_PORT", port),
            ("PET_NNODES", world),
            ("PET_NODE_RANK", "$(RANK)"),
            ("PET_NPROC_PER_NODE", "1"),
            ("PET_MASTER_ADDR", master),
            ("PET_MASTER_PORT", port),
            ("PET_RDZV_BACKEND", "etcd"),
            ("PET_RDZV_ENDPOINT", f"{n.etcd}:{PORTS['etcd-client']}"),
            ("PET_RDZV_ID", job),
            ("CELLMESH_CPUS", limit("worker", "limits.cpu")),
            ("CELLMESH_MEMORY_BYTES", limit("worker", "limits.memory")),
            ("OMP_NUM_THREADS", limit("worker", "limits.cpu")),
            ("PYTHONPATH", o.python_path),
            ("CELLMESH_LOG_LEVEL", "INFO"),
            ("CELLMESH_KEYS_DIR", KEYS_DIR),
        ]
    )
    container = {
        "name": "worker",
        "image": o.worker_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["cellmesh", "worker"],
        "args": [
            "--registry",
            n.registry,
            "--job",
            job,
            "--name",
            "$(POD_NAME)",
            "--port",
            str(PORTS["control"]),
            "--health-port",
            str(PORTS["health"]),
            "--lease-ttl",
            "10",
            "--job-spec",  # the factories it may build: those of this job's spec
            f"{SPEC_DIR}/job.yaml",
        ],
        "env": variables,
        "ports": [
            {"name": "control", "containerPort": PORTS["control"], "protocol": "TCP"},
            {"name": "health", "containerPort": PORTS["health"], "protocol": "TCP"},
            {"name": "dist", "containerPort": PORTS["dist"], "protocol": "TCP"},
        ],
        "resources": resources(o.cpus_per_worker, o.memory_per_worker, o.gpus_per_worker),
        "readinessProbe": http_probe("/readyz", "health", period=5, failures=3),
        "livenessProbe": http_probe("/healthz", "health", period=10, failures=3),
        "startupProbe": http_probe("/healthz", "health", period=2, failures=60),
        "securityContext": sc,
        "volumeMounts": [{"name": "job", "mountPath": SPEC_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}],
    }
    volumes = [{"name": "job", "configMap": {"name": n.config}}, tmp_volume(), keys_volume(n.worker_keys)]
    pod = pod_spec(n.worker, pod_sc, container, volumes=volumes)
    if o.gpus_per_worker:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(n.worker, job, "worker", ns),
        "spec": {
            "serviceName": n.workers_svc,
            "replicas": o.workers,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selected},
            "template": {"metadata": {"labels": selected}, "spec": pod},
        },
    }
    return [svc, stateful]
