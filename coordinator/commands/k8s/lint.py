"""The checks on a job's manifests that a schema cannot make.

``kubernetes-validate --strict`` proves each object is well formed; :func:`lint` proves
the objects fit together and say what the job needs, on the output of ``cellmesh k8s
render`` or of ``kubectl kustomize k8s/overlays/...``:

- every container has CPU and memory requests and limits, and GPU requests equal limits;
- every Service, workload and NetworkPolicy selector selects pods of the same render, and
  a StatefulSet's ``serviceName`` is a headless Service of it;
- every port a probe or a Service names is a port the selected container declares;
- the ConfigMap the coordinator mounts holds a job spec ``cellmesh run`` accepts;
- the worker count agrees everywhere (StatefulSet replicas, ``WORLD_SIZE``,
  ``PET_NNODES``, the coordinator's ``--workers``, the spec's ``runtime.workers``) and with what
  was asked, and so do the GPUs per worker;
- the NetworkPolicies select every pod and admit exactly the job's own traffic
  (:data:`ALLOWED`: coordinator and workers to etcd's client port, etcd members to each
  other, the coordinator to the workers' control port, workers to each other, workers to
  the coordinator) and nothing else;
- no container runs privileged, as root or with privilege escalation, and no
  ServiceAccount token is mounted;
- a PersistentVolumeClaim that pods of several workloads (or of a workload of several
  replicas) mount is ReadWriteMany, and the job's checkpoint directory (the coordinator's
  ``--checkpoint-dir``, else the spec's ``checkpoint.directory``) is on one claim that the
  coordinator and the workers both mount, writable, at the same path: each worker writes its
  parts of a checkpoint there.

Each problem is one line naming the object and what to fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from coordinator.planning.config import JobConfig

__all__ = ["ALLOWED", "Expect", "lint"]

Manifest = dict[str, Any]
COMPONENT = "app.kubernetes.io/component"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")

# (from component, to component) -> the ports it may reach (None: any port)
ALLOWED: dict[tuple[str, str], frozenset[str] | None] = {
    ("coordinator", "etcd"): frozenset({"client"}),
    ("worker", "etcd"): frozenset({"client"}),
    ("etcd", "etcd"): frozenset({"client", "peer"}),
    ("coordinator", "worker"): frozenset({"control"}),
    ("worker", "worker"): None,  # collectives bind the ports they pick (gloo, ZeroMQ data channels)
    ("worker", "coordinator"): frozenset({"control", "metrics"}),
}
REQUIRED = (("coordinator", "etcd"), ("worker", "etcd"), ("coordinator", "worker"), ("worker", "worker"))


@dataclass(frozen=True)
class Expect:
    """What the manifests must say: the worker count and GPUs per worker that were asked for."""

    workers: int
    gpus_per_worker: int = 0


@dataclass
class _Pod:
    owner: str  # "StatefulSet/charlm-worker"
    labels: dict[str, str]
    spec: dict[str, Any]
    replicas: int

    @property
    def component(self) -> str:
        return self.labels.get(COMPONENT, "")

    @property
    def containers(self) -> list[dict[str, Any]]:
        return [*self.spec.get("initContainers", []), *self.spec.get("containers", [])]


@dataclass
class _Report:
    problems: list[str] = field(default_factory=list)

    def add(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")


def _name(obj: Manifest) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _pods(objects: Iterable[Manifest]) -> list[_Pod]:
    pods = []
    for obj in objects:
        if obj.get("kind") in WORKLOADS:
            template = obj["spec"]["template"]
            pods.append(
                _Pod(
                    _name(obj),
                    dict(template.get("metadata", {}).get("labels", {})),
                    template["spec"],
                    int(obj["spec"].get("replicas", 1)),
                )
            )
    return pods


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _declared(container: dict[str, Any]) -> set[str | int]:
    ports: set[str | int] = set()
    for port in container.get("ports", []):
        ports.add(int(port["containerPort"]))
        if "name" in port:
            ports.add(str(port["name"]))
    return ports


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _arg(container: dict[str, Any], flag: str) -> str | None:
    args = [*container.get("command", []), *container.get("args", [])]
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return str(args[i + 1])
        if str(a).startswith(flag + "="):
            return str(a).split("=", 1)[1]
    return None


def _check_resources(pods: list[_Pod], expect: Expect, r: _Report) -> None:
    for pod in pods:
        for c in pod.containers:
            where = f"{pod.owner} container {c.get('name')}"
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                missing = [k for k in ("cpu", "memory") if k not in res.get(kind, {})]
                if missing:
                    r.add(
                        where, f"no {kind} for {', '.join(missing)}; give every container requests and limits"
                    )
            gpu_req = res.get("requests", {}).get("nvidia.com/gpu")
            gpu_lim = res.get("limits", {}).get("nvidia.com/gpu")
            if gpu_req is not None and str(gpu_req) != str(gpu_lim):
                r.add(
                    where,
                    f"nvidia.com/gpu request {gpu_req} != limit {gpu_lim}; GPUs cannot be overcommitted",
                )
            gpus = int(gpu_lim or 0)
            want = expect.gpus_per_worker if pod.component == "worker" else 0
            if gpus != want:
                r.add(where, f"{gpus} nvidia.com/gpu, the job asks for {want} per {pod.component or 'pod'}")


def _check_selectors(objects: list[Manifest], pods: list[_Pod], r: _Report) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "Service"}
    for svc in services.values():
        selector = svc.get("spec", {}).get("selector", {})
        chosen = [p for p in pods if selector and _selects(selector, p.labels)]
        if not chosen:
            r.add(_name(svc), f"selector {selector} selects no pod of this render")
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port.get("port"))
            if not any(target in _declared(c) for p in chosen for c in p.containers):
                r.add(
                    _name(svc),
                    f"port {port.get('name', port.get('port'))} targets {target!r}, which no "
                    "selected container declares",
                )
    for obj in objects:
        if obj.get("kind") not in WORKLOADS:
            continue
        spec = obj["spec"]
        labels = spec["template"].get("metadata", {}).get("labels", {})
        match = spec.get("selector", {}).get("matchLabels", {})
        if not match or not _selects(match, labels):
            r.add(_name(obj), f"selector {match} does not select its own pod template {labels}")
        if obj["kind"] == "StatefulSet":
            headless = services.get(spec.get("serviceName", ""))
            if headless is None or headless["spec"].get("clusterIP") != "None":
                r.add(
                    _name(obj),
                    f"serviceName {spec.get('serviceName')!r} is not a headless Service of this render",
                )
    for pod in pods:
        for c in pod.containers:
            declared = _declared(c)
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                action = c.get(probe, {})
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in action and action[kind].get("port") not in declared:
                        r.add(
                            f"{pod.owner} container {c.get('name')}",
                            f"{probe} uses port {action[kind].get('port')!r}, which the container does not "
                            "declare",
                        )


def _spec_of(objects: list[Manifest], pods: list[_Pod], r: _Report) -> JobConfig | None:
    coordinators = [p for p in pods if p.component == "coordinator"]
    if len(coordinators) != 1 or coordinators[0].replicas != 1:
        r.add("coordinator", f"expected one coordinator workload of 1 replica, found {len(coordinators)}")
        return None
    volumes = {v["name"]: v for v in coordinators[0].spec.get("volumes", [])}
    maps = [v["configMap"]["name"] for v in volumes.values() if "configMap" in v]
    configs = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ConfigMap"}
    if len(maps) != 1 or maps[0] not in configs:
        r.add(coordinators[0].owner, f"mounts ConfigMaps {maps}, expected the job's one of this render")
        return None
    config = configs[maps[0]]
    text = config.get("data", {}).get("job.yaml")
    if text is None:
        r.add(_name(config), "has no job.yaml")
        return None
    try:
        return JobConfig.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValidationError) as exc:
        r.add(
            _name(config), f"job.yaml is not a job spec `cellmesh run` accepts: {' '.join(str(exc).split())}"
        )
        return None


def _check_counts(spec: JobConfig | None, pods: list[_Pod], expect: Expect, r: _Report) -> None:
    workers = [p for p in pods if p.component == "worker"]
    coordinators = [p for p in pods if p.component == "coordinator"]
    if len(workers) != 1:
        r.add("workers", f"expected one worker workload, found {len(workers)}")
        return
    pod = workers[0]
    counts = {f"{pod.owner} replicas": pod.replicas}
    for c in pod.containers:
        env = _env(c)
        for key in ("WORLD_SIZE", "PET_NNODES"):
            if key in env:
                counts[f"{pod.owner} {key}"] = int(env[key])
    for coordinator in coordinators:
        for c in coordinator.containers:
            value = _arg(c, "--workers")
            if value is not None:
                counts[f"{coordinator.owner} --workers"] = int(value)
    if spec is not None:
        counts["the job spec's runtime.workers"] = spec.runtime.workers
    wrong = {k: v for k, v in counts.items() if v != expect.workers}
    if wrong:
        r.add("worker count", f"the job asks for {expect.workers} workers but {wrong}")
    if len(counts) < 4:
        r.add(
            "worker count",
            f"only {sorted(counts)} say how many workers there are; expected WORLD_SIZE, "
            "PET_NNODES, replicas and the coordinator's --workers",
        )


def _policy_edges(
    objects: list[Manifest], pods: list[_Pod], r: _Report
) -> Iterator[tuple[str, str, str | None]]:
    """Every (from component, to component, port name or None for any) a NetworkPolicy admits."""
    policies = [o for o in objects if o.get("kind") == "NetworkPolicy"]
    components = {p.component for p in pods}
    for pod in pods:
        if not any(
            _selects(pol["spec"]["podSelector"].get("matchLabels", {}), pod.labels) for pol in policies
        ):
            r.add(pod.owner, "no NetworkPolicy selects its pods, so every pod in the cluster may reach them")
    for pol in policies:
        spec = pol["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
            r.add(_name(pol), "does not restrict Ingress")
        targets = [p for p in pods if _selects(spec["podSelector"].get("matchLabels", {}), p.labels)]
        if not targets:
            r.add(_name(pol), "selects no pod of this render")
        for rule in spec.get("ingress", []):
            sources: list[str] = []
            peers = rule.get("from")
            if not peers:
                r.add(_name(pol), "an ingress rule without `from` admits every pod and address")
                continue
            for peer in peers:
                if set(peer) != {"podSelector"}:
                    r.add(
                        _name(pol),
                        f"admits {sorted(set(peer) - {'podSelector'})}: only the job's own pods may",
                    )
                    continue
                chosen = {
                    p.component
                    for p in pods
                    if _selects(peer["podSelector"].get("matchLabels", {}), p.labels)
                }
                if not chosen or not peer["podSelector"].get("matchLabels"):
                    r.add(_name(pol), f"peer {peer} selects no single component of this job")
                sources += sorted(chosen & components)
            ports = rule.get("ports")
            for target in targets:
                for source in sources:
                    if not ports:
                        yield source, target.component, None
                        continue
                    for port in ports:
                        yield source, target.component, _port_name(target, port.get("port"))


def _port_name(pod: _Pod, port: str | int | None) -> str | None:
    if isinstance(port, str) or port is None:
        return port
    for c in pod.containers:
        for p in c.get("ports", []):
            if int(p["containerPort"]) == int(port):
                return str(p.get("name", port))
    return str(port)


def _check_policies(objects: list[Manifest], pods: list[_Pod], r: _Report) -> None:
    admitted: dict[tuple[str, str], set[str | None]] = {}
    for source, target, port in _policy_edges(objects, pods, r):
        admitted.setdefault((source, target), set()).add(port)
    for edge, ports in sorted(admitted.items(), key=str):
        allowed = ALLOWED.get(edge, frozenset())
        if edge not in ALLOWED:
            r.add("NetworkPolicy", f"admits {edge[0]} -> {edge[1]}, which the job does not need")
        elif allowed is not None and not ports <= allowed:
            extra = sorted(str(p) for p in ports - allowed)
            r.add(
                "NetworkPolicy",
                f"admits {edge[0]} -> {edge[1]} on {extra}; only {sorted(allowed)} are needed",
            )
    for edge in REQUIRED:
        if edge not in admitted:
            r.add("NetworkPolicy", f"does not admit {edge[0]} -> {edge[1]}, which the job needs")


def _check_security(objects: list[Manifest], pods: list[_Pod], r: _Report) -> None:
    accounts = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ServiceAccount"}
    for kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
        for o in objects:
            if o.get("kind") == kind:
                r.add(_name(o), "grants API permissions; cellmesh's pods need none")
    for pod in pods:
        account = pod.spec.get("serviceAccountName")
        if account not in accounts:
            r.add(pod.owner, f"serviceAccountName {account!r} is not a ServiceAccount of this render")
        elif accounts[account].get("automountServiceAccountToken", True):
            r.add(f"ServiceAccount/{account}", "mounts an API token; set automountServiceAccountToken: false")
        if pod.spec.get("automountServiceAccountToken", True):
            r.add(pod.owner, "mounts an API token; set automountServiceAccountToken: false")
        pod_sc = pod.spec.get("securityContext", {})
        for c in pod.containers:
            sc = c.get("securityContext", {})
            where = f"{pod.owner} container {c.get('name')}"
            if sc.get("privileged", False):
                r.add(where, "is privileged")
            if sc.get("allowPrivilegeEscalation", True):
                r.add(where, "allows privilege escalation")
            if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
                r.add(where, "may run as root; set runAsNonRoot: true")
            if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                r.add(where, "runs as user 0")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                r.add(where, "keeps Linux capabilities; drop ALL")


def _volume_holding(pod: _Pod, directory: PurePosixPath) -> tuple[str | None, bool]:
    """(claim, writable) of the mount of ``pod``'s containers that holds ``directory`` (the deepest one);
    claim is None when that is no PersistentVolumeClaim, or nothing is mounted there."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod.spec.get("volumes", []) if "persistentVolumeClaim" in v}
    holding = [m for c in pod.containers for m in c.get("volumeMounts", [])
               if directory.is_relative_to(m["mountPath"])]
    if not holding:
        return None, False
    mount = max(holding, key=lambda m: len(PurePosixPath(m["mountPath"]).parts))
    return claims.get(mount["name"]), not mount.get("readOnly", False)


