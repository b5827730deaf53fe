"""Push/pull: the parameter server's shard set-up, its pull and push messages, and its checkpoint save."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from comm.codec import Message
from comm.rpc.envelope import Name, TensorMeta
from services.protocol.checkpoint import MAX_PATH, SaveRequest

# -- push/pull (parameter server) -------------------------------------------------------
# The contract (modes, versions, clocks, dedup) is services/params/server.py's docstring; the
# tensors of setup, pull and push travel as pieces named "{param}#{k}" (services/params/sharding.py).


SchedulerKwargs = dict[str, str | int | float | bool | list[int] | list[float]]


class SchedulerSpec(Message):
    """A ``torch.optim.lr_scheduler`` class by name, e.g. ``{"name": "StepLR", "kwargs": {"step_size": 2}}``.

    Built and advanced by ``services/params/scheduling.py`` wherever the optimizer lives.
    """

    name: Name
    kwargs: SchedulerKwargs = Field(default_factory=dict)


class OptimizerSpec(Message):
    """A ``torch.optim`` optimizer by class name, e.g. ``{"name": "Adam", "kwargs": {"lr": 1e-3}}``, and the
    learning-rate scheduler stepped with it (``scheduler``; None: a constant rate): the state a stage or
    a parameter shard keeps next to its parameters."""

    name: Name
    kwargs: dict[str, float | int | bool | list[float]] = Field(default_factory=dict)
    scheduler: SchedulerSpec | None = None


class ParamInfo(TensorMeta):
    """A parameter of a shard: its name, dtype and shape (the size check is :class:`TensorMeta`'s)."""


class ShardSetup(Message):
    """Initialise a parameter shard: ``params`` describes each parameter, its values follow as pieces."""

    mode: Literal["sync", "async"]
    replicas: int = Field(ge=1, le=1 << 14)
    optimizer: OptimizerSpec
    staleness: int = Field(default=0, ge=0)  # async only: max clock lead over the slowest replica
    params: list[ParamInfo] = Field(min_length=1, max_length=1 << 16)
    # checkpoints: a parameter's key in them (its first key in the model's state_dict; a parameter
    # not listed is keyed by its own name), and the checkpoint whose optimizer state the shard
    # starts from ("": a fresh optimizer). See services/params/shard_state.py.
    keys: dict[Name, Name] = Field(default_factory=dict, max_length=1 << 16)
    restore: str = Field(default="", max_length=MAX_PATH)
    # sync only: hold each complete round until the coordinator's ``apply_round`` (gradient clipping by
    # the global norm, which needs every shard's norm first: services/params/server.py)
    hold_rounds: bool = False


class ShardSave(Message):
    """Save the shard's optimizer state as part ``part`` of the checkpoint ``save`` stages, taken once
    the shard reached ``version`` (sync mode: that many updates applied) and before the next update.

    ``version`` is the update count once the commit that carries ``save`` to the stages is
    applied, so the part holds the state the stages snapshot after that commit. The reply, a
    :class:`~services.protocol.SavedPart`, comes once the part is written (or failed to be),
    within ``timeout_ms`` (reaching the version and writing).
    """

    save: SaveRequest
    version: int = Field(ge=1)
    part: Name
    timeout_ms: int = Field(ge=0)


class ShardInfo(Message):
    """What a parameter shard holds: its parameters, mode, version and per-replica clocks."""

    service: str
    ready: bool  # False until ``setup``; every other field is empty then
    mode: str = ""
    replicas: int = 0
    staleness: int = 0
    optimizer: str = ""
    version: int = 0
    clocks: list[int] = Field(default_factory=list)
    params: list[ParamInfo] = Field(default_factory=list)
    moved: int = 0  # parameters copied before an update because a pull reply still read them


class PullRequest(Message):
    """Current values once the shard reached ``min_version`` (and, async, the staleness bound holds)."""

    replica: int = Field(ge=0)
    min_version: int = Field(ge=0)  # wait until the shard reached this version (sync: the step)
    timeout_ms: int = Field(default=60_000, ge=0)
    params: list[Name] = Field(default_factory=list, max_length=1 << 16)  # empty: all of the shard's


class PullReply(Message):
    version: int
    clocks: list[int]  # per replica: 1 + its last applied step (0: none yet)


class PushRequest(Message):
    """Part ``part`` of ``parts`` of replica ``replica``'s gradients for ``step``.

    ``(replica, step, seq, part)`` makes a re-sent push idempotent; one push may travel as
    several messages (disjoint sets of whole parameters) so a shard works on early parts
    while later ones are on the wire.
    """

    replica: int = Field(ge=0)
    step: int = Field(ge=0)
    seq: int = Field(ge=0)
    part: int = Field(default=0, ge=0)
    parts: int = Field(default=1, ge=1, le=1 << 16)
    # sync: the training step this update belongs to (from the job's start); the shard's learning-rate
    # scheduler is advanced to it before the round's first update (None: not advanced)
    train_step: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _part_in_range(self) -> PushRequest:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} is not below parts {self.parts}")
        return self


class PushReply(Message):
    version: int  # the shard's version after this part was taken (sync: may not be applied yet)
    duplicate: bool = False


class RoundNormRequest(Message):
    """The squared L2 norm of round ``version``'s averaged gradient, once every replica pushed it
    (a shard set up with ``hold_rounds``); answered within ``timeout_ms``."""

    version: int = Field(ge=0)
    timeout_ms: int = Field(ge=0)


class RoundNorm(Message):
    version: int
    sq_norm: float  # the sum over the shard's parameters of the squared L2 norm of the averaged gradient


class ApplyRound(Message):
    """Apply held round ``version``: multiply the averaged gradient by ``grad_scale``, step the optimizer
    (and its scheduler, standing at ``train_step`` before the update)."""

    version: int = Field(ge=0)
    grad_scale: float = 1.0
    train_step: int = Field(ge=0)
