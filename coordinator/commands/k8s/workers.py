"""The job's workers: a StatefulSet of N pods and the headless Service that names them.

Each pod gets torchrun's and Kubeflow Trainer's variables (``RANK`` from the pod index,
``WORLD_SIZE``, ``LOCAL_RANK=0``, ``MASTER_ADDR``/``MASTER_PORT`` = worker 0, ``PET_*``) and probes on the
worker's own ``/readyz`` and ``/healthz``. It mounts the job's spec (the ConfigMap the
coordinator reads) and is started with ``--job-spec``: a worker builds only the factories that
spec names (``services/factories.py``). With ``--checkpoints shared`` it mounts the checkpoint
volume where the coordinator does, and writes its parts of each checkpoint there.

GPUs (``--gpus-per-worker``): the pod requests ``nvidia.com/gpu`` and tolerates the taint GPU nodes
carry. The NVIDIA device plugin gives the container only its own GPUs, numbered from 0, so
``CUDA_VISIBLE_DEVICES`` is left unset and ``LOCAL_RANK=0`` puts the worker's stage on the first of
them (a worker runs on one GPU: more per pod give it nothing but their memory on the node's books).

[Note: a lost worker pod comes back within the replace timeout]
A lost worker is waited for ``runtime.replace_timeout_s`` (60 s by default) before the coordinator
plans without it (``ClusterWorkers.replace``); the pod must be back under its name before then:

- its process dies (a crash, an OOM kill): the kubelet restarts the container in the same pod at
  once the first time, then after 10 s, 20 s, 40 s... (the back-off resets after 10 minutes of run);
- it freezes: the liveness probe fails after :data:`LIVENESS_PERIOD` x :data:`LIVENESS_FAILURES`
  seconds, and the frozen process, which cannot drain, is killed :data:`LIVENESS_GRACE` seconds later;
- the pod is deleted or evicted: the StatefulSet (``podManagementPolicy: Parallel``, so no other pod
  waits on it) makes it again once the old one is gone: the worker drains on SIGTERM within
  ``Worker.drain``'s bound, and :data:`GRACE` seconds cap a pod that does not (a frozen one).

A node that is lost keeps its pods Terminating until Kubernetes learns they are gone (the node
deleted, or ``kubectl delete pod --force``): then the coordinator goes on without the worker and
takes it back when the StatefulSet has made it again.
"""

from __future__ import annotations

from coordinator.commands.k8s.checkpoints import checkpoint_mount, checkpoint_volume
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

__all__ = ["GRACE", "LIVENESS_FAILURES", "LIVENESS_GRACE", "LIVENESS_PERIOD", "worker_objects"]

GRACE = 15  # seconds from SIGTERM to SIGKILL: a drain takes at most 13 (Worker.drain: 10 + deregistering 3)
LIVENESS_PERIOD, LIVENESS_FAILURES = 5, 3  # a frozen worker is restarted after 15 s
LIVENESS_GRACE = 5  # a worker that fails its liveness probe is frozen: nothing to drain


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
            ("LOCAL_RANK", "0"),  # one process per pod: a GPU stage runs on cuda:0, the pod's (first) GPU
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
    mounts = [
        {"name": "job", "mountPath": SPEC_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
    ]
    volumes = [{"name": "job", "configMap": {"name": n.config}}, tmp_volume(), keys_volume(n.worker_keys)]
    if o.checkpoints == "shared":  # each worker writes its parts of every checkpoint
        mounts.append(checkpoint_mount())
        volumes.append(checkpoint_volume(n))
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
        "livenessProbe": http_probe(
            "/healthz", "health", period=LIVENESS_PERIOD, failures=LIVENESS_FAILURES, grace=LIVENESS_GRACE
        ),
        "startupProbe": http_probe("/healthz", "health", period=2, failures=60),
        "securityContext": sc,
        "volumeMounts": mounts,
    }
    pod = pod_spec(n.worker, pod_sc, container, volumes=volumes, grace=GRACE)
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
