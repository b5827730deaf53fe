"""Wire messages of the served registry (:mod:`comm.registry.server` / :mod:`comm.registry.remote`).

One ZeroMQ frame per message, encoded by :mod:`comm.codec` (msgpack map plus the
protocol version ``v``). Requests and replies are two discriminated unions on the
``type`` field; every request carries an ``id`` that its reply echoes, so a client
can drop a late reply to a request it already gave up on.

Example, a put and its reply (as msgpack maps)::

    {"v": 1, "type": "put", "id": 7, "key": "/job/w/0", "value": b"...", "lease": 12}
    {"v": 1, "type": "revision", "id": 7, "revision": 42}

A watch is a long poll: ``watch_poll`` asks for the events under ``prefix`` from
``from_revision`` on, and the server answers as soon as there are some or after
``wait_ms`` with none; the reply's ``revision`` is where the next poll resumes
(``revision + 1``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from comm.codec import Message, unpack_raw
from comm.errors import ProtocolError
from comm.registry.base import EventType, KeyValue, WatchEvent

__all__ = [
    "MAX_POLL_EVENTS",
    "MAX_POLL_WAIT_MS",
    "BadMessage",
    "BoolReply",
    "CasRequest",
    "DeleteRequest",
    "ErrorKind",
    "ErrorReply",
    "EventMsg",
    "EventsReply",
    "GetReply",
    "GetRequest",
    "KeyValueMsg",
    "LeaseGrantRequest",
    "LeaseRefreshRequest",
    "LeaseReply",
    "LeaseRevokeRequest",
    "ListReply",
    "ListRequest",
    "OkReply",
    "PutRequest",
    "Reply",
    "Request",
    "RevisionReply",
    "RevisionRequest",
    "WatchPollRequest",
    "decode_reply",
    "decode_request",
]

MAX_POLL_WAIT_MS = 60_000
MAX_POLL_EVENTS = 10_000

RequestId = Annotated[int, Field(ge=0, lt=1 << 63)]
LeaseId = Annotated[int, Field(ge=0, lt=1 << 63)]


class KeyValueMsg(Message):
    key: str
    value: bytes
    revision: int

    @classmethod
    def of(cls, kv: KeyValue) -> KeyValueMsg:
        return cls(key=kv.key, value=kv.value, revision=kv.revision)

    def to_key_value(self) -> KeyValue:
        return KeyValue(self.key, self.value, self.revision)


class EventMsg(Message):
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int

    @classmethod
    def of(cls, event: WatchEvent) -> EventMsg:
        kind: Literal["put", "delete"] = "put" if event.type is EventType.PUT else "delete"
        return cls(kind=kind, key=event.key, value=event.value, revision=event.revision)

    def to_event(self) -> WatchEvent:
        return WatchEvent(EventType(self.kind), self.key, self.value, self.revision)


# -- requests ---------------------------------------------------------------------------


class PutRequest(Message):
    type: Literal["put"] = "put"
    id: RequestId
    key: str
    value: bytes
    lease: LeaseId | None = None


class GetRequest(Message):
    type: Literal["get"] = "get"
    id: RequestId
    key: str


class DeleteRequest(Message):
    type: Literal["delete"] = "delete"
    id: RequestId
    key: str


class ListRequest(Message):
    type: Literal["list"] = "list"
    id: RequestId
    prefix: str


class CasRequest(Message):
    type: Literal["cas"] = "cas"
    id: RequestId
    key: str
    expected: bytes | None
    value: bytes
    lease: LeaseId | None = None


class LeaseGrantRequest(Message):
    type: Literal["lease_grant"] = "lease_grant"
    id: RequestId
    ttl_ms: int = Field(gt=0, le=365 * 24 * 3600 * 1000)


class LeaseRefreshRequest(Message):
    type: Literal["lease_refresh"] = "lease_refresh"
    id: RequestId
    lease: LeaseId


class LeaseRevokeRequest(Message):
    type: Literal["lease_revoke"] = "lease_revoke"
    id: RequestId
    lease: LeaseId


class RevisionRequest(Message):
    type: Literal["revision"] = "revision"
    id: RequestId


class WatchPollRequest(Message):
    type: Literal["watch_poll"] = "watch_poll"
    id: RequestId
    prefix: str
    from_revision: int = Field(ge=1)
    wait_ms: int = Field(ge=0, le=MAX_POLL_WAIT_MS)
    limit: int = Field(default=1000, ge=1, le=MAX_POLL_EVENTS)


Request = Annotated[
    PutRequest
    | GetRequest
    | DeleteRequest
    | ListRequest
    | CasRequest
    | LeaseGrantRequest
    | LeaseRefreshRequest
    | LeaseRevokeRequest
    | RevisionRequest
    | WatchPollRequest,
    Field(discriminator="type"),
]

# -- replies ----------------------------------------------------------------------------


class RevisionReply(Message):
    """Reply to ``put`` and ``revision``."""

    type: Literal["revision"] = "revision"
    id: RequestId
    revision: int


class GetReply(Message):
    type: Literal["get"] = "get"
    id: RequestId
    kv: KeyValueMsg | None


class BoolReply(Message):
    """Reply to ``delete`` (existed) and ``cas`` (written)."""

    type: Literal["bool"] = "bool"
    id: RequestId
    value: bool


class ListReply(Message):
    type: Literal["list"] = "list"
    id: RequestId
    items: list[KeyValueMsg]


class LeaseReply(Message):
    type: Literal["lease"] = "lease"
    id: RequestId
    lease: LeaseId
    ttl_ms: int


class OkReply(Message):
    """Reply to ``lease_refresh`` and ``lease_revoke``."""

    type: Literal["ok"] = "ok"
    id: RequestId


class EventsReply(Message):
    type: Literal["events"] = "events"
    id: RequestId
    events: list[EventMsg]
    revision: int  # the poll covered every revision up to this one: resume at revision + 1


ErrorKind = Literal["protocol", "registry", "value", "internal"]


class ErrorReply(Message):
    """The request failed. ``id`` is None when the request was too malformed to read one.

    ``kind``: ``protocol`` (the request was malformed: :class:`ProtocolError`),
    ``registry`` (:class:`RegistryError`, e.g. an expired lease or a compacted revision),
    ``value`` (a bad argument: :class:`ValueError`), ``internal`` (a server bug).
    """

    type: Literal["error"] = "error"
    id: RequestId | None
    kind: ErrorKind
    message: str


Reply = Annotated[
    RevisionReply | GetReply | BoolReply | ListReply | LeaseReply | OkReply | EventsReply | ErrorReply,
    Field(discriminator="type"),
]

_REQUESTS: TypeAdapter[Request] = TypeAdapter(Request)
_REPLIES: TypeAdapter[Reply] = TypeAdapter(Reply)


class BadMessage(ProtocolError):
    """A malformed request or reply; ``request_id`` is its ``id`` when one could be read."""

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def decode_request(frame: bytes) -> Request:
    """Decode and validate one request frame.

    Raises:
        BadMessage: naming each bad field and the reason (not msgpack, another protocol
            version, an unknown ``type``, a missing, extra or mistyped field).
    """
    what = "registry request"
    body, request_id = _unpack(frame, what)
    try:
        return _REQUESTS.validate_python(body)
    except ValidationError as exc:
        raise BadMessage(f"{what}: {_describe(exc)}", request_id=request_id) from None


def decode_reply(frame: bytes) -> Reply:
    """Decode and validate one reply frame (raises :class:`BadMessage` as :func:`decode_request`)."""
    what = "registry reply"
    body, request_id = _unpack(frame, what)
    try:
        return _REPLIES.validate_python(body)
    except ValidationError as exc:
        raise BadMessage(f"{what}: {_describe(exc)}", request_id=request_id) from None


def _unpack(frame: bytes, what: str) -> tuple[dict[str, Any], int | None]:
    """The msgpack map (version checked) and its ``id`` when that is a valid id."""
    try:
        body = unpack_raw(frame, what=what)
    except ProtocolError as exc:
        raise BadMessage(str(exc)) from None
    request_id = body.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id < 1 << 63:
        request_id = None
    return body, request_id


def _describe(exc: ValidationError) -> str:
    """One clause per bad field: ``field 'key' of a 'put' message: Input should be a valid string``."""
    parts = []
    for err in exc.errors():
        loc = err["loc"]
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            parts.append(f"field 'type': {err['msg']}")
        elif loc:
            field_name = ".".join(str(p) for p in loc[1:]) or "<message>"
            parts.append(f"field {field_name!r} of a {loc[0]!r} message: {err['msg']}")
        else:
            parts.append(f"<message>: {err['msg']}")
    return "; ".join(parts)
