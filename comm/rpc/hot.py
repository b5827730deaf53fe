"""The hot path of reading a reply: the plain envelope checked by hand, messages built without validation.

A caller that reads many replies of one kind (the coordinator reads one ``StepReply`` per stage per step)
pays for pydantic's validation of the envelope and of the body on every one. This module holds what lets
it skip both where the input is plainly valid, and never anywhere else ([Note: a fast path that only
accepts]):

* :func:`plain_reply` reads a reply envelope's map (as :func:`comm.codec.unpack_raw` returns it) when it
  is the common case, a successful reply without tensors, checked field by field as
  :class:`~comm.rpc.envelope.ReplyEnvelope` checks it;
* :func:`trusted` builds a message from values a hand-written check accepted, as ``model_validate``
  would have built it from the same map, without running the validator;
* :data:`BodyDecoder` is the shape of such a check for one body type (``services/protocol/hot.py``
  holds those of the hot replies).

[Note: a fast path that only accepts]
A hand-written check must never change what the wire accepts or the error a bad frame gets. So each
check here only *accepts*: it returns the message (or the envelope's fields) when every field is of the
exact type, size and bound the pydantic model requires, and None for anything else, unusual or wrong;
the caller then runs the model's own validation on the same map, which accepts or refuses it with its
usual message. A check may decline valid input it does not bother with (a float field sent as an int,
which pydantic converts; a non-empty list of checkpoint parts): that costs the slow path, never a
different answer. What must hold, and ``tests/unit/comm/rpc/test_hot.py`` proves on random, mutated
and seed messages, is: whenever a check accepts, pydantic accepts the same map and builds an equal
message (the same values, the same set of fields given).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

__all__ = ["BodyDecoder", "plain_reply", "trusted"]

M = TypeVar("M", bound=BaseModel)
BodyDecoder = Callable[[dict[str, Any]], BaseModel | None]
"""A body's hand-written check: the message, or None to leave the map to the model's validation."""

_ENVELOPE_KEYS = frozenset({"id", "ok", "body", "error", "tensors"})
_new = object.__new__
_set = object.__setattr__
_is_str = str.__instancecheck__


def plain_reply(fields: Mapping[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """``(id, body)`` of a successful reply without tensors whose envelope is valid, else None.

    ``fields`` is the envelope's map without the protocol version (:func:`comm.codec.unpack_raw`).
    None leaves it to :class:`~comm.rpc.envelope.ReplyEnvelope` (an error reply, tensors, anything odd).
    """
    if not fields.keys() <= _ENVELOPE_KEYS:
        return None
    request_id, body = fields.get("id"), fields.get("body")
    if (type(request_id) is not int or request_id < 0 or fields.get("ok") is not True
            or type(body) is not dict or fields.get("error") is not None or fields.get("tensors", []) != []):
        return None
    if not all(map(_is_str, body)):  # dict[str, Any]: msgpack may give bytes keys
        return None
    return request_id, body


def trusted(model: type[M], values: dict[str, Any]) -> M:
    """``model`` holding ``values`` (every field, in field order), built without validation.

    Only for values a hand-written check accepted ([Note: a fast path that only accepts]): the
    message is what ``model.model_validate`` returns for a map giving every field (its set of fields
    given is all of them). Nested messages must be built the same way first.
    """
    message = _new(model)
    _set(message, "__dict__", values)
    _set(message, "__pydantic_fields_set__", set(values))
    _set(message, "__pydantic_extra__", None)
    _set(message, "__pydantic_private__", None)
    return message
