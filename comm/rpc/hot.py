"""The hot path of the coordinator's messages: messages built without validation, requests packed once.

A caller that sends and reads many messages of one kind (the coordinator sends one ``run_step`` and reads
one ``StepReply`` per stage per step) pays for pydantic's validation and for building maps and lists on
every one. This module holds what lets it skip them where that changes nothing ([Note: a fast path that
only accepts]):

* :func:`trusted` builds a message from values a check accepted, as ``model_validate`` would have built
  it from the same map, without running the validator (``services/protocol/hot.py`` checks the step
  reply in C and builds it so);
* :class:`PackedBody` and :class:`RequestHeads` build a request's envelope from a body packed once and
  the envelope's constant part packed once per service and method ([Note: a request packed once]).

[Note: a fast path that only accepts]
A fast check must never change what the wire accepts or the error a bad frame gets. So each check only
*accepts*: it returns the message when every field is of the exact type, size and bound the pydantic
model requires, and None for anything else, unusual or wrong; the caller then runs the model's own
validation on the same frame, which accepts or refuses it with its usual message. A check may decline
valid input it does not bother with (a field left out, which the model fills with its default; a
non-empty list of checkpoint parts): that costs the slow path, never a different answer. What must hold,
and ``tests/unit/comm/rpc/test_hot.py`` proves on random, mutated and seed messages, is: whenever a
check accepts, pydantic accepts the same frame and builds an equal message (the same values, the same
set of fields given).

[Note: a request packed once]
A msgpack map is its entries in any order, so a request's envelope can be written as bytes: the map's
header and its constant entries (the protocol version, the service, the method, no tensors, the key
``body``) packed once per service and method (:class:`RequestHeads`), then the body's bytes, then the
``id`` entry. The body is packed once however many services get it (:class:`PackedBody`: a step's
request is the same for every stage of a replica), and nothing of the envelope is built per request
but two small byte strings. The receiver reads the same map as from :func:`comm.rpc.framing.request_frames`
(``tests/unit/comm/rpc/test_hot.py`` compares them) and validates it as it validates any request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel

from comm.codec import PROTOCOL_VERSION

__all__ = ["PackedBody", "RequestHeads", "trusted"]

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
_set = object.__setattr__
_packb = msgpack.packb
_HEADS = 4096  # (service, method) pairs a RequestHeads keeps (then it starts again: runs come and go)
_ALL_FIELDS: dict[type[BaseModel], set[str]] = {}  # per model: the fields-given set its messages share


def trusted(model: type[M], values: dict[str, Any], fields: frozenset[str] | None = None) -> M:
    """``model`` holding ``values`` (every field, in field order), built without validation.

    Only for values a check accepted ([Note: a fast path that only accepts]): the message is what
    ``model.model_validate`` returns for a map giving every field (its set of fields given is all of
    them). Nested messages must be built the same way first.

    ``fields``, the model's field names, lets every message of the model share one set of fields given
    (no set to build, hash and later free per message: 0.7 of 5 us a step reply). Only a frozen model's
    messages share it (the protocol's all are): no assignment reaches the set, pydantic only ever adds a
    name to such a set (a field's, already in it) and gives a copy its own.
    """
    message = _new(model)
    _set(message, "__dict__", values)
    if fields is None:
        given = set(values)
    elif (shared := _ALL_FIELDS.get(model)) is not None:
        given = shared
    else:
        given = set(fields)
        if model.model_config.get("frozen"):  # a model whose messages can change keeps a set per message
            _ALL_FIELDS[model] = given
    _set(message, "__pydantic_fields_set__", given)
    _set(message, "__pydantic_extra__", None)
    _set(message, "__pydantic_private__", None)
    return message


class PackedBody:
    """A request's body packed once (msgpack), to go in one or several requests ([Note: a request packed
    once]); the body is the message dumped (``model_dump(mode="python")``), as ``EventLoop.send`` takes."""

    __slots__ = ("data",)

    def __init__(self, body: Mapping[str, Any]) -> None:
        data = _packb(body, use_bin_type=True)
        assert isinstance(data, bytes)
        self.data = data


class RequestHeads:
    """The constant part of each request envelope, packed once per (service, method)."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, str], bytes] = {}

    def frame(self, request_id: int, service: str, method: str, body: PackedBody) -> bytes:
        """The envelope of request ``request_id`` to ``service.method`` carrying ``body`` (no tensors)."""
        head = self._heads.get((service, method))
        if head is None:
            if len(self._heads) >= _HEADS:
                self._heads.clear()
            head = self._heads[(service, method)] = b"".join(
                [b"\x86", *map(_pack, ["v", PROTOCOL_VERSION, "service", service, "method", method,
                                        "tensors", [], "body"])])
        return head + body.data + _ID_KEY + _pack(request_id)


def _pack(value: object) -> bytes:
    data = _packb(value, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


_ID_KEY = _pack("id")
