"""The job's etcd: a headless Service and a StatefulSet of 1, 3 or 5 members, a volume each."""

from __future__ import annotations

from coordinator.commands.k8s.objects import (
    Manifest,
    Names,
    claim,
    env,
    field,
    http_probe,
    labels,
    meta,
    pod_spec,
    security,
    service,
)
from coordinator.commands.k8s.options import ETCD_USER_ID, PORTS, RenderOptions

__all__ = ["etcd_objects"]


def etcd_objects(o: RenderOptions, n: Names) -> list[Manifest]:
    """``J-etcd``: the headless Service (stable member names) and the StatefulSet."""
    ns, job = o.namespace, n.job
    pod_sc, sc = security(ETCD_USER_ID)
    members = ",".join(
        f"{n.etcd}-{i}=http://{n.etcd}-{i}.{n.etcd}:{PORTS['etcd-peer']}" for i in range(o.etcd_replicas)
    )
    svc = service(n.etcd, job, "etcd", ns, {"client": "etcd-client", "peer": "etcd-peer"}, headless=True)
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
        "env": env([("POD_NAME", field("metadata.name")), ("ETCD_INITIAL_CLUSTER", members)]),
        "ports": [
            {"name": "client", "containerPort": PORTS["etcd-client"], "protocol": "TCP"},
            {"name": "peer", "containerPort": PORTS["etcd-peer"], "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "readinessProbe": http_probe("/health", "client", period=5, failures=3),
        "livenessProbe": http_probe(
            "/health?exclude=NOSPACE&serializable=true", "client", period=10, failures=6, delay=15
        ),
        "securityContext": sc,
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(n.etcd, job, "etcd", ns),
        "spec": {
            "serviceName": n.etcd,
            "replicas": o.etcd_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(job, "etcd")},
            "template": {
                "metadata": {"labels": labels(job, "etcd")},
                "spec": pod_spec(n.etcd, pod_sc, container),
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data", "labels": labels(job, "etcd")},
                    "spec": claim(o.storage, o.storage_class),
                }
            ],
        },
    }
    return [svc, stateful]
