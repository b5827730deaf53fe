"""What a service is: ``rpc_*`` methods with typed requests, the roles that may call them, and a call in hand.

:class:`ServiceBase` finds a service's ``rpc_<method>(self, request, call)`` methods by
reflection, with the pydantic request type of each from its annotation (as hivemind's
ServicerBase does) and the roles that may call it (:func:`callable_by`; the coordinator
alone by default). A :class:`Call` is one request in a handler's hands: who sent it
(:class:`Peer`), its tensors, and the means to answer it now or later. The
:class:`~comm.rpc.host.ServiceHost` serves them.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel

from comm import auth
from comm.rpc.envelope import RequestEnvelope
from comm.rpc.framing import NamedTensors, error_frames, reply_frames

if TYPE_CHECKING:
    from comm.rpc.host import ServiceHost, _Deferred

__all__ = ["CONTROL", "Authorizer", "Call", "Handler", "Method", "OnTimeout", "Peer", "ServiceBase",
           "allow_all", "callable_by"]

Handler = Callable[[Any, "Call"], BaseModel | None]
OnTimeout = Callable[[], tuple[str, str] | BaseModel]
"""What a deferred call answers when its time is up: an error ``(code, message)`` or a reply body."""
_ROLES_ATTR = "__cellmesh_rpc_roles__"

CONTROL: frozenset[str] = frozenset({"coordinator"})
"""Who may call a method that says nothing (:func:`callable_by`): the coordinator alone."""


_F = TypeVar("_F", bound=Callable[..., Any])


def callable_by(*roles: auth.Role) -> Callable[[_F], _F]:
    """Declare which roles may call an ``rpc_*`` method (default :data:`CONTROL`, the coordinator).

    Checked by the host against the role the job's keys authenticated the sender as (the
    connection's ``User-Id``), per request, before the body is read. Data methods that a
    worker's peers call (push/pull, barriers, the registry) name ``"worker"``.
    """
    if not roles or any(r not in auth.ROLES for r in roles):
        raise ValueError(f"callable_by needs one or more of {auth.ROLES}, got {roles}")

    def mark(fn: _F) -> _F:
        setattr(fn, _ROLES_ATTR, frozenset(roles))
        return fn

    return mark


@dataclass(frozen=True, slots=True)
class Method:
    """One ``rpc_*`` method of a hosted service: its handler, request type and the roles that may call it."""

    handler: Handler
    request_type: type[BaseModel]
    roles: frozenset[str]


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a request.

    Attributes:
        identity: the ROUTER identity of the sender's connection (one per client socket).
        user: who the connection authenticated as (the ZAP handler's ``User-Id``); None
            while the host's sockets do not authenticate.
        address: the connection's peer address (an IP; "" when unknown). Unlike the
            identity it stays the same when a client reconnects, so faults are warned
            about per address.
    """

    identity: bytes
    user: str | None = None
    address: str = ""


Authorizer = Callable[[str, str, Peer], str | None]
"""``authorize(service, method, peer)``: None to serve the request, else the reason it is refused.

Called on the host thread for every request whose envelope is valid, before the service
is looked up (so a refused peer learns nothing about what is hosted); the refusal is
answered ``forbidden`` with the reason. It must be fast and must not block.
"""


def allow_all(service: str, method: str, peer: Peer) -> str | None:
    """The default :data:`Authorizer`: every peer may call every method (no authentication yet)."""
    return None


class Call:
    """One request in a handler's hands: its sender, its tensors, and the means to answer it."""

    def __init__(self, host: ServiceHost, peer: Peer, envelope: RequestEnvelope,
                 tensors: dict[str, torch.Tensor]) -> None:
        self.host = host
        self.peer = peer
        self.envelope = envelope
        self.tensors = tensors
        self.tensors_out: list[tuple[str, torch.Tensor]] = []
        self.answered = False  # read and written on the host thread only
        self.deferred = False
        self.deadline: _Deferred | None = None  # its entry in the host's heap, while it waits there

    def defer(self, timeout: timedelta, on_timeout: OnTimeout) -> None:
        """Answer later with :meth:`reply`/:meth:`fail`; unanswered after ``timeout``, the host
        answers what ``on_timeout()`` returns (called on the host thread)."""
        self.deferred = True
        self.host._defer(self, timeout, on_timeout)

    def reply(self, body: BaseModel, tensors: NamedTensors = ()) -> None:
        """Answer the call; from any thread (the frames are built here, sent by the host thread).

        The tensors are sent zero-copy: keep them unchanged until the reply is on its way.
        """
        frames = reply_frames(self.envelope.id, body, tensors)
        self.host.post(lambda: self.host._answer(self, frames))

    def fail(self, code: str, message: str) -> None:
        """Answer the call with an error; from any thread."""
        frames = error_frames(self.envelope.id, code, message)
        self.host.post(lambda: self.host._answer(self, frames))


class ServiceBase:
    """Base of every service: ``rpc_*`` methods are found by reflection with their request types.

    Attributes:
        error_codes: exceptions a handler raises as an answer rather than as a bug, each with
            the error code it is answered with (the first match wins; ``str(exc)`` is the
            message). Any other exception is logged with its traceback and answered
            ``internal``; :class:`RpcError` always answers its own code.
    """

    error_codes: ClassVar[tuple[tuple[type[Exception], str], ...]] = ()
    # the last training step the service finished (None: none yet or not a step service), which its
    # worker's status reports: where a window of several steps stopped (WorkerStatus.finished)
    finished_step: int | None = None

    def rpc_methods(self) -> dict[str, Method]:
        methods: dict[str, Method] = {}
        for name, fn in inspect.getmembers(self, predicate=inspect.ismethod):
            if not name.startswith("rpc_") or name == "rpc_methods":
                continue
            hints = typing.get_type_hints(fn)
            params = [p for p in inspect.signature(fn).parameters if p != "self"]
            request_type = hints.get(params[0]) if params else None
            if not (isinstance(request_type, type) and issubclass(request_type, BaseModel)):
                raise ValueError(
                    f"{type(self).__name__}.{name} must be annotated "
                    "`def rpc_x(self, request: SomeMessage, call: Call) -> Reply | None`"
                )
            methods[name[4:]] = Method(fn, request_type, getattr(fn, _ROLES_ATTR, CONTROL))
        return methods

    def on_close(self) -> None:
        """Called once when the service is removed or the host stops."""
