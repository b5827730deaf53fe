"""``cellmesh k8s render JOB --workers N -o DIR``: the Kubernetes manifests of one job.

What it writes (``DIR/manifests/*.yaml`` and ``DIR/kustomization.yaml``, so
``kubectl apply -k DIR`` or ``kubectl apply -f DIR/manifests`` starts the job), for a job
named ``J`` (the spec's ``name``, made a DNS label):

- ``J-job`` ConfigMap: the job spec (``job.yaml``), the same file ``cellmesh run`` reads,
  with ``name: J`` and ``runtime.workers: N`` (and, with ``--gpus-per-worker``, ``runtime.device:
  cuda`` unless the spec chose a device: a worker whose image or node gives it no CUDA is then an
  error naming it, not a job silently trained on CPUs);
- etcd: ``J-etcd`` headless Service and StatefulSet (1 replica, or ``--etcd-replicas 3``)
  with a PersistentVolumeClaim per member;
- the coordinator: ``J-coordinator`` Deployment of 1 (``cellmesh coordinator``, strategy
  Recreate) with a Service for its control and metrics ports and a
  ``J-checkpoints`` PersistentVolumeClaim for its run directory (the final state_dict) and,
  with ``--checkpoints shared``, the checkpoints every worker writes too (``checkpoints.py``);
- the workers: ``J-worker`` StatefulSet of N (``cellmesh worker``) and the headless
  ``J-workers`` Service that gives pod ``J-worker-i`` the stable name
  ``J-worker-i.J-workers``; torchrun's and Kubeflow Trainer's variables (``RANK`` from the
  pod index, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` = worker 0, ``PET_*``);
  probes on the worker's own ``/readyz`` and ``/healthz``; restart and termination settings that
  bring a lost worker back within the coordinator's replace timeout (the note in ``workers.py``);
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

The modules of this package: ``options.py`` (what to render: :class:`RenderOptions`, the
images and ports), ``objects.py`` (the parts every object is built of), one builder per
kind (``etcd.py``, ``coordinator.py``, ``workers.py``, ``policies.py``), ``checkpoints.py``
(the checkpoint volume and flags), ``writer.py`` (the files) and this one (reading the spec,
the ConfigMap, the command).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

import yaml

from coordinator.commands.jobspec import SPEC_SUFFIXES, JobSpecError, read_spec
from coordinator.commands.k8s.checkpoints import check_spec, describe
from coordinator.commands.k8s.coordinator import coordinator_objects
from coordinator.commands.k8s.etcd import etcd_objects
from coordinator.commands.k8s.objects import Manifest, Names, meta
from coordinator.commands.k8s.options import (
    APP_DIR,
    CHECKPOINT_MODES,
    GPU_IMAGE,
    IMAGE,
    MAX_NAME,
    RenderOptions,
)
from coordinator.commands.k8s.policies import network_policies, service_accounts
from coordinator.commands.k8s.workers import worker_objects
from coordinator.commands.k8s.writer import write
from coordinator.planning.config import JobConfig

__all__ = ["add_render_arguments", "job_name", "render", "render_command"]


def job_name(spec: JobConfig, file: Path) -> str:
    """The job's name as a DNS label: the spec's ``name`` (else the file's stem), lower case."""
    raw = (spec.name or file.stem).lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")[:MAX_NAME].strip("-")
    if not name or not name[0].isalpha():
        name = f"job-{name}".strip("-")
    return name


def _spec_text(spec: JobConfig, job: str, options: RenderOptions) -> str:
    settings: dict[str, object] = {"name": job, "runtime.workers": options.workers}
    if options.gpus_per_worker and spec.runtime.device == "auto":
        settings["runtime.device"] = "cuda"
    data = spec.updated(settings).model_dump(exclude_none=True)
    source = options.job
    header = (
        f"# The job spec of {job}, rendered by `cellmesh k8s render` from {source.name}: the same spec\n"
        f"# `cellmesh run` reads. Factories are imported from PYTHONPATH in the image.\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False)


def render(options: RenderOptions) -> dict[str, list[Manifest]]:
    """The job's objects, by file (``serviceaccounts``, ``job``, ``etcd``, ``coordinator``, ``workers``,
    ``networkpolicies``).

    Raises:
        JobSpecError: ``options.job`` is not a valid job spec file, or one that sets checkpoints the
            pods could not write (``checkpoints.check_spec``).
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
    check_spec(options, spec, file)
    job = job_name(spec, file)
    n = Names(job)
    ns = options.namespace
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(n.config, job, "coordinator", ns),
        "data": {"job.yaml": _spec_text(spec, job, options)},
    }
    return {
        "serviceaccounts": service_accounts(options, n),
        "job": [config],
        "etcd": etcd_objects(options, n),
        "coordinator": coordinator_objects(options, n, spec),
        "workers": worker_objects(options, n),
        "networkpolicies": network_policies(options, n),
    }


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
        "--checkpoints",
        choices=CHECKPOINT_MODES,
        default="none",
        help="none: no checkpoints, the volume is the coordinator's (ReadWriteOnce); shared: a ReadWriteMany "
        "volume every pod mounts, and the job checkpoints there, so a lost worker or a restarted "
        "coordinator resumes from the newest checkpoint (default none)",
    )
    parser.add_argument(
        "--checkpoint-size", default=None, metavar="SIZE", help="size of the checkpoint volume (--storage)"
    )
    parser.add_argument(
        "--checkpoint-class",
        default=None,
        metavar="SC",
        help="StorageClass of the checkpoint volume (--storage-class); shared needs one that provisions "
        "ReadWriteMany volumes",
    )
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
            checkpoints=args.checkpoints,
            checkpoint_size=args.checkpoint_size,
            checkpoint_class=args.checkpoint_class,
            python_path=args.python_path,
        )
        files = render(options)
        spec = read_spec(options.job)
    except (JobSpecError, ValueError) as exc:
        print(f"cellmesh: error: {exc}", file=sys.stderr)
        return 2
    paths = write(files, args.output, options.namespace)
    job = files["job"][0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    print(
        f"wrote {len(paths)} files to {args.output} for job {job} ({options.workers} workers"
        f"{f', {options.gpus_per_worker} GPUs each' if options.gpus_per_worker else ''}); make its keys "
        f"(once) with\n  cellmesh k8s keys {args.job} -o KEYS_DIR\nand run the two commands it prints, then "
        f"start it with\n  kubectl apply -k {args.output}\nand follow it with\n"
        f"  kubectl logs -f deployment/{job}-coordinator"
        + (f" -n {options.namespace}" if options.namespace else "")
        + "\n"
        + textwrap.fill(describe(options, spec, job), 100, subsequent_indent="  ", break_on_hyphens=False)
    )
    return 0
