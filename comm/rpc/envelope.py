"""The envelope of every request and reply, and the spec of each tensor that follows it.

A request is ``[RequestEnvelope, *tensor frames]``; a reply ``[ReplyEnvelope, *tensor
frames]``. Bodies are the services' own message models; the envelope carries them as plain
dicts, validated against the handler's model before the handler runs. Tensors never travel
inside a body: the envelope lists a :class:`TensorSpec` per tensor and the raw frames follow.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from comm.codec import Message
from comm.wire import MAX_NDIM, tensor_nbytes

__all__ = ["Empty", "ErrorBody", "Name", "ReplyEnvelope", "RequestEnvelope", "TensorMeta", "TensorSpec"]

Name = Annotated[str, Field(min_length=1, max_length=256)]


class TensorMeta(Message):
    """A named tensor's dtype and shape, as a peer announces it: the base of every such message.

    The one size check (:func:`comm.wire.tensor_nbytes`: a known dtype, at most ``MAX_NDIM``
    dims, at most ``MAX_TENSOR_BYTES`` bytes) runs on every subclass: the RPC layer's
    :class:`TensorSpec`, and the parameters and boundary tensors of ``services/protocol/``.
    """

    name: Name
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_NDIM)

    @model_validator(mode="after")
    def _within_the_limit(self) -> TensorMeta:
        tensor_nbytes(self.dtype, self.shape)  # a WireError is a ValueError: pydantic reports it
        return self

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


class TensorSpec(TensorMeta):
    """A tensor that follows the envelope as ``frames`` raw frames (split at ``CHUNK_BYTES``)."""

    frames: int = Field(ge=1, le=1 << 20)


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
