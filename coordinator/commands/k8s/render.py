"""``cellmesh k8s render JOB --workers N -o DIR``: the Kubernetes manifests of one job.

What it writes (``DIR/manifests/*.yaml`` and ``DIR/kustomization.yaml``, so
``kubectl apply -k DIR`` or ``kubectl apply -f DIR/manifests`` starts the job), for a job
named ``J`` (the spec's ``name``, made a DNS label):

- ``J-job`` ConfigMap: the job spec (``job.yaml``), the same file ``cellmesh run`` reads,
  with ``name: J`` and ``runtime.workers: N``;
- etcd: ``J-etcd`` headless Service and StatefulSet (1 replica, or ``--etcd-replicas 3``)
  with a PersistentVolumeClaim per member;
- the coordinator: ``J-coordinator`` Deployment of 1 (``cellmesh coordinator``, strategy
  Recreate) with a Service for its control and metrics ports and a
  ``J-checkpoints`` PersistentVolumeClaim for the final state_dict;
- the workers: ``J-worker`` StatefulSet of N (``cellmesh worker``) and the headless
  ``J-workers`` Service that gives pod ``J-worker-i`` the stable name
  ``J-worker-i.J-workers``; torchrun's and Kubeflow Trainer's variables (``RANK`` from the
  pod index, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` = worker 0, ``PET_*``);
  probes on the worker's own ``/readyz`` and ``/healthz``;
- least privilege: a ServiceAccount per role with no permissions and no mounted token
  (nothing here talks to the Kubernetes API), a NetworkPolicy per role (etcd admits the
  coordinator and the workers on its client port and its own members on the peer port;
  workers admit the coordinator on the control port and each other; the coordinator
  admits the workers), non-root containers without privilege escalation, all
  capabilities dropped and a read-only root filesystem.

Every container has requests equal to limits (CPU, memory, and ``nvidia.com/gpu`` with
``--gpus-per-worker``). ``k8s/base`` is this command's output for ``examples/charlm.yaml``
(a test keeps the two equal); ``k8s/overlays`` patch it for kustomize users.
:func:`render` returns the objects, :func:`write` writes them, ``coordinator/commands/k8s/lint.py``
checks what a schema cannot.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from coordinator.commands.jobspec import SPEC_SUFFIXES, JobSpecError, read_spec
from coordinator.planning.config import JobConfig

__all__ = [
    "IMAGE",
    "PORTS",
    "RenderOptions",
    "add_render_arguments",
    "job_name",
    "render",
    "render_command",
    "write",
]

Manifest = dict[str, Any]

VERSION = "0.1.0"
IMAGE = f"cellmesh:{VERSION}"
GPU_IMAGE = f"cellmesh:{VERSION}-cuda"
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
PORTS = {
    "etcd-client": 2379,
    "etcd-peer": 2380,
    "control": 7000,
    "metrics": 9090,
    "health": 8080,
    "dist": 29500,
}
USER_ID = 10001  # the image's cellmesh user (k8s/Dockerfile)
ETCD_USER_ID = 65532  # distroless's nonroot
APP_DIR = "/app"  # where the image installs the repository
SPEC_DIR = "/etc/cellmesh"
CHECKPOINT_DIR = "/var/lib/cellmesh"
MAX_NAME = 40  # J-worker-NNN and StatefulSet revision labels must stay within 63 characters
MANIFEST_FILES = ("serviceaccounts", "job", "etcd", "coordinator", "workers", "networkpolicies")


@dataclass(frozen=True)
class RenderOptions:
    """What to render.

    Attributes:
        job: A job spec file (``.yaml``/``.yml``/``.json``).
        workers: Worker pods (the world size).
        gpus_per_worker: ``nvidia.com/gpu`` per worker pod (0: a CPU job).
        namespace: The namespace of every object (None: kubectl's current one).
        image: The cellmesh image (``k8s/Dockerfile``) the coordinator and workers run.
        cpus_per_worker, memory_per_worker: Each worker's requests and limits.
        coordinator_cpus, coordinator_memory: The coordinator's (it profiles the model).
        etcd_replicas: etcd members (1, or 3 for a quorum that survives one loss).
        storage: Size of each etcd member's volume and of the checkpoint volume.
        storage_class: Their StorageClass (None: the cluster's default).
        python_path: Where the job's factories are in the image (``PYTHONPATH``).
    """

    job: Path
    workers: int
    gpus_per_worker: int = 0
    namespace: str | None = None
    image: str | None = None
    cpus_per_worker: int = 2
    memory_per_worker: str = "4Gi"
    coordinator_cpus: int = 1
    coordinator_memory: str = "2Gi"
    etcd_replicas: int = 1
    etcd_image: str = ETCD_IMAGE
    storage: str = "1Gi"
    storage_class: str | None = None
    python_path: str = f"{APP_DIR}/examples"

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.etcd_replicas not in (1, 3, 5):
            raise ValueError(f"--etcd-replicas must be 1, 3 or 5 (an odd quorum), got {self.etcd_replicas}")
        if self.cpus_per_worker < 1 or self.coordinator_cpus < 1:
            raise ValueError("CPU counts must be >= 1")
        if self.namespace is not None and not re.fullmatch(
            r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace
        ):
            raise ValueError(
                f"--namespace {self.namespace!r} is not a DNS label (lower case letters, digits, '-')"
            )
        for flag, value in (
            ("--memory-per-worker", self.memory_per_worker),
            ("--storage", self.storage),
            ("coordinator memory", self.coordinator_memory),
        ):
            if not re.fullmatch(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", value):
                raise ValueError(f"{flag} {value!r} is not a Kubernetes quantity (e.g. 4Gi, 512Mi, 8G)")

    @property
    def worker_image(self) -> str:
        return self.image or (GPU_IMAGE if self.gpus_per_worker else IMAGE)


def job_name(spec: JobConfig, file: Path) -> str:
    """The job's name as a DNS label: the spec's ``name`` (else the file's stem), lower case."""
    raw = (spec.name or file.stem).lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")[:MAX_NAME].strip("-")
    if not name or not name[0].isalpha():
        name = f"job-{name}".strip("-")
    return name


def _labels(job: str, component: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "cellmesh", "app.kubernetes.io/instance": job}
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return labels


def _meta(name: str, job: str, component: str | None, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = {
        **_labels(job, component),
        "app.kubernetes.io/part-of": "cellmesh",
        "app.kubernetes.io/managed-by": "cellmesh",
        "app.kubernetes.io/version": VERSION,
    }
    return meta


def _security(user: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) securityContext: non-root, no privilege, nothing writable but volumes."""
    pod = {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    return pod, container


def _resources(cpu: str | int, memory: str, gpus: int = 0) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": str(cpu), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def _http_probe(path: str, port: str, *, period: int, failures: int, delay: int = 0) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }
    if delay:
        probe["initialDelaySeconds"] = delay
    return probe


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _limit(container: str, resource: str) -> dict[str, Any]:
    return {
        "valueFrom": {"resourceFieldRef": {"containerName": container, "resource": resource, "divisor": "1"}}
    }


def _env(items: list[tuple[str, str | dict[str, Any]]]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} if isinstance(v, str) else {"name": k, **v} for k, v in items]


def _service_account(name: str, job: str, component: str, ns: str | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(name, job, component, ns),
        "automountServiceAccountToken": False,
    }


def _claim(o: RenderOptions) -> dict[str, Any]:
    """A PersistentVolumeClaim's spec: one writer, ``storage`` of the StorageClass asked for."""
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": o.storage}},
    }
    if o.storage_class:
        claim["storageClassName"] = o.storage_class
    return claim


def _service(
    name: str, job: str, component: str, ns: str | None, ports: dict[str, str], *, headless: bool = False
) -> Manifest:
    """A Service selecting ``component``'s pods; ``ports`` maps port names to :data:`PORTS` keys.

    A headless one gives each pod a stable DNS name, ready or not (peers find each other
    while they start)."""
    spec: dict[str, Any] = {"clusterIP": "None", "publishNotReadyAddresses": True} if headless else {}
    spec["selector"] = _labels(job, component)
    spec["ports"] = [{"name": p, "port": PORTS[key], "targetPort": p} for p, key in ports.items()]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, job, component, ns), "spec": spec}


def _pod_spec(
    account: str,
    security: dict[str, Any],
    container: dict[str, Any],
    *,
    volumes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A pod running ``container`` as ``account`` (no API token), with ``volumes``."""
    pod: dict[str, Any] = {
        "serviceAccountName": account,
        "automountServiceAccountToken": False,
        "securityContext": security,
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
    }
    if volumes is not None:
        pod["volumes"] = volumes
    return pod


def _tmp_volume() -> dict[str, Any]:
    return {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}


class _Names:
    def __init__(self, job: str) -> None:
        self.job = job
        self.etcd = f"{job}-etcd"
        self.coordinator = f"{job}-coordinator"
        self.worker = f"{job}-worker"
        self.workers_svc = f"{job}-workers"
        self.config = f"{job}-job"
        self.checkpoints = f"{job}-checkpoints"

    @property
    def registry(self) -> str:
        return f"etcd://{self.etcd}:{PORTS['etcd-client']}"

    @property
    def master(self) -> str:
        return f"{self.worker}-0.{self.workers_svc}"


def _spec_text(spec: JobConfig, job: str, workers: int, source: Path) -> str:
    data = spec.updated({"name": job, "runtime.workers": workers}).model_dump(exclude_none=True)
    header = (
        f"# The job spec of {job}, rendered by `cellmesh k8s render` from {source.name}: the same spec\n"
        f"# `cellmesh run` reads. Factories are imported from PYTHONPATH in the image.\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False)


def _etcd(o: RenderOptions, n: _Names) -> list[Manifest]:
    ns, job = o.namespace, n.job
    pod_sc, sc = _security(ETCD_USER_ID)
    members = ",".join(
        f"{n.etcd}-{i}=http://{n.etcd}-{i}.{n.etcd}:{PORTS['etcd-peer']}" for i in range(o.etcd_replicas)
    )
    service = _service(n.etcd, job, "etcd", ns, {"client": "etcd-client", "peer": "etcd-peer"}, headless=True)
    container = {
        "name": "etcd",
        "image": o.etcd_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["etcd"],
        "args": [
            "--name=$(POD_NAME)",
            "--data-dir=/var/lib/etcd/data",
            f"--listen-client-urls=http://0.0.0.0:{PORTS['etcd-client']}",
            f"--advertise-client-urls=http://$(POD_NAME).{n.etcd}:{PORTS['etcd-client']}",
            f"--listen-peer-urls=http://0.0.0.0:{PORTS['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://$(POD_NAME).{n.etcd}:{PORTS['etcd-peer']}",
            f"--initial-cluster-token={n.etcd}",
            "--initial-cluster-state=new",
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=1h",
        ],
        "env": _env([("POD_NAME", _field("metadata.name")), ("ETCD_INITIAL_CLUSTER", members)]),
        "ports": [
            {"name": "client", "containerPort": PORTS["etcd-client"], "protocol": "TCP"},
            {"name": "peer", "containerPort": PORTS["etcd-peer"], "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "readinessProbe": _http_probe("/health", "client", period=5, failures=3),
        "livenessProbe": _http_probe(
            "/health?exclude=NOSPACE&serializable=true", "client", period=10, failures=6, delay=15
        ),
        "securityContext": sc,
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(n.etcd, job, "etcd", ns),
        "spec": {
            "serviceName": n.etcd,
            "replicas": o.etcd_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(job, "etcd")},
            "template": {
                "metadata": {"labels": _labels(job, "etcd")},
                "spec": _pod_spec(n.etcd, pod_sc, container),
            },
            "volumeClaimTemplates": [
                {"metadata": {"name": "data", "labels": _labels(job, "etcd")}, "spec": _claim(o)}
            ],
        },
    }
    return [service, stateful]


def _coordinator(o: RenderOptions, n: _Names) -> list[Manifest]:
    ns, job = o.namespace, n.job
    pod_sc, sc = _security(USER_ID)
    labels = _labels(job, "coordinator")
    service = _service(n.coordinator, job, "coordinator", ns, {"control": "control", "metrics": "metrics"})
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(n.checkpoints, job, "coordinator", ns),
        "spec": _claim(o),
    }
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
            f"{CHECKPOINT_DIR}/{job}",
            "--progress",
            "lines",
        ],
        "env": _env(
            [
                ("CELLMESH_HOST", _field("status.podIP")),
                ("PYTHONPATH", o.python_path),
                ("OMP_NUM_THREADS", _limit("coordinator", "limits.cpu")),
                ("CELLMESH_LOG_LEVEL", "INFO"),
            ]
        ),
        "ports": [
            {"name": "control", "containerPort": PORTS["control"], "protocol": "TCP"},
            {"name": "metrics", "containerPort": PORTS["metrics"], "protocol": "TCP"},
        ],
        "resources": _resources(o.coordinator_cpus, o.coordinator_memory),
        "readinessProbe": _http_probe("/readyz", "metrics", period=5, failures=3),
        "livenessProbe": _http_probe("/healthz", "metrics", period=10, failures=3),
        "startupProbe": _http_probe("/healthz", "metrics", period=2, failures=60),
        "securityContext": sc,
        "volumeMounts": [
            {"name": "job", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(n.coordinator, job, "coordinator", ns),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": _pod_spec(
                    n.coordinator,
                    pod_sc,
                    container,
                    volumes=[
                        {"name": "job", "configMap": {"name": n.config}},
                        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": n.checkpoints}},
                        _tmp_volume(),
                    ],
                ),
            },
        },
    }
    return [service, pvc, deployment]


def _workers(o: RenderOptions, n: _Names) -> list[Manifest]:
    ns, job = o.namespace, n.job
    pod_sc, sc = _security(USER_ID)
    labels = _labels(job, "worker")
    service = _service(
        n.workers_svc, job, "worker", ns, {"control": "control", "dist": "dist"}, headless=True
    )
    world, master, port = str(o.workers), n.master, str(PORTS["dist"])
    env = _env(
        [
            ("POD_NAME", _field("metadata.name")),
            ("CELLMESH_HOST", _field("status.podIP")),
            ("RANK", _field("metadata.labels['apps.kubernetes.io/pod-index']")),
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
            ("CELLMESH_CPUS", _limit("worker", "limits.cpu")),
            ("CELLMESH_MEMORY_BYTES", _limit("worker", "limits.memory")),
            ("OMP_NUM_THREADS", _limit("worker", "limits.cpu")),
            ("PYTHONPATH", o.python_path),
            ("CELLMESH_LOG_LEVEL", "INFO"),
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
        ],
        "env": env,
        "ports": [
            {"name": "control", "containerPort": PORTS["control"], "protocol": "TCP"},
            {"name": "health", "containerPort": PORTS["health"], "protocol": "TCP"},
            {"name": "dist", "containerPort": PORTS["dist"], "protocol": "TCP"},
        ],
        "resources": _resources(o.cpus_per_worker, o.memory_per_worker, o.gpus_per_worker),
        "readinessProbe": _http_probe("/readyz", "health", period=5, failures=3),
        "livenessProbe": _http_probe("/healthz", "health", period=10, failures=3),
        "startupProbe": _http_probe("/healthz", "health", period=2, failures=60),
        "securityContext": sc,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod = _pod_spec(n.worker, pod_sc, container, volumes=[_tmp_volume()])
    if o.gpus_per_worker:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(n.worker, job, "worker", ns),
        "spec": {
            "serviceName": n.workers_svc,
            "replicas": o.workers,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    return [service, stateful]


def _policies(o: RenderOptions, n: _Names) -> list[Manifest]:
    ns, job = o.namespace, n.job

    def peers(*components: str) -> list[dict[str, Any]]:
        return [{"podSelector": {"matchLabels": _labels(job, c)}} for c in components]

    def policy(component: str, ingress: list[dict[str, Any]]) -> Manifest:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(f"{job}-{component}", job, component, ns),
            "spec": {
                "podSelector": {"matchLabels": _labels(job, component)},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    def tcp(*ports: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": p} for p in ports]

    return [
        policy(
            "etcd",
            [
                {"from": peers("coordinator", "worker"), "ports": tcp(PORTS["etcd-client"])},
                {"from": peers("etcd"), "ports": tcp(PORTS["etcd-client"], PORTS["etcd-peer"])},
            ],
        ),
        policy("coordinator", [{"from": peers("worker"), "ports": tcp(PORTS["control"], PORTS["metrics"])}]),
        # workers reach each other on the ports their collectives pick (gloo and ZeroMQ bind free ports)
        policy(
            "worker",
            [{"from": peers("coordinator"), "ports": tcp(PORTS["control"])}, {"from": peers("worker")}],
        ),
    ]


def render(options: RenderOptions) -> dict[str, list[Manifest]]:
    """The job's objects, by file (``serviceaccounts``, ``job``, ``etcd``, ``coordinator``, ``workers``,
    ``networkpolicies``).

    Raises:
        JobSpecError: ``options.job`` is not a valid job spec file.
    """
    file = options.job
    if file.suffix not in SPEC_SUFFIXES:
        raise JobSpecError(
            f"{file}: `cellmesh k8s render` takes a job spec ({', '.join(SPEC_SUFFIXES)}), which "
            "goes into a ConfigMap; a job module (.py) must be in the image instead: write a spec "
            "that names its factories"
        )
    if not file.is_file():
        raise JobSpecError(f"job spec {str(file)!r} does not exist")
    spec = read_spec(file)
    job = job_name(spec, file)
    n = _Names(job)
    ns = options.namespace
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(n.config, job, "coordinator", ns),
        "data": {"job.yaml": _spec_text(spec, job, options.workers, file)},
    }
    return {
        "serviceaccounts": [
            _service_account(n.etcd, job, "etcd", ns),
            _service_account(n.coordinator, job, "coordinator", ns),
            _service_account(n.worker, job, "worker", ns),
        ],
        "job": [config],
        "etcd": _etcd(options, n),
        "coordinator": _coordinator(options, n),
        "workers": _workers(options, n),
        "networkpolicies": _policies(options, n),
    }


class _Dumper(yaml.SafeDumper):
    """Plain YAML: a label map used twice is written twice, not as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(objects: list[Manifest]) -> str:
    """The objects as one multi-document YAML text."""
    return "---\n".join(yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120) for obj in objects)


