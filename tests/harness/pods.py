"""Run rendered pods as local processes: a kubelet on loopback, for the pod entry-point tests.

:class:`LoopbackCluster` takes the objects ``cellmesh k8s render`` wrote and starts a
pod's container as a process with exactly its command, arguments and environment,
resolved as a kubelet would (``fieldRef`` and ``resourceFieldRef`` values, ``$(VAR)``
expansion from earlier variables, ConfigMap volumes as files), with what only a
cluster has rewritten to this machine:

- every DNS name of a Service or a pod (``J-etcd``, ``J-worker-0.J-workers``) and
  ``0.0.0.0`` become ``127.0.0.1``, and the pod IP is ``127.0.0.1``;
- every container port of every pod gets a free loopback port of its own (two worker
  pods cannot both bind 7000 on one host): ``host:port`` references and bare port
  arguments (``--port 7000``) are rewritten to the pod's own port;
- image paths (``/app``, the mount paths of volumes) become directories of the test;
- the image's commands (``cellmesh``, ``etcd``) become this interpreter's
  ``-m coordinator.commands.cli`` (with this repository on its ``PYTHONPATH``, as the image
  has cellmesh installed) and the Debian etcd binary.

Processes log to files in the work directory (``log(pod)``), run in sessions of their
own, and are terminated, then killed, on :meth:`close` (also on errors in ``with``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from comm.sockets import free_port
from tests.harness import commands

__all__ = ["LoopbackCluster", "Pod"]

Manifest = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "m": 1e-3}


def quantity(text: str) -> float:
    """A Kubernetes quantity (``500m``, ``4Gi``, ``2``) as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match, f"not a quantity: {text!r}"
    return float(match.group(1)) * UNITS.get(match.group(2), 1)


@dataclass
class Pod:
    """One pod of a workload: its name, ordinal, container and the loopback ports of its container ports."""

    name: str
    ordinal: int
    owner: Manifest
    container: dict[str, Any]
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> loopback port

    def port(self, name: str) -> int:
        for p in self.container.get("ports", []):
            if p.get("name") == name:
                return self.ports[int(p["containerPort"])]
        raise KeyError(f"{self.name} declares no port {name!r}")


