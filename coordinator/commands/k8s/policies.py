"""Least privilege: a ServiceAccount per role with no permissions, and a NetworkPolicy per role.

Nothing of a job talks to the Kubernetes API, so no account mounts a token. etcd admits
the coordinator and the workers on its client port and its own members on the peer
port; workers admit the coordinator on the control port and each other; the coordinator
admits the workers.
"""

from __future__ import annotations

from typing import Any

from coordinator.commands.k8s.objects import Manifest, Names, labels, meta
from coordinator.commands.k8s.options import PORTS, RenderOptions

__all__ = ["network_policies", "service_accounts"]


def service_accounts(o: RenderOptions, n: Names) -> list[Manifest]:
    """One account per role (etcd, coordinator, worker), with no token mounted."""
    return [
        _service_account(n.etcd, n.job, "etcd", o.namespace),
        _service_account(n.coordinator, n.job, "coordinator", o.namespace),
        _service_account(n.worker, n.job, "worker", o.namespace),
    ]


def _service_account(name: str, job: str, component: str, ns: str | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta(name, job, component, ns),
        "automountServiceAccountToken": False,
    }


def network_policies(o: RenderOptions, n: Names) -> list[Manifest]:
    """Ingress rules of each role's pods: only the peers and ports the job uses."""
    ns, job = o.namespace, n.job

    def peers(*components: str) -> list[dict[str, Any]]:
        return [{"podSelector": {"matchLabels": labels(job, c)}} for c in components]

    def policy(component: str, ingress: list[dict[str, Any]]) -> Manifest:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(f"{job}-{component}", job, component, ns),
            "spec": {
                "podSelector": {"matchLabels": labels(job, component)},
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
