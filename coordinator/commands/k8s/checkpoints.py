"""Where a job's checkpoints go on Kubernetes: the ``J-checkpoints`` volume, its mounts, the flags.

Each worker writes its own part of a checkpoint into the checkpoint directory, and the
coordinator writes the indexes and renames the directory (``coordinator/runtime/checkpoints.py``),
so the directory must be storage every pod mounts, at one path. ``--checkpoints`` chooses:

- ``none`` (the default): ``J-checkpoints`` is ReadWriteOnce and only the coordinator mounts it,
  at :data:`~coordinator.commands.k8s.options.CHECKPOINT_DIR`: it holds the coordinator's run
  directory (the final state_dict, the run record). The job takes no checkpoints: a replaced
  worker pod rolls the job back to step 0, and a restarted coordinator trains from the start.
  A spec that sets ``checkpoint.directory`` is refused: the workers could not write there.
- ``shared``: ``J-checkpoints`` is ReadWriteMany and the worker pods mount it too, at the same
  path. The coordinator gets ``--checkpoint-dir`` = its run directory's ``checkpoints/`` (where a
  restarted coordinator looks first) and, when the spec says neither ``every_steps`` nor
  ``every_seconds``, ``cellmesh run``'s default frequency. These are flags of the coordinator's
  command: the spec in the ConfigMap stays the user's.

Every pod runs as user and group 10001 (``objects.security``), so the files one pod writes the
others may replace and delete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.commands.jobspec import JobSpecError
from coordinator.commands.k8s.objects import Manifest, Names, claim, meta
from coordinator.commands.k8s.options import CHECKPOINT_DIR, CHECKPOINT_SECONDS, RenderOptions
from coordinator.commands.rundir import RunDir
from coordinator.planning.config import JobConfig

__all__ = [
    "VOLUME",
    "check_spec",
    "checkpoint_claim",
    "checkpoint_flags",
    "checkpoint_mount",
    "checkpoint_volume",
    "describe",
    "run_dir",
]

VOLUME = "checkpoints"  # the pods' name for the J-checkpoints claim


def run_dir(job: str) -> str:
    """The coordinator's ``--run-dir``: on the volume, so a restarted coordinator finds its run there."""
    return f"{CHECKPOINT_DIR}/{job}"


def _directory(job: str) -> str:
    return str(RunDir(Path(run_dir(job))).checkpoints)


def check_spec(o: RenderOptions, spec: JobConfig, source: Path) -> None:
    """Refuse a spec whose checkpoints the rendered pods could not write.

    Raises:
        JobSpecError: The spec sets ``checkpoint.directory`` and the workers do not mount the volume.
    """
    directory = spec.checkpoint.directory
    if o.checkpoints == "none" and directory is not None:
        raise JobSpecError(
            f"{source}: checkpoint.directory is {directory!r}, but without --checkpoints shared only the "
            "coordinator mounts the checkpoint volume and the workers could not write their parts: render "
            "with --checkpoints shared (a ReadWriteMany volume), or remove checkpoint.directory"
        )


def checkpoint_claim(o: RenderOptions, n: Names) -> Manifest:
    """``J-checkpoints``: ReadWriteMany when shared with the workers, else ReadWriteOnce."""
    access = "ReadWriteMany" if o.checkpoints == "shared" else "ReadWriteOnce"
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta(n.checkpoints, n.job, "coordinator", o.namespace),
        "spec": claim(o.checkpoint_storage, o.checkpoint_storage_class, access),
    }


def checkpoint_volume(n: Names) -> dict[str, Any]:
    return {"name": VOLUME, "persistentVolumeClaim": {"claimName": n.checkpoints}}


def checkpoint_mount() -> dict[str, Any]:
    """The volume's mount, the same path in the coordinator and the workers."""
    return {"name": VOLUME, "mountPath": CHECKPOINT_DIR}


def checkpoint_flags(o: RenderOptions, spec: JobConfig, job: str) -> list[str]:
    """The coordinator's checkpoint flags: the directory on the shared volume and, when the spec sets no
    frequency, ``cellmesh run``'s; none without a shared volume."""
    if o.checkpoints != "shared":
        return []
    flags = ["--checkpoint-dir", _directory(job)]
    section = spec.checkpoint
    if section.every_steps is None and section.every_seconds is None:
        flags += ["--checkpoint.every-seconds", f"{CHECKPOINT_SECONDS:g}"]
    return flags


def describe(o: RenderOptions, spec: JobConfig, job: str) -> str:
    """What the render means for recovery, for the command's output."""
    if o.checkpoints != "shared":
        return (
            "checkpoints: none (the default, --checkpoints none): a lost worker pod is replaced, but "
            "the job then goes back to step 0, and so does a restarted coordinator; render with "
            "--checkpoints shared (a ReadWriteMany volume) to resume from the newest checkpoint"
        )
    section = spec.checkpoint
    if section.every_steps is not None:
        every = f"every {section.every_steps} steps (the spec's)"
    elif section.every_seconds is not None:
        every = f"every {section.every_seconds:g} s (the spec's)"
    else:
        every = f"every {CHECKPOINT_SECONDS:g} s (the spec sets no frequency)"
    replaced = (
        f"; the spec's checkpoint.directory {section.directory!r} is replaced"
        if section.directory is not None
        else ""
    )
    return (
        f"checkpoints: {every} to {_directory(job)}{replaced}, on {o.namespace + '/' if o.namespace else ''}"
        f"{Names(job).checkpoints} (ReadWriteMany, mounted by the coordinator and every worker; its "
        "StorageClass must provision ReadWriteMany volumes that user 10001 can write)"
    )
