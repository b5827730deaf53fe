"""`cellmesh k8s render` and the manifest lint: schemas (kubernetes-validate --strict), kustomize, meaning."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.commands.cli import main
from coordinator.commands.jobspec import JobSpecError, load_job, read_spec
from coordinator.commands.k8s.lint import Expect, lint
from coordinator.commands.k8s.options import CheckpointMode, RenderOptions
from coordinator.commands.k8s.render import render
from coordinator.commands.k8s.writer import write
from services.host.worker import allowed_factories

REPO = Path(__file__).resolve().parents[4]
CHARLM = REPO / "examples" / "charlm.yaml"
KUBECTL = shutil.which("kubectl")
VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
Manifest = dict[str, Any]

# (workers, gpus per worker, namespace, checkpoints): 1 and 8 workers, CPU and GPU, a custom namespace,
# checkpoints on the coordinator's volume alone and on one every pod mounts
RENDERS = [
    (1, 0, None, "none"),
    (8, 0, None, "shared"),
    (2, 1, None, "none"),
    (8, 2, "ml-team", "shared"),
    (1, 0, "cellmesh", "none"),
]


def _objects(files: dict[str, list[Manifest]]) -> list[Manifest]:
    return [o for objs in files.values() for o in objs]


def _load(path: Path) -> list[Manifest]:
    return [o for o in yaml.safe_load_all(path.read_text()) if o]


def _validate_strict(paths: list[Path]) -> None:
    """kubernetes-validate --strict; a kind without a schema only warns there, and fails here."""
    result = subprocess.run(
        [str(VALIDATE), "--strict", *map(str, paths)], capture_output=True, text=True, timeout=120
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "WARN" not in report and "Couldn't find schema" not in report, report
    assert report.count("passed for resource") >= len(paths), report


def _kustomize(directory: Path) -> list[Manifest]:
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


@pytest.mark.parametrize(("workers", "gpus", "namespace", "checkpoints"), RENDERS)
def test_render_validates_and_lints(
    tmp_path: Path, workers: int, gpus: int, namespace: str | None, checkpoints: CheckpointMode
) -> None:
    options = RenderOptions(
        job=CHARLM, workers=workers, gpus_per_worker=gpus, namespace=namespace, checkpoints=checkpoints
    )
    files = render(options)
    paths = write(files, tmp_path, namespace)
    _validate_strict([p for p in paths if p.parent.name == "manifests"])
    objects = _objects(files)
    assert lint(objects, Expect(workers=workers, gpus_per_worker=gpus)) == []
    assert all(o["metadata"].get("namespace") == namespace for o in objects)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("NetworkPolicy") == 3 and kinds.count("ServiceAccount") == 3
    if KUBECTL is not None:  # the rendered kustomization builds to the same objects
        built = _kustomize(tmp_path)
        assert sorted((o["kind"], o["metadata"]["name"]) for o in built) == sorted(
            (o["kind"], o["metadata"]["name"]) for o in objects
        )
        assert lint(built, Expect(workers=workers, gpus_per_worker=gpus)) == []


def test_the_configmap_spec_is_one_cellmesh_run_accepts(tmp_path: Path) -> None:
    files = render(RenderOptions(job=CHARLM, workers=3))
    text = files["job"][0]["data"]["job.yaml"]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(text)
    sys.path.insert(0, str(REPO / "examples"))  # the image's PYTHONPATH
    try:
        loaded = load_job(spec_file)
    finally:
        sys.path.remove(str(REPO / "examples"))
    assert loaded.name == "charlm" and loaded.job.resources.num_workers == 3
    original = read_spec(CHARLM)
    assert loaded.steps == original.steps and loaded.job.config.model.factory == "charlm:model"


def test_k8s_base_is_the_render_of_the_example(tmp_path: Path) -> None:
    """k8s/base is committed output of `cellmesh k8s render examples/charlm.yaml --workers 2`: keep it so."""
    write(render(RenderOptions(job=CHARLM, workers=2)), tmp_path)
    base = REPO / "k8s" / "base"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.yaml"))
    assert fresh == sorted(p.relative_to(base) for p in base.rglob("*.yaml"))
    for rel in fresh:
        assert (base / rel).read_text() == (tmp_path / rel).read_text(), (
            f"k8s/base/{rel} is stale: run `cellmesh k8s render examples/charlm.yaml --workers 2 -o k8s/base`"
        )


@needs_kubectl
@pytest.mark.parametrize(
    ("overlay", "gpus"), [("base", 0), ("overlays/cpu", 0), ("overlays/gpu", 1), ("overlays/etcd-ha", 0)]
)
def test_kustomize_builds_the_base_and_every_overlay(tmp_path: Path, overlay: str, gpus: int) -> None:
    built = _kustomize(REPO / "k8s" / overlay)
    assert lint(built, Expect(workers=2, gpus_per_worker=gpus)) == []
    out = tmp_path / "built.yaml"
    out.write_text(yaml.safe_dump_all(built))
    _validate_strict([out])
    etcd = next(o for o in built if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-etcd"))
    members = next(
        e["value"]
        for e in etcd["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"] == "ETCD_INITIAL_CLUSTER"
    )
    assert len(members.split(",")) == etcd["spec"]["replicas"] == (3 if overlay.endswith("etcd-ha") else 1)


def test_every_overlay_is_tested() -> None:
    assert sorted(p.name for p in (REPO / "k8s" / "overlays").iterdir()) == ["cpu", "etcd-ha", "gpu"]


def _worker_container(objects: list[Manifest]) -> dict[str, Any]:
    sts = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-worker"))
    return dict(sts["spec"]["template"]["spec"]["containers"][0])


def _find(objects: list[Manifest], kind: str, suffix: str) -> Manifest:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix))


def _mutations() -> dict[str, tuple[Callable[[list[Manifest]], None], str]]:
    def no_limits(objs: list[Manifest]) -> None:
        sts = _find(objs, "StatefulSet", "-worker")
        del sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]

    def gpu_overcommit(objs: list[Manifest]) -> None:
        sts = _find(objs, "StatefulSet", "-worker")
        sts["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = "1"

    def selector_typo(objs: list[Manifest]) -> None:
        _find(objs, "Service", "-workers")["spec"]["selector"]["app.kubernetes.io/component"] = "wroker"

    def probe_port(objs: list[Manifest]) -> None:
        sts = _find(objs, "StatefulSet", "-worker")
        sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = "healthz"

    def service_port(objs: list[Manifest]) -> None:
        _find(objs, "Service", "-coordinator")["spec"]["ports"][1]["targetPort"] = 9999

    def bad_spec(objs: list[Manifest]) -> None:
        cm = _find(objs, "ConfigMap", "-job")
        cm["data"]["job.yaml"] = cm["data"]["job.yaml"].replace("global_batch:", "global_bacth:")

    def replicas(objs: list[Manifest]) -> None:
        _find(objs, "StatefulSet", "-worker")["spec"]["replicas"] = 3

    def world_size(objs: list[Manifest]) -> None:
        sts = _find(objs, "StatefulSet", "-worker")
        for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]:
            if e["name"] == "WORLD_SIZE":
                e["value"] = "5"

    def open_policy(objs: list[Manifest]) -> None:
        _find(objs, "NetworkPolicy", "-worker")["spec"]["ingress"].append({})

    def namespace_peer(objs: list[Manifest]) -> None:
        _find(objs, "NetworkPolicy", "-etcd")["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})

    def etcd_to_workers(objs: list[Manifest]) -> None:
        rule = _find(objs, "NetworkPolicy", "-worker")["spec"]["ingress"][1]
        rule["from"].append({"podSelector": {"matchLabels": {"app.kubernetes.io/component": "etcd"}}})

    def missing_policy(objs: list[Manifest]) -> None:
        objs.remove(_find(objs, "NetworkPolicy", "-coordinator"))

    def no_etcd_access(objs: list[Manifest]) -> None:
        _find(objs, "NetworkPolicy", "-etcd")["spec"]["ingress"].pop(0)

    def privileged(objs: list[Manifest]) -> None:
        dep = _find(objs, "Deployment", "-coordinator")
        dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = True

    def token(objs: list[Manifest]) -> None:
        _find(objs, "ServiceAccount", "-worker")["automountServiceAccountToken"] = True

    def role(objs: list[Manifest]) -> None:
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "r"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
            }
        )

    return {
        "no limits": (no_limits, "no limits for cpu, memory"),
        "gpu overcommit": (gpu_overcommit, "nvidia.com/gpu request 1 != limit 2"),
        "selector typo": (selector_typo, "selects no pod"),
        "probe port": (probe_port, "readinessProbe uses port 'healthz'"),
        "service port": (service_port, "targets 9999"),
        "bad spec": (bad_spec, "not a job spec"),
        "replicas": (replicas, "replicas': 3"),
        "world size": (world_size, "WORLD_SIZE': 5"),
        "open policy": (open_policy, "without `from` admits every pod"),
        "namespace peer": (namespace_peer, "only the job's own pods"),
        "etcd to workers": (etcd_to_workers, "admits etcd -> worker"),
        "missing policy": (missing_policy, "no NetworkPolicy selects"),
        "no etcd access": (no_etcd_access, "does not admit coordinator -> etcd"),
        "privileged": (privileged, "is privileged"),
        "token": (token, "mounts an API token"),
        "role": (role, "grants API permissions"),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_lint_catches(name: str) -> None:
    mutate, message = _mutations()[name]
    objects = copy.deepcopy(_objects(render(RenderOptions(job=CHARLM, workers=4, gpus_per_worker=2))))
    assert lint(objects, Expect(workers=4, gpus_per_worker=2)) == []
    mutate(objects)
    problems = lint(objects, Expect(workers=4, gpus_per_worker=2))
    assert any(message in p for p in problems), problems


def test_lint_catches_a_gpu_count_other_than_asked() -> None:
    objects = _objects(render(RenderOptions(job=CHARLM, workers=2, gpus_per_worker=1)))
    assert any(
        "1 nvidia.com/gpu, the job asks for 2" in p for p in lint(objects, Expect(2, gpus_per_worker=2))
    )
    assert any("asks for 3 workers" in p for p in lint(objects, Expect(3, gpus_per_worker=1)))


def test_worker_pods_carry_the_launcher_conventions() -> None:
    objects = _objects(render(RenderOptions(job=CHARLM, workers=4, namespace="x")))
    container = _worker_container(objects)
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert env["WORLD_SIZE"] == env["PET_NNODES"] == "4"
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "charlm-worker-0.charlm-workers"
    assert env["PET_NODE_RANK"] == "$(RANK)" and env["PET_NPROC_PER_NODE"] == "1" and env["LOCAL_RANK"] == "0"
    assert env["CELLMESH_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    names = [e["name"] for e in container["env"]]
    assert names.index("RANK") < names.index("PET_NODE_RANK")  # $(RANK) expands only from earlier variables


def test_worker_pods_build_only_the_factories_of_the_mounted_spec(tmp_path: Path) -> None:
    objects = _objects(render(RenderOptions(job=CHARLM, workers=2)))
    container = _worker_container(objects)
    args = container["args"]
    spec_path = Path(args[args.index("--job-spec") + 1])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(spec_path.parent))
    assert mount["readOnly"] is True
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    pod = sets["charlm-worker"]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    assert volume == {"name": mount["name"], "configMap": {"name": config["metadata"]["name"]}}
    mounted = tmp_path / spec_path.name  # what the pod finds at spec_path
    mounted.write_text(config["data"][spec_path.name])
    assert allowed_factories(str(mounted), []).names == {"charlm:model", "charlm:data", "charlm:loss"}


def test_job_names_become_dns_labels(tmp_path: Path) -> None:
    spec = tmp_path / "My_Job.v2.yaml"
    spec.write_text("model: {factory: a:b}\ndata: {factory: a:c}\nloss: {factory: a:d}\n")
    files = render(RenderOptions(job=spec, workers=1))
    assert files["job"][0]["metadata"]["name"] == "my-job-v2-job"
    assert yaml.safe_load(files["job"][0]["data"]["job.yaml"])["name"] == "my-job-v2"


def test_render_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="takes a job spec"):
        render(RenderOptions(job=REPO / "examples" / "charlm.py", workers=1))
    with pytest.raises(JobSpecError, match="does not exist"):
        render(RenderOptions(job=tmp_path / "missing.yaml", workers=1))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {factory: a:b}\ndata: {factory: a:c}\nloss: {factory: a:d}\nwrokers: 2\n")
    with pytest.raises(JobSpecError, match="wrokers"):
        render(RenderOptions(job=bad, workers=1))
    with pytest.raises(ValueError, match="not a DNS label"):
        RenderOptions(job=CHARLM, workers=1, namespace="Bad_NS")
    with pytest.raises(ValueError, match="'4GB' is not a Kubernetes quantity"):
        RenderOptions(job=CHARLM, workers=1, memory_per_worker="4GB")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        RenderOptions(job=CHARLM, workers=0)


def test_the_command_writes_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "deploy"
    assert main(["k8s", "render", str(CHARLM), "--workers", "3", "--namespace", "ml", "-o", str(out)]) == 0
    assert "kubectl apply -k" in capsys.readouterr().out
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "ml"
    assert all((out / r).is_file() for r in kustomization["resources"])
    assert (
        main(["k8s", "render", str(REPO / "examples" / "charlm.py"), "--workers", "1", "-o", str(out)]) == 2
    )
    assert "takes a job spec" in capsys.readouterr().err


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """The paths where two manifests differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(a.keys() | b.keys())
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def test_1024_workers_render_the_shape_of_2(tmp_path: Path) -> None:
    """The same objects as for 2 workers (one StatefulSet, not 1,024 pods' worth), differing only in the
    counts; they validate, lint and build at that size; the pods start in parallel and find each other
    through the headless service before they are ready."""
    def named(files: dict[str, list[Manifest]]) -> dict[tuple[str, str], Manifest]:
        return {(o["kind"], o["metadata"]["name"]): o for o in _objects(files)}

    files = render(RenderOptions(job=CHARLM, workers=1024))
    small, large = named(render(RenderOptions(job=CHARLM, workers=2))), named(files)
    assert sorted(large) == sorted(small) and len(large) == 14
    changed = {key: _differences(small[key], large[key]) for key in small}
    worker_set = ("StatefulSet", "charlm-worker")
    env = ".spec.template.spec.containers[0].env"
    assert {k: v for k, v in changed.items() if v} == {
        ("ConfigMap", "charlm-job"): [".data.job.yaml"],  # runtime.workers: 1024
        ("Deployment", "charlm-coordinator"): [".spec.template.spec.containers[0].args[3]"],  # --workers 1024
        worker_set: [".spec.replicas", f"{env}[3].value", f"{env}[7].value"],  # WORLD_SIZE, PET_NNODES
    }
    workers = large[worker_set]
    assert workers["spec"]["replicas"] == 1024 and workers["spec"]["podManagementPolicy"] == "Parallel"
    args = large[("Deployment", "charlm-coordinator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[2:4] == ["--workers", "1024"]
    headless = large[("Service", "charlm-workers")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert lint(list(large.values()), Expect(workers=1024, gpus_per_worker=0)) == []
    paths = write(files, tmp_path, None)
    _validate_strict([p for p in paths if p.parent.name == "manifests"])
    if KUBECTL is not None:
        assert len(_kustomize(tmp_path)) == 14
