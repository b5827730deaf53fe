"""Worker control: the card a worker publishes, and what the coordinator assigns it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from comm.codec import Message
from comm.rpc.envelope import Name

# -- worker control --------------------------------------------------------------------


class WorkerCard(Message):
    """What a worker publishes in the registry under ``{job}/workers/{name}``."""

    name: Name
    address: str
    pid: int
    cpus: int = Field(ge=1)
    memory_bytes: int = Field(ge=0)
    gpus: int = Field(ge=0)
    services: list[str] = Field(default_factory=list)
    rank: int | None = Field(default=None, ge=0)  # from RANK / PET_NODE_RANK (services/host/launch.py)
    world_size: int | None = Field(default=None, ge=1)  # from WORLD_SIZE / PET_NNODES
    # from LOCAL_RANK: the CUDA device a GPU stage runs on (coordinator/planning/devices.py)
    local_rank: int | None = Field(default=None, ge=0)
    # unique per process start: a replacement under the same name (a restarted pod) has another one
    incarnation: str = Field(default="", max_length=64)


class Assignment(Message):
    """Host a service: built by an importable factory, never by shipped code."""

    service: Name  # the name the service is addressed by on this worker
    kind: Literal["param_server", "barrier", "compute"]
    factory: str = ""  # "package.module:function" that builds the model (compute, PS)
    nodes: list[int] = Field(default_factory=list)  # [start, stop) range of the model's nodes for compute
    seed: int = 0
    options: dict[str, Any] = Field(default_factory=dict)  # plan fields the service needs


class Release(Message):
    """Stop hosting ``service`` (its ``on_close`` runs); releasing an unknown service is a no-op."""

    service: Name


class AssignmentReply(Message):
    service: str
    address: str


class WorkerStatus(Message):
    name: str
    services: list[str]
    draining: bool
    # the last training step each step service finished (a window of steps' progress when it failed)
    finished: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict, max_length=1 << 10)
