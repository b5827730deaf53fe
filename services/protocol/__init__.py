"""Every control message of cellmesh's services, in one package: one module per service.

Each message is a strict pydantic model (``comm.codec.Message``: no coercion, no extra
fields, frozen), encoded with msgpack by ``comm.codec``. They are the bodies of the one RPC
envelope (:mod:`comm.rpc.envelope`), which carries the protocol version, the request id
and any error. Tensors never travel inside these bodies: the envelope lists a spec per
tensor and the tensors follow as raw ZeroMQ frames.

Bodies, by service: worker control (``Assignment``, ``WorkerStatus``...), push/pull
(``PullRequest``, ``PushRequest``...), barrier (``BarrierArrive``...), cell compute
(``RunStep``, ``Action``...). Extra message types are added in these modules, never invented
elsewhere; import them from ``services.protocol``.
"""

from comm.rpc.envelope import Empty
from services.protocol.barrier import BarrierArrive, BarrierReleased
from services.protocol.checkpoint import SavedPart, SavedParts, SaveRequest
from services.protocol.compute import (
    MAX_BOUNDARY_TENSORS,
    MAX_NONFINITE_NAMED,
    MAX_PROGRAMS,
    PROGRAM_FIELDS,
    Action,
    ActionKind,
    BoundarySpec,
    BoundaryTensor,
    CommitReply,
    CommitStep,
    ComputeOptions,
    FactoryKwargs,
    LoadProgram,
    OptimizerStepReply,
    OptimizerStepRequest,
    PhaseTiming,
    Precision,
    ProgramName,
    Reconnect,
    RunStep,
    ShardAddress,
    StepProgram,
    StepReply,
    StepWindow,
    TensorsReply,
    TrafficReports,
    TurnsOptions,
    WindowReply,
    ZeroGradRequest,
    pack_times,
    unpack_times,
)
from services.protocol.params import (
    ApplyRound,
    OptimizerSpec,
    ParamInfo,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    RoundNorm,
    RoundNormRequest,
    SchedulerKwargs,
    SchedulerSpec,
    ShardInfo,
    ShardSave,
    ShardSetup,
)
from services.protocol.tied import TiedOptions, TiedParam
from services.protocol.worker import Assignment, AssignmentReply, Release, WorkerCard, WorkerStatus

__all__ = [
    "MAX_BOUNDARY_TENSORS",
    "MAX_NONFINITE_NAMED",
    "MAX_PROGRAMS",
    "PROGRAM_FIELDS",
    "Action",
    "ActionKind",
    "ApplyRound",
    "Assignment",
    "AssignmentReply",
    "BarrierArrive",
    "BarrierReleased",
    "BoundarySpec",
    "BoundaryTensor",
    "CommitReply",
    "CommitStep",
    "ComputeOptions",
    "Empty",
    "FactoryKwargs",
    "LoadProgram",
    "OptimizerSpec",
    "OptimizerStepReply",
    "OptimizerStepRequest",
    "ParamInfo",
    "PhaseTiming",
    "Precision",
    "ProgramName",
    "PullReply",
    "PullRequest",
    "PushReply",
    "PushRequest",
    "Reconnect",
    "Release",
    "RoundNorm",
    "RoundNormRequest",
    "RunStep",
    "SaveRequest",
    "SavedPart",
    "SavedParts",
    "SchedulerKwargs",
    "SchedulerSpec",
    "ShardAddress",
    "ShardInfo",
    "ShardSave",
    "ShardSetup",
    "StepProgram",
    "StepReply",
    "StepWindow",
    "TensorsReply",
    "TiedOptions",
    "TiedParam",
    "TrafficReports",
    "TurnsOptions",
    "WindowReply",
    "WorkerCard",
    "WorkerStatus",
    "ZeroGradRequest",
    "pack_times",
    "unpack_times",
]
