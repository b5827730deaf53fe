"""Tied parameters: which of a stage's parameters other stages hold too (``ComputeOptions.tied``).

The coordinator finds them (``coordinator/runtime/tied.py``); a stage synchronises them
(``services/params/tied.py``, see [Note: tied parameters] there).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from comm.codec import Message
from comm.rpc.envelope import Name

MAX_TIED = 1 << 12  # tied parameters of one stage


class TiedParam(Message):
    """One parameter this stage holds together with other stages.

    ``name`` is the stage's own name of it (``Stage.parameters()``); ``key`` the name every holder
    knows it by (its name on the lowest holding stage, which also writes it into checkpoints), so
    the holders match and order their copies by it; ``stages`` every holding stage, ascending.
    """

    name: str = Field(min_length=1, max_length=4096)
    key: str = Field(min_length=1, max_length=4096)
    stages: list[int] = Field(min_length=2, max_length=1 << 12)

    @model_validator(mode="after")
    def _consistent(self) -> TiedParam:
        if any(s < 0 for s in self.stages) or self.stages != sorted(set(self.stages)):
            raise ValueError(f"tied parameter {self.name!r}: stages {self.stages} must be distinct, >= 0 "
                             "and ascending")
        return self

    @property
    def owner(self) -> int:
        """The stage that writes the parameter into checkpoints (and, in parameter-server mode,
        pushes it to its shard): the lowest holder."""
        return self.stages[0]


class TiedOptions(Message):
    """This stage's tied parameters and where their groups meet.

    The holders of one set of stages form one communicator per pipeline (replica), under
    ``{prefix}/s{a}-{b}...`` (``prefix`` unique per replica and generation, as ``dp_prefix``).
    """

    prefix: Name
    params: list[TiedParam] = Field(min_length=1, max_length=MAX_TIED)

    @model_validator(mode="after")
    def _unique(self) -> TiedOptions:
        for what, values in (("names", [p.name for p in self.params]),
                             ("keys", [p.key for p in self.params])):
            if len(set(values)) != len(values):
                raise ValueError(f"tied parameter {what} repeat: {sorted(values)}")
        return self
