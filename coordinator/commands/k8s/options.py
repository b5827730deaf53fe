"""What ``cellmesh k8s render`` renders: :class:`RenderOptions`, and the images, ports and user ids."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

__all__ = [
    "APP_DIR",
    "CHECKPOINT_DIR",
    "CHECKPOINT_MODES",
    "CHECKPOINT_SECONDS",
    "ETCD_IMAGE",
    "ETCD_USER_ID",
    "GPU_IMAGE",
    "IMAGE",
    "KEYS_DIR",
    "MAX_NAME",
    "PORTS",
    "SPEC_DIR",
    "USER_ID",
    "VERSION",
    "CheckpointMode",
    "RenderOptions",
]

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
KEYS_DIR = "/etc/cellmesh-keys"  # the job's keys, from its Secret (`cellmesh keys`)
MAX_NAME = 40  # J-worker-NNN and StatefulSet revision labels must stay within 63 characters
# where checkpoints go (coordinator/commands/k8s/checkpoints.py): nowhere, or a volume every pod mounts
CheckpointMode = Literal["none", "shared"]
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)
# how often a job whose spec says nothing checkpoints on a shared volume: cellmesh run's default
# (DEFAULT_CHECKPOINT_SECONDS in coordinator/commands/run.py, which imports torch: the parser must not)
CHECKPOINT_SECONDS = 600.0


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
        storage: Size of each etcd member's volume (and of the checkpoint volume, unless
            ``checkpoint_size`` is given).
        storage_class: Their StorageClass (None: the cluster's default).
        checkpoints: ``none``: the checkpoint volume is the coordinator's alone (ReadWriteOnce) and
            holds its run directory; the job takes no checkpoints (a spec that sets
            ``checkpoint.directory`` is refused: the workers could not write there). ``shared``: the
            volume is ReadWriteMany, every worker mounts it too, and the coordinator checkpoints
            there (``coordinator/commands/k8s/checkpoints.py``).
        checkpoint_size: The checkpoint volume's size (None: ``storage``).
        checkpoint_class: The checkpoint volume's StorageClass (None: ``storage_class``); a shared
            volume needs a class that provisions ReadWriteMany volumes.
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
    checkpoints: CheckpointMode = "none"
    checkpoint_size: str | None = None
    checkpoint_class: str | None = None
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
        if self.checkpoints not in CHECKPOINT_MODES:
            raise ValueError(
                f"--checkpoints must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoints!r}"
            )
        for flag, value in (
            ("--memory-per-worker", self.memory_per_worker),
            ("--storage", self.storage),
            ("--checkpoint-size", self.checkpoint_storage),
            ("coordinator memory", self.coordinator_memory),
        ):
            if not re.fullmatch(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", value):
                raise ValueError(f"{flag} {value!r} is not a Kubernetes quantity (e.g. 4Gi, 512Mi, 8G)")

    @property
    def checkpoint_storage(self) -> str:
        """The checkpoint volume's size."""
        return self.checkpoint_size or self.storage

    @property
    def checkpoint_storage_class(self) -> str | None:
        """The checkpoint volume's StorageClass (None: the cluster's default)."""
        return self.checkpoint_class or self.storage_class

    @property
    def worker_image(self) -> str:
        return self.image or (GPU_IMAGE if self.gpus_per_worker else IMAGE)