def _check_storage(objects: list[Manifest], pods: list[_Pod], spec: JobConfig | None, r: _Report) -> None:
    mounting: dict[str, list[_Pod]] = {}
    for pod in pods:
        for v in pod.spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                mounting.setdefault(v["persistentVolumeClaim"]["claimName"], []).append(pod)
    for pvc in (o for o in objects if o.get("kind") == "PersistentVolumeClaim"):
        modes = pvc.get("spec", {}).get("accessModes", [])
        users = mounting.get(pvc["metadata"]["name"], [])
        if sum(p.replicas for p in users) > 1 and "ReadWriteMany" not in modes:
            r.add(_name(pvc), f"is {modes} but mounted by the pods of {[p.owner for p in users]}, which on "
                  "different nodes cannot share it; make it ReadWriteMany (render with --checkpoints shared)")
    coordinators = [p for p in pods if p.component == "coordinator"]
    flagged = [v for p in coordinators for c in p.containers
               for v in (_arg(c, "--checkpoint-dir"), _arg(c, "--checkpoint.directory")) if v is not None]
    directory = flagged[-1] if flagged else spec.checkpoint.directory if spec is not None else None
    if directory is None:
        return
    where = PurePosixPath(directory)
    if not where.is_absolute():
        r.add("checkpoint directory", f"{directory!r} is relative: give a path on a volume every pod mounts")
        return
    found: dict[str, str] = {}
    for pod in (p for p in pods if p.component in ("coordinator", "worker")):
        claim, writable = _volume_holding(pod, where)
        if claim is None or not writable:
            r.add(pod.owner, f"does not mount the checkpoint directory {directory} writable from a "
                  "PersistentVolumeClaim: each worker writes its parts of a checkpoint there and the "
                  "coordinator publishes them (render with --checkpoints shared)")
        else:
            found[pod.owner] = claim
    if len(set(found.values())) > 1:
        r.add("checkpoint directory", f"{directory} is on different claims in different pods ({found}); "
              "every pod must see the same files")


def lint(objects: Iterable[Manifest], expect: Expect) -> list[str]:
    """The problems of a job's manifests (empty: none). See the module docstring for the checks."""
    objs = [o for o in objects if o]
    pods = _pods(objs)
    r = _Report()
    _check_resources(pods, expect, r)
    _check_selectors(objs, pods, r)
    spec = _spec_of(objs, pods, r)
    _check_counts(spec, pods, expect, r)
    _check_policies(objs, pods, r)
    _check_security(objs, pods, r)
    _check_storage(objs, pods, spec, r)
    return r.problems
