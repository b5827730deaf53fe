"""The launcher conventions a worker honours: torchrun's variables and Kubeflow Trainer's ``PET_*``.

A pod (or any launcher) tells ``cellmesh worker`` who it is the way it would tell
``torchrun``:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` as torchrun
  sets them for the processes it starts;
- ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT``, ``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``: the
  ``PET_`` form of torchrun's own options, which the Kubeflow Trainer sets and torchrun
  reads as defaults of its command line.

As torchrun does, a worker started with only the ``PET_*`` form derives the rank
(``node_rank * nproc_per_node + local_rank``) and the world size (``nnodes *
nproc_per_node``) and exports ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT`` into its own environment (:meth:`LaunchEnv.export`), so model code that
calls ``torch.distributed.init_process_group("env://")`` finds them. cellmesh itself meets
its peers through the registry; the rank names the worker (``worker-{rank}``) and orders
it among the job's workers, and the world size tells the coordinator how many to expect.

An etcd rendezvous (``PET_RDZV_BACKEND=etcd`` or ``etcd-v2`` with ``PET_RDZV_ENDPOINT``)
is the worker's registry and ``PET_RDZV_ID`` its job, unless ``CELLMESH_REGISTRY`` and
``CELLMESH_JOB`` say otherwise. ``CELLMESH_CPUS`` and ``CELLMESH_MEMORY_BYTES`` (a pod's
limits, through the downward API) are what the worker reports it may use; ``CELLMESH_MEMORY_LIMIT``
is ``--memory-limit``'s default (the cap the worker enforces: ``comm/memcap.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LaunchEnv", "LaunchEnvError", "read_launch_env"]

REGISTRY_ENV = "CELLMESH_REGISTRY"
JOB_ENV = "CELLMESH_JOB"
CPUS_ENV = "CELLMESH_CPUS"
MEMORY_ENV = "CELLMESH_MEMORY_BYTES"
MEMORY_LIMIT_ENV = "CELLMESH_MEMORY_LIMIT"
ETCD_RDZV_BACKENDS = ("etcd", "etcd-v2")


class LaunchEnvError(ValueError):
    """A launcher variable is malformed or contradicts another; the message names it."""


class LaunchEnv(BaseModel):
    """What the environment says about this worker (None: not said)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, ge=1)
    local_rank: int | None = Field(default=None, ge=0)
    master_addr: str | None = None
    master_port: int | None = Field(default=None, ge=1, le=65535)
    registry: str | None = None
    job: str | None = None
    cpus: int | None = Field(default=None, ge=1)
    memory_bytes: int | None = Field(default=None, ge=1)
    memory_limit: int | None = Field(default=None, ge=1)

    def default_name(self) -> str | None:
        """``worker-{rank}`` when the rank is known."""
        return None if self.rank is None else f"worker-{self.rank}"

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set torchrun's variables that are known and unset (torchrun sets them for its children)."""
        environ = os.environ if environ is None else environ
        values = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
                  "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port}
        for key, value in values.items():
            if value is not None and not environ.get(key):
                environ[key] = str(value)


def _int(environ: Mapping[str, str], key: str, *, low: int = 0) -> int | None:
    text = environ.get(key, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise LaunchEnvError(f"{key}={text!r} is not an integer") from None
    if value < low:
        raise LaunchEnvError(f"{key}={value} must be >= {low}")
    return value


def _nnodes(environ: Mapping[str, str]) -> int | None:
    text = environ.get("PET_NNODES", "").strip()
    if ":" in text:  # torchrun's elastic MIN:MAX; a cellmesh job has a fixed size
        low, _, high = text.partition(":")
        if low.strip() != high.strip():
            raise LaunchEnvError(f"PET_NNODES={text!r}: an elastic range is not supported; cellmesh "
                                 "jobs have a fixed number of workers (give PET_NNODES=N)")
        return _int({"PET_NNODES": low}, "PET_NNODES", low=1)
    return _int(environ, "PET_NNODES", low=1)


def _agree(name: str, direct: int | None, derived: int | None, how: str) -> int | None:
    if direct is not None and derived is not None and direct != derived:
        raise LaunchEnvError(f"{name}={direct} contradicts {how}={derived}; set one or make them agree")
    return direct if direct is not None else derived


def _registry(environ: Mapping[str, str]) -> str | None:
    explicit = environ.get(REGISTRY_ENV, "").strip()
    if explicit:
        return explicit
    backend = environ.get("PET_RDZV_BACKEND", "").strip()
    endpoint = environ.get("PET_RDZV_ENDPOINT", "").strip()
    if not backend:
        return None
    if backend not in ETCD_RDZV_BACKENDS:
        raise LaunchEnvError(f"PET_RDZV_BACKEND={backend!r}: cellmesh meets its peers through etcd "
                             f"({' or '.join(ETCD_RDZV_BACKENDS)}) or a registry given by {REGISTRY_ENV} "
                             "or --registry")
    if not endpoint:
        raise LaunchEnvError(f"PET_RDZV_BACKEND={backend} needs PET_RDZV_ENDPOINT=host:port")
    endpoint = endpoint.split(",")[0].removeprefix("http://")
    return f"etcd://{endpoint}"


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read torchrun's and the ``PET_*`` variables (see the module docstring).

    Raises:
        LaunchEnvError: A variable is not a number where one is needed, the two forms
            disagree, the rank is not below the world size, or ``PET_NPROC_PER_NODE`` is
            not 1 (a cellmesh worker is one process per pod).
    """
    environ = os.environ if environ is None else environ
    nnodes = _nnodes(environ)
    node_rank = _int(environ, "PET_NODE_RANK")
    nproc = environ.get("PET_NPROC_PER_NODE", "").strip()
    if nproc and nproc != "1":
        raise LaunchEnvError(f"PET_NPROC_PER_NODE={nproc!r}: a cellmesh worker is one process per pod, so "
                             "it must be 1 (give a pod more CPUs or GPUs instead of more processes)")
    local_rank = _int(environ, "LOCAL_RANK")
    world_size = _agree("WORLD_SIZE", _int(environ, "WORLD_SIZE", low=1), nnodes, "PET_NNODES")
    rank = _agree("RANK", _int(environ, "RANK"), node_rank, "PET_NODE_RANK")
    if rank is not None and world_size is not None and rank >= world_size:
        raise LaunchEnvError(f"RANK={rank} is not below WORLD_SIZE={world_size}")
    if rank is not None and local_rank is None:
        local_rank = 0
    master_addr = environ.get("MASTER_ADDR", "").strip() or environ.get("PET_MASTER_ADDR", "").strip() or None
    master_port = _agree("MASTER_PORT", _int(environ, "MASTER_PORT", low=1),
                         _int(environ, "PET_MASTER_PORT", low=1), "PET_MASTER_PORT")
    if master_port is not None and master_port > 65535:
        raise LaunchEnvError(f"MASTER_PORT={master_port} is not a TCP port")
    job = environ.get(JOB_ENV, "").strip() or environ.get("PET_RDZV_ID", "").strip() or None
    return LaunchEnv(rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
                     master_port=master_port, registry=_registry(environ), job=job,
                     cpus=_int(environ, CPUS_ENV, low=1), memory_bytes=_int(environ, MEMORY_ENV, low=1),
                     memory_limit=_int(environ, MEMORY_LIMIT_ENV, low=1))
