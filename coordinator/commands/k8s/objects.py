"""The parts every rendered Kubernetes object is built of: names, labels, security, probes, env, pods.

One place decides what all objects of a render share (the labels selectors match, the
least-privilege security contexts, requests equal to limits), so the builders of each
kind (``etcd.py``, ``coordinator.py``, ``workers.py``, ``policies.py``) only say what is
theirs.
"""

from __future__ import annotations

from typing import Any

from coordinator.commands.k8s.options import PORTS, VERSION

__all__ = [
    "Manifest",
    "Names",
    "claim",
    "env",
    "field",
    "http_probe",
    "keys_volume",
    "labels",
    "limit",
    "meta",
    "pod_spec",
    "resources",
    "security",
    "service",
    "tmp_volume",
]

Manifest = dict[str, Any]


class Names:
    """The names of one job's objects, all derived from the job's DNS label."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.etcd = f"{job}-etcd"
        self.coordinator = f"{job}-coordinator"
        self.worker = f"{job}-worker"
        self.workers_svc = f"{job}-workers"
        self.config = f"{job}-job"
        self.checkpoints = f"{job}-checkpoints"
        self.coordinator_keys = f"{job}-coordinator-keys"  # Secrets: made by the user, never rendered
        self.worker_keys = f"{job}-worker-keys"

    @property
    def registry(self) -> str:
        return f"etcd://{self.etcd}:{PORTS['etcd-client']}"

    @property
    def master(self) -> str:
        return f"{self.worker}-0.{self.workers_svc}"


def labels(job: str, component: str | None = None) -> dict[str, str]:
    """The labels selectors match on: the job, and the component when given."""
    found = {"app.kubernetes.io/name": "cellmesh", "app.kubernetes.io/instance": job}
    if component is not None:
        found["app.kubernetes.io/component"] = component
    return found


def meta(name: str, job: str, component: str | None, namespace: str | None) -> dict[str, Any]:
    """An object's metadata: its name, namespace and the recommended labels."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    metadata["labels"] = {
        **labels(job, component),
        "app.kubernetes.io/part-of": "cellmesh",
        "app.kubernetes.io/managed-by": "cellmesh",
        "app.kubernetes.io/version": VERSION,
    }
    return metadata


def security(user: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) securityContext: non-root, no privilege, nothing writable but volumes.

    The volumes belong to group ``user`` (``fsGroup``, where the volume's driver applies it), changed
    only when their root is not yet: a recursive change over every checkpoint file would delay each
    restarted pod, and the coordinator waits a bounded time for a replaced worker."""
    pod = {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "fsGroupChangePolicy": "OnRootMismatch",
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


def resources(cpu: str | int, memory: str, gpus: int = 0) -> dict[str, Any]:
    """Requests equal to limits (the Guaranteed QoS class)."""
    limits: dict[str, Any] = {"cpu": str(cpu), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def http_probe(
    path: str, port: str, *, period: int, failures: int, delay: int = 0, grace: int | None = None
) -> dict[str, Any]:
    """An HTTP probe; ``grace``: the seconds a container this (liveness) probe fails gets to stop
    before it is killed (None: the pod's ``terminationGracePeriodSeconds``)."""
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }
    if delay:
        probe["initialDelaySeconds"] = delay
    if grace is not None:
        probe["terminationGracePeriodSeconds"] = grace
    return probe


def field(path: str) -> dict[str, Any]:
    """An env value from the pod's own fields (downward API)."""
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def limit(container: str, resource: str) -> dict[str, Any]:
    """An env value from a container's resource limit (downward API)."""
    return {
        "valueFrom": {"resourceFieldRef": {"containerName": container, "resource": resource, "divisor": "1"}}
    }


def env(items: list[tuple[str, str | dict[str, Any]]]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} if isinstance(v, str) else {"name": k, **v} for k, v in items]


def claim(size: str, storage_class: str | None, access: str = "ReadWriteOnce") -> dict[str, Any]:
    """A PersistentVolumeClaim's spec: ``size`` of ``storage_class`` (None: the cluster's default),
    mounted by the pods of one node (``ReadWriteOnce``) or of any (``ReadWriteMany``)."""
    spec: dict[str, Any] = {"accessModes": [access], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return spec


def service(
    name: str, job: str, component: str, ns: str | None, ports: dict[str, str], *, headless: bool = False
) -> Manifest:
    """A Service selecting ``component``'s pods; ``ports`` maps port names to :data:`PORTS` keys.

    A headless one gives each pod a stable DNS name, ready or not (peers find each other
    while they start)."""
    spec: dict[str, Any] = {"clusterIP": "None", "publishNotReadyAddresses": True} if headless else {}
    spec["selector"] = labels(job, component)
    spec["ports"] = [{"name": p, "port": PORTS[key], "targetPort": p} for p, key in ports.items()]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, job, component, ns), "spec": spec}


def pod_spec(
    account: str,
    pod_security: dict[str, Any],
    container: dict[str, Any],
    *,
    volumes: list[dict[str, Any]] | None = None,
    grace: int = 30,
) -> dict[str, Any]:
    """A pod running ``container`` as ``account`` (no API token), with ``volumes``; ``grace``: the
    seconds it gets between SIGTERM and SIGKILL."""
    pod: dict[str, Any] = {
        "serviceAccountName": account,
        "automountServiceAccountToken": False,
        "securityContext": pod_security,
        "terminationGracePeriodSeconds": grace,
        "containers": [container],
    }
    if volumes is not None:
        pod["volumes"] = volumes
    return pod


def keys_volume(secret: str) -> dict[str, Any]:
    """The job's keys (a Secret the user created from `cellmesh keys`), readable by the pod's user only."""
    return {"name": "keys", "secret": {"secretName": secret, "defaultMode": 0o400}}


def tmp_volume() -> dict[str, Any]:
    """The writable ``/tmp`` of a container whose root filesystem is read-only."""
    return {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
