"""The bodies of the served registry's requests and replies.

The registry is served as the ``registry`` service of a :class:`~comm.rpc.host.ServiceHost`
(:mod:`comm.registry.server`) and called through :class:`~comm.rpc.client.RpcClient`
(:mod:`comm.registry.remote`), so its messages travel in the one RPC envelope
(:mod:`comm.rpc.envelope`): the envelope carries the request id, the method and any error;
these models are only the bodies. Methods and their bodies::

    put           PutRequest           -> RevisionReply
    get           GetRequest           -> GetReply
    delete        DeleteRequest        -> BoolReply (it existed)
    list          ListRequest          -> ListReply
    cas           CasRequest           -> BoolReply (it was written)
    lease_grant   LeaseGrantRequest    -> LeaseReply
    lease_refresh LeaseRequest         -> Empty
    lease_revoke  LeaseRequest         -> Empty
    revision      Empty                -> RevisionReply
    watch_poll    WatchPollRequest     -> EventsReply

A watch is a long poll: ``watch_poll`` asks for the events under ``prefix`` from
``from_revision`` on, and the service answers as soon as there are some or after
``wait_ms`` with none; the reply's ``revision`` is where the next poll resumes
(``revision + 1``).

Error codes (:class:`~comm.rpc.framing.RpcError`): the host's own (``bad_request`` naming
the field, ``unknown_method``...), ``lease_expired`` (a :class:`~comm.errors.LeaseExpiredError`: the
lease named expired or was revoked), ``registry`` (any other :class:`~comm.errors.RegistryError`: a
compacted revision) and ``value`` (a bad argument).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from comm.codec import Message
from comm.registry.base import EventType, KeyValue, WatchEvent

__all__ = [
    "MAX_POLL_EVENTS",
    "MAX_POLL_WAIT_MS",
    "SERVICE",
    "BoolReply",
    "CasRequest",
    "DeleteRequest",
    "EventMsg",
    "EventsReply",
    "GetReply",
    "GetRequest",
    "KeyValueMsg",
    "LeaseGrantRequest",
    "LeaseReply",
    "LeaseRequest",
    "ListReply",
    "ListRequest",
    "PutRequest",
    "RevisionReply",
    "WatchPollRequest",
]

SERVICE = "registry"
"""The name the registry is served under on its host."""

MAX_POLL_WAIT_MS = 60_000
MAX_POLL_EVENTS = 10_000

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
    key: str
    value: bytes
    lease: LeaseId | None = None


class GetRequest(Message):
    key: str


class DeleteRequest(Message):
    key: str


class ListRequest(Message):
    prefix: str


class CasRequest(Message):
    key: str
    expected: bytes | None
    value: bytes
    lease: LeaseId | None = None


class LeaseGrantRequest(Message):
    ttl_ms: int = Field(gt=0, le=365 * 24 * 3600 * 1000)


class LeaseRequest(Message):
    """Names the lease to refresh or revoke."""

    lease: LeaseId


class WatchPollRequest(Message):
    prefix: str
    from_revision: int = Field(ge=1)
    wait_ms: int = Field(ge=0, le=MAX_POLL_WAIT_MS)
    limit: int = Field(default=1000, ge=1, le=MAX_POLL_EVENTS)


# -- replies ----------------------------------------------------------------------------


class RevisionReply(Message):
    """Reply to ``put`` and ``revision``."""

    revision: int


class GetReply(Message):
    kv: KeyValueMsg | None


class BoolReply(Message):
    """Reply to ``delete`` (existed) and ``cas`` (written)."""

    value: bool


class ListReply(Message):
    items: list[KeyValueMsg]


class LeaseReply(Message):
    lease: LeaseId
    ttl_ms: int


class EventsReply(Message):
    events: list[EventMsg]
    revision: int  # the poll covered every revision up to this one: resume at revision + 1
