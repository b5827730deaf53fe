"""The envelope of every request and reply, and the spec of each tensor that follows it.

A request is ``[RequestEnvelope, *tensor frames]``; a reply ``[ReplyEnvelope, *tensor
frames]``. Bodies are the services' own message models; the envelope carries them as plain
dicts, validated against the handler's model before the handler runs. Tensors never travel
inside a body: the envelope lists a :class:`TensorSpec` per tensor and the raw frames follow.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field, field_validator

from comm.codec import Message
from comm.wire import DTYPES, MAX_NDIM, MAX_TENSOR_BYTES

__all__ = ["Empty", "ErrorBody", "Name", "ReplyEnvelope", "RequestEnvelope", "TensorSpec"]

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
    """Frame 0 of a request: which method of which service, its body, and the tensors that follow.

    ``id`` is the sender's (from 1 up); the reply echoes it, so a late reply to a request
    the sender gave up on is never taken for the answer to the next one.
    """

    id: int = Field(ge=0)
    service: Name
    method: Name
    body: dict[str, Any]
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=1 << 16)


class ErrorBody(Message):
    """Why a request failed: ``code`` for programs (see :class:`~comm.rpc.framing.RpcError`),
    ``message`` for people (it names what was wrong and, where there is one, the fix)."""

    code: str
    message: str


class ReplyEnvelope(Message):
    """Frame 0 of a reply: ``body`` when ``ok``, else ``error``.

    ``id`` echoes the request's; it is 0 when the request was too malformed to read one.
    """

    id: int = Field(ge=0)
    ok: bool
    body: dict[str, Any] | None = None
    error: ErrorBody | None = None
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=1 << 16)


class Empty(Message):
    """A body with nothing in it."""
