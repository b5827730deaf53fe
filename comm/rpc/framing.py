"""Frames of the one RPC layer: tensors as raw frames, requests and replies, and the error they carry.

A request is ``[RequestEnvelope, *tensor frames]``, a reply ``[ReplyEnvelope, *tensor
frames]`` (see :mod:`comm.rpc.envelope`). Every sender in cellmesh builds them here (the
service host, :class:`~comm.rpc.client.RpcClient`, :mod:`comm.rpc.pipeline`, the
coordinator's event loop) and every receiver reads them here, so there is one framing.

Each tensor is split into frames of at most :data:`comm.sockets.CHUNK_BYTES`. Envelopes
are packed straight from their fields (the map the envelope model would dump), not
through a model: the sender's side is the hot path of every step, and the receiver
validates everything anyway. Received tensors are read-only views of ZeroMQ's frames:
reduce from them or copy them, never write into them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgpack
import torch
import zmq
from pydantic import BaseModel, ValidationError

from comm.codec import PROTOCOL_VERSION, describe_validation_error, unpack_raw
from comm.errors import ProtocolError
from comm.rpc.envelope import ErrorBody, ReplyEnvelope, TensorSpec
from comm.sockets import CHUNK_BYTES
from comm.wire import DTYPES, dtype_name, tensor_bytes

__all__ = [
    "NamedTensors",
    "RpcError",
    "check_reply",
    "decode_tensors",
    "encode_tensors",
    "error_frames",
    "open_reply",
    "read_reply",
    "reply_fields",
    "reply_frames",
    "request_frames",
]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)
NamedTensors = Sequence[tuple[str, torch.Tensor]]


class RpcError(RuntimeError):
    """A service answered with an error; ``code`` says which kind.

    Codes of the layer itself: ``bad_request`` (the request did not validate; the message
    names the field), ``unknown_service``, ``unknown_method``, ``forbidden`` (the host's
    :data:`~comm.rpc.host.Authorizer` refused it), ``internal`` (a handler's bug), and
    ``closed`` (raised locally: the client was closed). Services add their own
    (``not_owner``, ``timeout``, ``registry``...).
    """

    def __init__(self, code: str, message: str, *, service: str = "", method: str = "") -> None:
        where = f"{service}.{method}: " if service else ""
        super().__init__(f"{where}[{code}] {message}")
        self.code = code
        self.message = message


# -- tensors as frames -------------------------------------------------------------------


def encode_tensors(tensors: NamedTensors) -> tuple[list[TensorSpec], list[Any]]:
    """Specs and frames (zero-copy views, at most CHUNK_BYTES each) for ``tensors``.

    The frames view the tensors' memory: keep the tensors unchanged until the send completed.
    """
    specs: list[TensorSpec] = []
    frames: list[Any] = []
    for name, t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        data = tensor_bytes(t)
        pieces = [data[o:o + CHUNK_BYTES] for o in range(0, data.nbytes, CHUNK_BYTES)] or [data[:0]]
        specs.append(TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                frames=len(pieces)))
        frames.extend(pieces)
    return specs, frames


def decode_tensors(specs: Sequence[TensorSpec], frames: Sequence[zmq.Frame]) -> dict[str, torch.Tensor]:
    """Tensors for ``specs`` from ``frames``, checked; single-frame tensors are zero-copy views.

    Raises:
        ProtocolError: frame count or a frame's length disagrees with the specs.
    """
    expected = sum(s.frames for s in specs)
    if expected != len(frames):
        raise ProtocolError(f"tensors: specs announce {expected} frames, the message has {len(frames)}")
    out: dict[str, torch.Tensor] = {}
    pos = 0
    for spec in specs:
        parts = frames[pos:pos + spec.frames]
        pos += spec.frames
        lengths = [len(f.buffer) for f in parts]
        if sum(lengths) != spec.nbytes or any(n > CHUNK_BYTES for n in lengths):
            raise ProtocolError(
                f"tensor {spec.name!r}: {spec.dtype}{spec.shape} needs {spec.nbytes} bytes in frames of at "
                f"most {CHUNK_BYTES}, got {lengths[:4]}{'...' if len(lengths) > 4 else ''}"
            )
        if spec.name in out:
            raise ProtocolError(f"tensor {spec.name!r} appears twice")
        dtype = DTYPES[spec.dtype]
        if spec.nbytes == 0:
            t = torch.empty(spec.shape, dtype=dtype)
        elif len(parts) == 1:
            t = torch.frombuffer(parts[0].buffer, dtype=dtype).view(spec.shape)
        else:
            flat = torch.empty(spec.nbytes, dtype=torch.uint8)
            o = 0
            for f in parts:
                n = len(f.buffer)
                flat[o:o + n].copy_(torch.frombuffer(f.buffer, dtype=torch.uint8))
                o += n
            t = flat.view(dtype).view(spec.shape)
        out[spec.name] = t
    return out


# -- building frames --------------------------------------------------------------------


def _packb(fields: dict[str, Any]) -> bytes:
    fields["v"] = PROTOCOL_VERSION
    data = msgpack.packb(fields, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def _dump(body: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(body, BaseModel):
        return body.model_dump(mode="python")
    return body if isinstance(body, dict) else dict(body)


def request_frames(request_id: int, service: str, method: str, body: BaseModel | Mapping[str, Any],
                   tensors: NamedTensors = ()) -> list[Any]:
    """``[envelope, *tensor frames]`` of one request (the frames view the tensors' memory).

    ``body`` is a message, or one already dumped (``model_dump(mode="python")``), which a
    caller sending the same large parts every step can build from cached pieces; the host
    validates it either way.
    """
    specs, frames = encode_tensors(tensors) if tensors else ([], [])
    envelope = {"id": request_id, "service": service, "method": method, "body": _dump(body),
                "tensors": [s.model_dump() for s in specs]}
    return [_packb(envelope), *frames]


def reply_frames(request_id: int, body: BaseModel, tensors: NamedTensors = ()) -> list[Any]:
    """``[envelope, *tensor frames]`` of a successful reply to request ``request_id``."""
    specs, frames = encode_tensors(tensors) if tensors else ([], [])
    envelope = {"id": request_id, "ok": True, "body": _dump(body), "error": None,
                "tensors": [s.model_dump() for s in specs]}
    return [_packb(envelope), *frames]


def error_frames(request_id: int, code: str, message: str) -> list[Any]:
    """The one frame of an error reply (``request_id`` 0 when the request had no readable id)."""
    error = {"code": code, "message": message}
    envelope: dict[str, Any] = {"id": request_id, "ok": False, "body": None, "error": error, "tensors": []}
    return [_packb(envelope)]


# -- reading replies --------------------------------------------------------------------


def read_reply(frame: bytes, source: str) -> ReplyEnvelope | None:
    """The reply envelope in ``frame``, or None (logged, naming ``source``) when it is malformed."""
    fields = reply_fields(frame, source)
    return None if fields is None else check_reply(fields, source)


def reply_fields(frame: bytes, source: str) -> dict[str, Any] | None:
    """The map in a reply's ``frame`` (version checked, not validated), or None (logged) when it is none.

    :func:`read_reply` in two halves, for a reader that looks at the map before it validates it with
    :func:`check_reply`.
    """
    try:
        return unpack_raw(frame, what="reply envelope")
    except ProtocolError as exc:
        log.error("dropped a malformed reply from %s: %s", source, exc)
    return None


def check_reply(fields: dict[str, Any], source: str) -> ReplyEnvelope | None:
    """``fields`` validated as a :class:`ReplyEnvelope`, or None (logged, naming ``source``)."""
    try:
        return ReplyEnvelope.model_validate(fields)
    except ValidationError as exc:
        log.error("dropped a malformed reply from %s: reply envelope: %s", source,
                  describe_validation_error(exc))
    return None


def open_reply(reply: ReplyEnvelope, frames: Sequence[zmq.Frame], reply_type: type[R], service: str,
               method: str) -> tuple[R, dict[str, torch.Tensor]]:
    """The body (validated as ``reply_type``) and tensors of ``reply`` to ``service.method``.

    Raises:
        RpcError: the reply is an error.
        ProtocolError: the body does not fit ``reply_type`` or the tensors their specs
            (the host speaks another version of the service).
    """
    if not reply.ok:
        error = reply.error or ErrorBody(code="internal", message="error reply without error")
        raise RpcError(error.code, error.message, service=service, method=method)
    try:
        body = reply_type.model_validate(reply.body or {})
    except ValidationError as exc:
        raise ProtocolError(f"reply of {service}.{method}: {reply_type.__name__}: "
                            f"{describe_validation_error(exc)}") from None
    return body, decode_tensors(reply.tensors, frames)
