"""The barrier service: named barriers with generations.

The n-th use of the barrier named X releases only when every member has arrived for the
n-th time: a member that arrives again before its generation released simply waits for
the next generation, so a fast member can never slip through a later use early.

An arrival carries the full member list (every member must pass the same one) and its
own timeout; when it runs out, the arrival is answered with a ``timeout`` error that
names the members that did not arrive, and the generation stays open for the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from comm.rpc import Call, RpcError, ServiceBase
from services.protocol import BarrierArrive, BarrierReleased

__all__ = ["BarrierService"]


@dataclass
class _Generation:
    members: tuple[str, ...]
    arrived: dict[str, Call] = field(default_factory=dict)


@dataclass
class _Barrier:
    generation: int = 0
    open: dict[int, _Generation] = field(default_factory=dict)  # generation -> arrivals
    member_generation: dict[str, int] = field(default_factory=dict)  # next generation per member


class BarrierService(ServiceBase):
    """Serves ``arrive``; state is per barrier name and rebuilt from arrivals alone."""

    def __init__(self) -> None:
        self._barriers: dict[str, _Barrier] = {}

    def rpc_arrive(self, request: BarrierArrive, call: Call) -> BarrierReleased | None:
        members = tuple(request.members)
        if request.member not in members:
            raise RpcError("bad_request",
                           f"member {request.member!r} is not in the barrier's members {list(members)}")
        if len(set(members)) != len(members):
            raise RpcError("bad_request", f"barrier {request.name!r}: members {list(members)} repeat a name")
        barrier = self._barriers.setdefault(request.name, _Barrier())
        gen_index = barrier.member_generation.get(request.member, barrier.generation)
        generation = barrier.open.setdefault(gen_index, _Generation(members))
        if generation.members != members:
            raise RpcError(
                "bad_request",
                f"barrier {request.name!r} generation {gen_index}: members {list(members)} differ from "
                f"{list(generation.members)} given by an earlier arrival",
            )
        stale = generation.arrived.get(request.member)
        if stale is not None and not stale.answered:
            raise RpcError("bad_request", f"{request.member!r} is already waiting at {request.name!r}")
        generation.arrived[request.member] = call
        barrier.member_generation[request.member] = gen_index + 1
        if len(generation.arrived) == len(members):
            released = BarrierReleased(name=request.name, generation=gen_index)
            for waiting in generation.arrived.values():
                waiting.reply(released)
            del barrier.open[gen_index]
            barrier.generation = max(barrier.generation, gen_index + 1)
            return None

        def on_timeout() -> tuple[str, str]:
            generation.arrived.pop(request.member, None)
            barrier.member_generation[request.member] = gen_index  # it may try this generation again
            missing = [m for m in members if m not in generation.arrived and m != request.member]
            return (
                "timeout",
                f"barrier {request.name!r} generation {gen_index}: {request.member!r} waited "
                f"{request.timeout_ms / 1000:.1f}s; did not arrive: {missing}",
            )

        call.defer(timedelta(milliseconds=request.timeout_ms), on_timeout)
        return None