class LoopbackCluster:
    """The pods of one render, run as processes on loopback (see the module docstring).

    Args:
        objects: The rendered objects.
        workdir: Where volumes, logs and rewritten paths live.
        paths: Image paths to directories of this machine (``/app`` -> the repository).
        secrets: Secret name -> a directory whose files are its keys (Secrets are made by the
            user, never rendered; a pod mounting one gets its files with the volume's mode).
    """

    def __init__(self, objects: list[Manifest], workdir: Path, paths: dict[str, Path] | None = None,
                 secrets: dict[str, Path] | None = None) -> None:
        self.objects = objects
        self.secrets = dict(secrets or {})
        self.workdir = workdir
        self.paths = {"/app": REPO, **(paths or {})}
        self.pods: dict[str, Pod] = {}
        self.procs: dict[str, subprocess.Popen[bytes] | commands.Started] = {}
        self.stopped: set[str] = set()  # pods stopped on purpose (by :meth:`stop`)
        self._services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        for obj in objects:
            if obj["kind"] not in ("StatefulSet", "Deployment"):
                continue
            replicas = int(obj["spec"].get("replicas", 1))
            for i in range(replicas):
                base = obj["metadata"]["name"]
                name = f"{base}-{i}" if obj["kind"] == "StatefulSet" else f"{base}-pod"
                container = obj["spec"]["template"]["spec"]["containers"][0]
                ports = {int(p["containerPort"]): free_port() for p in container.get("ports", [])}
                self.pods[name] = Pod(name, i, obj, container, ports)

    # -- rewriting --------------------------------------------------------------------------

    def _selected(self, service: Manifest) -> list[Pod]:
        selector = service["spec"].get("selector", {})
        return [
            p
            for p in self.pods.values()
            if all(p.owner["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]

    def _rewrite(self, text: str, pod: Pod) -> str:
        """Cluster names, ports and image paths in ``text`` as this machine's."""
        for other in self.pods.values():  # pod DNS names with a port: that pod's own loopback port
            svc = other.owner["spec"].get("serviceName")
            if svc:
                for port, local in other.ports.items():
                    text = text.replace(f"{other.name}.{svc}:{port}", f"127.0.0.1:{local}")
                text = re.sub(rf"\b{re.escape(other.name)}\.{re.escape(svc)}\b", "127.0.0.1", text)
        for name, service in self._services.items():  # Service names with a port: its first pod's port
            chosen = self._selected(service)
            for sp in service["spec"].get("ports", []):
                target = sp.get("targetPort", sp["port"])
                for candidate in chosen[:1]:
                    number = next(
                        (
                            int(p["containerPort"])
                            for p in candidate.container.get("ports", [])
                            if p.get("name") == target or p["containerPort"] == target
                        ),
                        None,
                    )
                    if number is not None:
                        text = text.replace(f"{name}:{sp['port']}", f"127.0.0.1:{candidate.ports[number]}")
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])(?=[:/]|$)", "127.0.0.1", text)
        for port, local in pod.ports.items():  # listen addresses of the pod itself
            text = text.replace(f"0.0.0.0:{port}", f"127.0.0.1:{local}")
        text = text.replace("0.0.0.0", "127.0.0.1")
        for image_path, local_path in self.paths.items():
            text = re.sub(rf"(?<![\w/]){re.escape(image_path)}(?=/|$|:)", str(local_path), text)
        return text

    def _env(self, pod: Pod) -> dict[str, str]:
        resources = pod.container.get("resources", {})
        env: dict[str, str] = {}
        for item in pod.container.get("env", []):
            if "value" in item:
                value = re.sub(
                    r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                    lambda m: env.get(m.group(1), m.group(0)),
                    str(item["value"]),
                )
            else:
                source = item["valueFrom"]
                if "fieldRef" in source:
                    path = source["fieldRef"]["fieldPath"]
                    value = {
                        "metadata.name": pod.name,
                        "status.podIP": "127.0.0.1",
                        "metadata.labels['apps.kubernetes.io/pod-index']": str(pod.ordinal),
                    }[path]
                else:
                    ref = source["resourceFieldRef"]
                    kind, _, res = ref["resource"].partition(".")
                    amount = quantity(resources[kind][res]) / quantity(ref.get("divisor", "1"))
                    value = str(math.ceil(amount))
            env[item["name"]] = self._rewrite(value, pod)
        return env

    def command(self, name: str) -> tuple[list[str], dict[str, str]]:
        """Pod ``name``'s argv and environment, resolved and rewritten."""
        pod = self.pods[name]
        env = self._env(pod)
        argv = []
        for arg in [*pod.container.get("command", []), *pod.container.get("args", [])]:
            arg = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), str(arg)
            )
            if arg.isdigit() and int(arg) in pod.ports:  # a bare port argument: the pod's own port
                arg = str(pod.ports[int(arg)])
            argv.append(self._rewrite(arg, pod))
        if pod.container.get("command", [""])[0] == "cellmesh":  # the image's installed cellmesh: this tree's
            env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
        program = {
            "cellmesh": [sys.executable, "-m", "coordinator.commands.cli"],
            "etcd": [shutil.which("etcd") or "/usr/bin/etcd"],
        }
        return [*program.get(argv[0], argv[:1]), *argv[1:]], env

    def _volumes(self, pod: Pod) -> None:
        """Mount paths as directories of the test (ConfigMaps written as files)."""
        spec = pod.owner["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        configs = {o["metadata"]["name"]: o for o in self.objects if o["kind"] == "ConfigMap"}
        for mount in pod.container.get("volumeMounts", []):
            path = mount["mountPath"]
            if path == "/tmp":
                continue  # the machine's /tmp serves as the emptyDir
            local = self.paths.setdefault(path, self.workdir / f"{pod.name}{path.replace('/', '_')}")
            local.mkdir(parents=True, exist_ok=True)
            volume = volumes.get(mount["name"], {})
            if "configMap" in volume:
                for key, text in configs[volume["configMap"]["name"]].get("data", {}).items():
                    (local / key).write_text(text)
            if "secret" in volume:
                source = self.secrets[volume["secret"]["secretName"]]  # KeyError: no such Secret made
                local.chmod(0o700)
                for file in source.iterdir():
                    target = local / file.name
                    target.unlink(missing_ok=True)
                    target.write_bytes(file.read_bytes())
                    target.chmod(int(volume["secret"].get("defaultMode", 0o644)))

    # -- processes --------------------------------------------------------------------------

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def start(self, name: str) -> subprocess.Popen[bytes] | commands.Started:
        """Start pod ``name``'s container as a process."""
        self._volumes(self.pods[name])
        self.stopped.discard(name)
        argv, env = self.command(name)
        base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
        proc: subprocess.Popen[bytes] | commands.Started
        if argv[:2] == [sys.executable, "-m"]:  # a cellmesh container: forked, not a fresh interpreter
            proc = commands.start(argv, env={**base, **env}, cwd=self.workdir, stdout=self.log(name),
                                  stderr=commands.STDOUT, append=True, new_session=True)
        else:
            with self.log(name).open("ab") as log:
                proc = subprocess.Popen(
                    argv,
                    env={**base, **env},
                    cwd=self.workdir,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        self.procs[name] = proc
        return proc

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.tail(name)}" for name in self.procs)

    def stop(self, name: str, timeout: float = 20.0) -> int:
        """SIGTERM (as the kubelet does), wait up to ``timeout``, then SIGKILL; return the exit code."""
        proc = self.procs[name]
        self.stopped.add(name)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return int(proc.returncode)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