def write(files: dict[str, list[Manifest]], directory: Path, namespace: str | None = None) -> list[Path]:
    """Write ``directory/manifests/{file}.yaml`` and ``directory/kustomization.yaml``; return the paths."""
    manifests = directory / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in files.items():
        path = manifests / f"{name}.yaml"
        path.write_text(dump(objects))
        written.append(path)
    kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    if namespace is not None:
        kustomization["namespace"] = namespace
    kustomization["resources"] = [f"manifests/{name}.yaml" for name in files]
    path = directory / "kustomization.yaml"
    path.write_text(
        "# Rendered by `cellmesh k8s render`: kubectl apply -k .\n"
        + yaml.safe_dump(kustomization, sort_keys=False)
    )
    return [*written, path]


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", type=Path, help="a job spec (.yaml/.yml/.json)")
    parser.add_argument("--workers", type=int, required=True, metavar="N", help="worker pods")
    parser.add_argument(
        "--gpus-per-worker", type=int, default=0, metavar="G", help="nvidia.com/gpu per worker"
    )
    parser.add_argument("--namespace", default=None, metavar="NS", help="namespace of every object")
    parser.add_argument(
        "--image",
        default=None,
        help=f"the cellmesh image (default {IMAGE}; {GPU_IMAGE} for the workers with GPUs)",
    )
    parser.add_argument("--cpus-per-worker", type=int, default=2, metavar="C", help="CPU request = limit (2)")
    parser.add_argument(
        "--memory-per-worker", default="4Gi", metavar="M", help="memory request = limit (4Gi)"
    )
    parser.add_argument("--etcd-replicas", type=int, default=1, choices=[1, 3, 5], help="etcd members (1)")
    parser.add_argument(
        "--storage",
        default="1Gi",
        metavar="SIZE",
        help="size of each etcd member's volume and of the checkpoint volume (1Gi)",
    )
    parser.add_argument("--storage-class", default=None, help="StorageClass of the volumes (cluster default)")
    parser.add_argument(
        "--python-path",
        default=f"{APP_DIR}/examples",
        help="PYTHONPATH in the image, where the job's factories are (default /app/examples)",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="directory to write")


def render_command(args: argparse.Namespace) -> int:
    """``cellmesh k8s render``: returns the exit code (2 with a message for bad input)."""
    try:
        options = RenderOptions(
            job=args.job,
            workers=args.workers,
            gpus_per_worker=args.gpus_per_worker,
            namespace=args.namespace,
            image=args.image,
            cpus_per_worker=args.cpus_per_worker,
            memory_per_worker=args.memory_per_worker,
            etcd_replicas=args.etcd_replicas,
            storage=args.storage,
            storage_class=args.storage_class,
            python_path=args.python_path,
        )
        files = render(options)
    except (JobSpecError, ValueError) as exc:
        print(f"cellmesh: error: {exc}", file=sys.stderr)
        return 2
    paths = write(files, args.output, options.namespace)
    job = files["job"][0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    print(
        f"wrote {len(paths)} files to {args.output} for job {job} ({options.workers} workers"
        f"{f', {options.gpus_per_worker} GPUs each' if options.gpus_per_worker else ''}); start it with\n"
        f"  kubectl apply -k {args.output}\nand follow it with\n"
        f"  kubectl logs -f deployment/{job}-coordinator"
        + (f" -n {options.namespace}" if options.namespace else "")
    )
    return 0
