"""Checkpoint messages: a save carried by a commit, a written part reported back, a restore at placement.

See ``services/checkpoint/`` for the format (DCP, tensors keyed by name) and
``coordinator/runtime/checkpoints.py`` for the policy and the publishing.
"""

from __future__ import annotations

from pydantic import Field

from comm.codec import Message
from comm.rpc.envelope import Name

__all__ = ["SaveRequest", "SavedPart", "SavedParts"]

MAX_PATH = 4096


class SaveRequest(Message):
    """After applying the commit that carries this, snapshot the training state; write it in the background.

    ``directory`` is the checkpoint's staging directory (storage every worker and the coordinator
    share); ``step`` the number of steps done once the commit is applied (the checkpoint's step).
    """

    directory: str = Field(min_length=1, max_length=MAX_PATH)
    step: int = Field(ge=0)


class SavedPart(Message):
    """A service's part of checkpoint ``step`` is on storage (``error`` empty) or could not be written."""

    step: int = Field(ge=0)
    part: Name
    error: str = Field(default="", max_length=4096)
    model: bool = False  # it holds model tensors (indexed at the checkpoint's root), not only training state


class SavedParts(Message):
    """The parts a service finished writing since it last reported (the reply of ``flush_saves``)."""

    parts: list[SavedPart] = Field(default_factory=list, max_length=1 << 10)
