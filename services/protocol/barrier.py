"""Named barriers with generations."""

from __future__ import annotations

from pydantic import Field

from comm.codec import Message
from comm.rpc.envelope import Name

# -- barrier ----------------------------------------------------------------------------


class BarrierArrive(Message):
    name: Name
    member: Name
    members: list[Name] = Field(min_length=1, max_length=1 << 14)
    timeout_ms: int = Field(ge=0)


class BarrierReleased(Message):
    name: str
    generation: int
