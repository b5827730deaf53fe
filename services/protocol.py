"""Every control message of cellmesh's services, in one module.

Each message is a strict pydantic model (``comm.codec.Message``: no coercion, no extra
fields, frozen), encoded with msgpack by ``comm.codec``; the protocol version travels in
every envelope. Tensors never travel inside these bodies: a message lists
:class:`TensorSpec` entries and the tensors follow as raw ZeroMQ frames.

Envelopes (frame 0 of every RPC message):

* :class:`RequestEnvelope` — ``{v, id, service, method, body, tensors}``
* :class:`ReplyEnvelope` — ``{v, id, ok, body | error, tensors}``

Bodies, by service: worker control (``Assignment``, ``WorkerStatus``...), push/pull
(``PullRequest``, ``PushRequest``...), barrier (``BarrierArrive``...), cell compute
(``RunActions``...). Extra message types are added here, never invented elsewhere.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from comm.codec import Message
from comm.wire import DTYPES, MAX_NDIM, MAX_TENSOR_BYTES

__all__ = [
    "Assignment",
    "AssignmentReply",
    "BarrierArrive",
    "BarrierReleased",
    "Empty",
    "ErrorBody",
    "OptimizerSpec",
    "ParamInfo",
    "PullReply",
    "PullRequest",
    "PushReply",
    "PushRequest",
    "ReplyEnvelope",
    "RequestEnvelope",
    "ShardSetup",
    "TensorSpec",
    "WorkerCard",
    "WorkerStatus",
]

Name = Annotated[str, Field(min_length=1, max_length=256)]


class TensorSpec(Message):
    """A tensor that follows the envelope as ``frames`` raw frames (split at 1 MiB)."""

    name: Name
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_NDIM)
    frames: int = Field(ge=1, le=1 << 20)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"unknown dtype {v!r}; known: {', '.join(DTYPES)}")
        return v

    @field_validator("shape")
    @classmethod
    def _sane_size(cls, v: list[int]) -> list[int]:
        if math.prod(v) > MAX_TENSOR_BYTES:
            raise ValueError(f"shape {v} has more than {MAX_TENSOR_BYTES} elements")
        return v

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class RequestEnvelope(Message):
    id: int = Field(ge=0)
    service: Name
    method: Name
    body: dict[str, Any]
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=1 << 16)


class ErrorBody(Message):
    code: str
    message: str


class ReplyEnvelope(Message):
    id: int = Field(ge=0)
    ok: bool
    body: dict[str, Any] | None = None
    error: ErrorBody | None = None
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=1 << 16)


class Empty(Message):
    """A body with nothing in it."""


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


class Assignment(Message):
    """Host a service: built by an importable factory, never by shipped code."""

    service: Name  # the name the service is addressed by on this worker
    kind: Literal["param_server", "barrier", "compute"]
    factory: str = ""  # "package.module:function" that builds the model's cells (compute, PS)
    cells: list[int] = Field(default_factory=list)  # [start, stop) cell range for compute
    seed: int = 0
    options: dict[str, Any] = Field(default_factory=dict)  # plan fields the service needs


class AssignmentReply(Message):
    service: str
    address: str


class WorkerStatus(Message):
    name: str
    services: list[str]
    draining: bool


# -- push/pull (parameter server) -------------------------------------------------------


class OptimizerSpec(Message):
    """A ``torch.optim`` optimizer by class name, e.g. ``{"name": "Adam", "kwargs": {"lr": 1e-3}}``."""

    name: Name
    kwargs: dict[str, float | int | bool | list[float]] = Field(default_factory=dict)


class ParamInfo(Message):
    name: Name
    dtype: str
    shape: list[int]


class ShardSetup(Message):
    """Initialise a parameter shard: its parameters follow as tensors, one per name."""

    mode: Literal["sync", "async"]
    replicas: int = Field(ge=1)
    optimizer: OptimizerSpec
    staleness: int = Field(default=0, ge=0)  # async only: max versions ahead of the slowest replica


class PullRequest(Message):
    replica: int = Field(ge=0)
    min_version: int = Field(ge=0)  # wait until the shard reached this version (sync: the step)
    timeout_ms: int = Field(default=60_000, ge=0)


class PullReply(Message):
    version: int


class PushRequest(Message):
    """Gradients for ``step`` from ``replica``; ``seq`` makes a re-sent push idempotent."""

    replica: int = Field(ge=0)
    step: int = Field(ge=0)
    seq: int = Field(ge=0)


class PushReply(Message):
    version: int  # the shard's version after this push was taken (sync: may not be applied yet)
    duplicate: bool = False


# -- barrier ----------------------------------------------------------------------------


class BarrierArrive(Message):
    name: Name
    member: Name
    members: list[Name] = Field(min_length=1, max_length=1 << 14)
    timeout_ms: int = Field(ge=0)


class BarrierReleased(Message):
    name: str
    generation: int
