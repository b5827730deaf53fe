"""msgpack encoding of pydantic messages: the one serializer for every cellmesh control message.

A message is a pydantic model derived from :class:`Message` (strict, extra fields
forbidden, frozen). On the wire it is a msgpack map of its fields plus ``"v"``, the
protocol version. Nothing else is ever decoded from a socket: no pickle, no code.

Strict validation means a string is never coerced to an int and unknown keys are
rejected. msgpack has no tuple type, so message fields use ``list``, never ``tuple``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError

from comm.errors import ProtocolError

__all__ = ["PROTOCOL_VERSION", "Message", "describe_validation_error", "pack", "unpack", "unpack_raw"]

PROTOCOL_VERSION = 1
MAX_CONTROL_BYTES = 16 << 20

M = TypeVar("M", bound=BaseModel)


class Message(BaseModel):
    """Base of every control message: strict, closed, immutable."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def pack(message: BaseModel) -> bytes:
    body = message.model_dump(mode="python")
    body["v"] = PROTOCOL_VERSION
    data = msgpack.packb(body, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def unpack_raw(data: bytes, *, what: str = "message") -> dict[str, Any]:
    """Decode msgpack into a map and check the protocol version (before any model validation)."""
    if len(data) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"{what}: {len(data)} bytes is over the {MAX_CONTROL_BYTES}-byte limit")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_CONTROL_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{what}: not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what}: protocol version {version!r}, this process speaks {PROTOCOL_VERSION}; "
            "upgrade the older side"
        )
    return body


def unpack(data: bytes, model: type[M], *, what: str | None = None) -> M:
    """Decode ``data`` into ``model``; raise :class:`ProtocolError` naming the bad fields."""
    label = what or model.__name__
    body = unpack_raw(data, what=label)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ProtocolError(f"{label}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad field: ``field: reason``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<message>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
