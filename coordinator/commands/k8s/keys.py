"""``cellmesh k8s keys JOB -o DIR``: make a job's keys and say how to hand them to the cluster as Secrets.

The manifests (``cellmesh k8s render``) mount two Secrets the user creates, never one the
render writes, so keys never land in a directory that may be committed or in a ConfigMap:

- ``J-coordinator-keys``: every key of the job (the coordinator's pod);
- ``J-worker-keys``: the workers' copy, without the coordinator's secret (the worker pods).

Each holds one file, ``keys.json`` (see :class:`comm.auth.JobKeys`). This command writes
both files under ``DIR`` (directories 0700, files 0600) and prints the two ``kubectl create
secret`` commands; delete ``DIR`` once the Secrets exist.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from comm.auth import KEYS_FILE, JobKeys
from coordinator.commands.jobspec import JobSpecError, read_spec
from coordinator.commands.k8s.objects import Names
from coordinator.commands.k8s.render import job_name

__all__ = ["add_keys_arguments", "keys_command", "secret_commands"]


def add_keys_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=Path, metavar="JOB", help="the job spec the manifests were rendered from")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                        help="a new directory for the key files (delete it once the Secrets exist)")
    parser.add_argument("--namespace", "-n", default=None, help="the namespace of the Secrets")


def secret_commands(job: str, directory: Path, namespace: str | None = None) -> list[str]:
    """The ``kubectl`` commands that create the job's two Secrets from ``directory``."""
    names = Names(job)
    ns = f" -n {shlex.quote(namespace)}" if namespace else ""
    return [f"kubectl create secret generic {secret} --from-file={KEYS_FILE}="
            f"{shlex.quote(str(directory / part / KEYS_FILE))}{ns}"
            for secret, part in ((names.coordinator_keys, "coordinator"), (names.worker_keys, "worker"))]


def keys_command(args: argparse.Namespace) -> int:
    """``cellmesh k8s keys``: returns the exit code (2 with a message for bad input)."""
    try:
        spec = read_spec(args.job)
    except JobSpecError as exc:
        print(f"cellmesh: error: {exc}", file=sys.stderr)
        return 2
    out: Path = args.output
    if out.exists() and any(out.iterdir()):
        print(f"cellmesh: error: {out} is not empty; give a new directory (keys are never overwritten)",
              file=sys.stderr)
        return 2
    job = job_name(spec, args.job)
    keys = JobKeys.generate()
    keys.save(out / "coordinator")
    keys.for_workers().save(out / "worker")
    out.chmod(0o700)
    print(f"wrote the keys of job {job} to {out}; create its Secrets with\n  "
          + "\n  ".join(secret_commands(job, out, args.namespace))
          + f"\nthen delete {out}")
    return 0
