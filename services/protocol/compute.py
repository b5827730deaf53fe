"""Cell compute: a stage's options, its pipeline actions, a step and its reply."""

from __future__ import annotations

import re
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Annotated, Literal, Protocol

from pydantic import ConfigDict, Field, model_validator

from comm.codec import Message
from comm.rpc.envelope import Name, TensorMeta
from comm.traffic import TrafficCounts, TrafficReport
from comm.wire import DTYPES
from services.protocol.checkpoint import SavedPart, SaveRequest
from services.protocol.params import OptimizerSpec
from services.protocol.tied import TiedOptions

MAX_NONFINITE_NAMED = 8  # parameters a StepReply names whose gradient is not finite
TIMING_BYTES = 16  # one action's timing in StepReply.times: its start and its end, two float64
MAX_TIMES_BYTES = TIMING_BYTES << 20  # StepReply.times: a step program's most actions (1 << 20)

# -- cell compute -----------------------------------------------------------------------
# The pipeline action and the boundary metadata; see services/compute/service.py for the contract.

ActionKind = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
_PEER_STEP: dict[str, int] = {"F": 0, "B": 0, "I": 0, "W": 0, "SEND_F": 1, "RECV_F": -1, "SEND_B": -1,
                              "RECV_B": 1}
_ACTION_TEXT = re.compile(r"(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")
FactoryKwargs = dict[str, str | int | float | bool | list[int] | list[float] | list[str]]
Backend = Literal["zmq", "gloo", "nccl"]  # a group's concrete backend (comm/factory.py resolves "auto")
# what a stage computes in: fp32, or bf16 / fp16 autocast over float32 master weights (see
# services/compute/precision.py); the same values as coordinator.planning.config.Precision
Precision = Literal["fp32", "bf16", "fp16"]
MAX_BOUNDARY_TENSORS = 256  # tensors per cut; also the stride of transfer tags (services/compute/boundary.py)


class BoundaryTensor(TensorMeta):
    """One tensor that crosses a cut per microbatch.

    ``shape`` is recorded at the owning :class:`BoundarySpec`'s ``batch_size`` samples;
    ``batch_dim`` (if set) is the dimension that scales with the microbatch's sample count.
    Only floating-point tensors may carry gradients (``requires_grad``). ``name`` names the
    tensor in errors and logs (e.g. the coordinator's "mix.h"); dtype and size are checked
    as every announced tensor's (:class:`TensorMeta`).
    """

    requires_grad: bool
    batch_dim: int | None = Field(default=None, ge=0)
    key: str | None = None  # dict structure only: the tensor's key (default: ``name``)

    @property
    def dict_key(self) -> str:
        return self.name if self.key is None else self.key

    @model_validator(mode="after")
    def _consistent(self) -> BoundaryTensor:
        if self.batch_dim is not None and self.batch_dim >= len(self.shape):
            raise ValueError(f"tensor {self.name!r}: batch_dim {self.batch_dim} is not a dim of {self.shape}")
        if self.requires_grad and not DTYPES[self.dtype].is_floating_point:
            raise ValueError(f"tensor {self.name!r}: a {self.dtype} tensor cannot require grad")
        return self


class BoundarySpec(Message):
    """Everything that crosses one cut per microbatch: the value's structure and its tensors.

    ``structure`` says how the tensors form the value a stage returns and the next stage
    receives: ``"tensor"`` (exactly one entry), ``"tuple"``/``"list"`` (entries in position
    order), ``"dict"`` (entries under their ``dict_key``; str keys only), or ``"values"``:
    several values cross the cut (a skip connection beside the main path), each a tensor,
    passed as a tuple in graph order (see ``services/compute/chain.py``).
    """

    structure: Literal["tensor", "tuple", "list", "dict", "values"]
    tensors: list[BoundaryTensor] = Field(min_length=1, max_length=MAX_BOUNDARY_TENSORS)
    batch_size: int = Field(ge=1)  # the samples per microbatch the shapes were recorded at

    @model_validator(mode="after")
    def _consistent(self) -> BoundarySpec:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names repeat: {names}")
        keys = [t.dict_key for t in self.tensors]
        if self.structure == "dict" and len(set(keys)) != len(keys):
            raise ValueError(f"dict keys repeat: {keys}")
        if self.structure != "dict" and any(t.key is not None for t in self.tensors):
            raise ValueError(f"a key is only meaningful for structure 'dict', not {self.structure!r}")
        if self.structure == "tensor" and len(self.tensors) != 1:
            raise ValueError(f"structure 'tensor' needs exactly one tensor, got {len(self.tensors)}")
        return self


class ShardAddress(Message):
    """Where one parameter shard is served: its worker's address and its service name there."""

    address: str
    service: Name


class ComputeOptions(Message):
    """``Assignment.options`` of a ``compute`` service: the plan fields one pipeline stage needs.

    Factories are ``"package.module:function"`` names: ``data`` returns the samples (see
    ``services/compute/stage.py``), ``loss`` returns ``loss(output, targets) -> scalar``.

    Data parallelism (``services/params/grad_path.py``): the stage is replica ``replica`` of
    ``num_replicas``. ``grad_path="collective"`` averages gradients with the stage's
    other replicas over a communicator that meets under ``dp_prefix`` (unique per stage and
    generation); ``"parameter_server"`` pushes them to ``shards`` (this stage's parameter
    shards; empty if the stage has no parameters) and pulls the updated values on commit.
    """

    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    comm_backend: Backend = "zmq"  # the pipeline's communicator
    registry: str = ""  # registry URL; needed when num_stages > 1
    comm_prefix: str = ""  # unique per pipeline and generation; needed when num_stages > 1
    comm_timeout_ms: int = Field(default=60_000, ge=1)  # rendezvous and default transfer bound
    factory_kwargs: FactoryKwargs = Field(default_factory=dict)
    data: str = ""  # needed on the first and the last stage
    data_kwargs: FactoryKwargs = Field(default_factory=dict)
    loss: str = ""  # needed on the last stage
    loss_kwargs: FactoryKwargs = Field(default_factory=dict)
    loss_reduction: Literal["mean", "sum"] = "mean"  # mean: microbatch losses weighted by size
    incoming: BoundarySpec | None = None  # needed when stage > 0
    outgoing: BoundarySpec | None = None  # needed when stage < num_stages - 1
    replica: int = Field(default=0, ge=0)
    num_replicas: int = Field(default=1, ge=1)
    grad_path: Literal["collective", "parameter_server"] = "collective"
    dp_prefix: str = ""  # needed for collective with num_replicas > 1
    bucket_bytes: int = Field(default=25 << 20, ge=1)
    # ZeRO-1/2: the most bytes of one bucket of the parameters' all-gather; ZeRO-3: of a unit of cells
    gather_bytes: int = Field(default=4 << 20, ge=1)
    shards: list[ShardAddress] = Field(default_factory=list, max_length=1 << 12)
    # checkpoints (services/checkpoint/): each tensor's keys (by the stage's names) in the unwrapped model's
    # state_dict (tied weights have several), and the checkpoint to start from ("": the factory's values)
    state_keys: dict[str, list[str]] = Field(default_factory=dict, max_length=1 << 20)
    restore: str = Field(default="", max_length=4096)
    # devices (coordinator/planning/devices.py): where the stage runs, the coordinator's choice (the worker
    # checks it has it); the data-parallel group's backend (None: comm_backend). A CUDA stage in a zmq or gloo
    # group stages its transfers through host memory (comm/factory.py: [Note: a group's backend]).
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda:\d{1,3})$")
    dp_backend: Backend | None = None
    # evaluation (RunStep.source = "eval"): the held-out data factory (first and last stage) and the
    # metric factory (last stage; optional); "": the job evaluates nothing (or no metric)
    eval_data: str = ""
    eval_data_kwargs: FactoryKwargs = Field(default_factory=dict)
    metric: str = ""
    # mixed precision: the stage's forwards and loss run under autocast in this dtype
    precision: Precision = "fp32"
    # parameters other stages hold too (services/params/tied.py); None: none
    tied: TiedOptions | None = None
    # the model's submodules traced as one node each (model.leaves), as the coordinator traced it
    leaves: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list, max_length=1 << 12)
    # the worker holds other stages of this pipeline too (interleaved schedules): they take turns in its
    # merged order (services/compute/turns.py); None: the stage runs its list alone
    turns: TurnsOptions | None = None
    # memory (coordinator/planning/plan.py: Plan.zero_stage and what follows): the replicas shard their state
    # in groups of shard_factor consecutive replicas (0: nothing sharded; 1: optimizer state; 2: + gradients;
    # 3: + parameters); recompute: each cell's activations recomputed in the backward; offload: optimizer
    # state and master parameters in host memory
    zero_stage: Literal[0, 1, 2, 3] = 0
    shard_factor: int = Field(default=1, ge=1)
    recompute: bool = False
    offload: bool = False

    @model_validator(mode="after")
    def _sharding(self) -> ComputeOptions:
        if self.zero_stage and (self.shard_factor < 2 or self.num_replicas % self.shard_factor
                                or self.grad_path != "collective"):
            raise ValueError(f"zero_stage={self.zero_stage} needs collective replicas in groups of "
                             f"shard_factor >= 2 dividing num_replicas={self.num_replicas}, got "
                             f"{self.shard_factor}")
        return self

    @property
    def data_parallel_backend(self) -> Backend:
        return self.dp_backend or self.comm_backend

    @model_validator(mode="after")
    def _consistent(self) -> ComputeOptions:
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        collective_dp = self.grad_path == "collective" and self.num_replicas > 1
        needs = {
            "stage < num_stages": self.stage < self.num_stages,
            "replica < num_replicas": self.replica < self.num_replicas,
            "dp_prefix (collective, num_replicas > 1)": not collective_dp or bool(self.dp_prefix),
            "registry (num_stages > 1 or collective data parallel)": (
                (self.num_stages == 1 and not collective_dp) or bool(self.registry)),
            "comm_prefix (num_stages > 1)": self.num_stages == 1 or bool(self.comm_prefix),
            "data (first and last stage)": not (first or last) or bool(self.data),
            "loss (last stage)": not last or bool(self.loss),
            "eval_data (with a metric)": not self.metric or bool(self.eval_data),
            "incoming (stage > 0)": first or self.incoming is not None,
            "outgoing (stage < num_stages - 1)": last or self.outgoing is not None,
            "tied (held by this stage and others < num_stages)": self.tied is None or all(
                self.stage in p.stages and p.stages[-1] < self.num_stages for p in self.tied.params),
            "turns (an order with this stage's actions, of stages < num_stages)": self.turns is None or (
                any(a.stage == self.stage for a in self.turns.order)
                and all(a.stage < self.num_stages for a in self.turns.order)),
        }
        missing = [what for what, ok in needs.items() if not ok]
        if missing:
            raise ValueError(f"stage {self.stage} of {self.num_stages}: missing or invalid {missing}")
        nccl = [what for what, backend in (("comm_backend", self.comm_backend),
                                           ("dp_backend", self.data_parallel_backend)) if backend == "nccl"]
        if nccl and self.device == "cpu":
            raise ValueError(f"stage {self.stage}: {' and '.join(nccl)} 'nccl' moves CUDA tensors, but the "
                             "stage runs on the cpu: use zmq or gloo, or a cuda device")
        return self


class Action(Message):
    """One step of one pipeline stage: what it computes or moves, for which microbatch.

    Printed as torch.distributed.pipelining prints its ``_Action``: stage, kind,
    microbatch, e.g. ``1F0``, ``0SEND_F3``, ``1RECV_B2`` (:meth:`parse` reads it back):

    ==========  ===================================================================
    kind        stage ``s`` ...
    ==========  ===================================================================
    ``F``       runs the forward of the microbatch
    ``B``       runs its whole backward (input and weight gradients)
    ``I``       runs the input-gradient half of its backward (what ``SEND_B`` sends)
    ``W``       runs the weight-gradient half, after its ``I`` (zero-bubble schedules)
    ``SEND_F``  sends its forward's outputs (activations) to stage ``s + 1``
    ``RECV_F``  receives its inputs (activations) from stage ``s - 1``
    ``SEND_B``  sends its input gradients to stage ``s - 1``
    ``RECV_B``  receives its output gradients from stage ``s + 1``
    ==========  ===================================================================

    A pipeline is a chain, so the kind fixes the peer (:attr:`peer`): a transfer to a
    stage that is not a neighbour cannot be written. Which tensors travel is the cut's
    business (``BoundarySpec``), not the action's. The ordering rules of an action list
    are ``services/compute/actions.py``'s.
    """

    stage: int = Field(ge=0)
    kind: ActionKind
    microbatch: int = Field(ge=0)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def peer(self) -> int | None:
        """The stage a transfer goes to or comes from; None for the compute kinds (F, B, I, W)."""
        step = _PEER_STEP[self.kind]
        return self.stage + step if step else None

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads the printed form back (``"0F3"``, ``"1B2"``, ``"1I2"``, ``"0SEND_F3"``, ``"1RECV_B2"``...).

        Raises:
            ValueError: ``text`` is not one action.
        """
        match = _ACTION_TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind "
                             f"one of {', '.join(_PEER_STEP)}, e.g. 0F3, 1B2, 1I2, 1W2, 0SEND_F3, 1RECV_B2")
        stage, kind, microbatch = match.groups()
        return cls.model_validate({"stage": int(stage), "kind": kind, "microbatch": int(microbatch)})


class TurnsOptions(Message):
    """``ComputeOptions.turns``: the stages a worker holds of one pipeline run their actions in its order.

    ``key`` names the worker's rank (the stages of one rank in one process share it); ``order`` is
    every action the rank runs in a training step, in order (``Schedule.order``, as accumulated). A
    training step's list must be the stage's part of it (``services/compute/turns.py``).
    """

    key: Annotated[str, Field(min_length=1, max_length=1024)]
    order: list[Action] = Field(min_length=1, max_length=1 << 20)


ComputeOptions.model_rebuild()


class CommitStep(Message):
    """Apply step ``step``'s update: the local optimizer (collective) or push/pull (parameter server).

    ``step`` counts the commits (0, 1, 2, ...), so a stage can tell a repeated commit from a new one.

    ``grad_scale`` multiplies every gradient before the optimizer step (collective path): the
    global-norm clipping coefficient, times any loss-scale unscaling (see
    ``coordinator/runtime/clipping.py``). ``train_step`` is the training step the update belongs to,
    counted from the job's start: the learning-rate scheduler stands there before the update and one
    further after it (``services/params/scheduling.py``), skipped steps included.
    """

    step: int = Field(ge=0)
    optimizer: OptimizerSpec
    timeout_ms: int = Field(default=300_000, ge=1)
    save: SaveRequest | None = None  # then snapshot the state it leaves (written in the background)
    # multiply every gradient by this before the optimizer step (fp16's unscale times the clip coefficient)
    grad_scale: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    train_step: int = Field(default=0, ge=0)


class CommitReply(Message):
    step: int
    optimizer_steps: int  # updates applied so far by this stage
    phases: list[PhaseTiming]
    saved: list[SavedPart] = Field(default_factory=list, max_length=1 << 10)  # parts written since last reply


ProgramName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
MAX_PROGRAMS = 16  # programs one compute service holds at once (LoadProgram beyond them is refused)


class StepProgram(Message):
    """The per-plan part of a step: what a stage runs every step of a plan, the same each step.

    ``actions`` is the stage's ordered list, every action naming this stage (the stage checks it
    with ``services.compute.actions.validate_stage`` before it runs any). ``zero_grad`` clears
    gradients first (so a replayed step gives the same gradients).

    ``source`` says which data the first and last stages read: the training data, or (``"eval"``)
    the held-out data of an evaluation step, whose list has no backward: the stage runs it with its
    modules in eval mode and its RNG untouched, and the last stage reports the metric too
    (``coordinator/runtime/evaluation.py``).

    [Note: step programs]
    These fields travel once per placement, not once per step: the coordinator sends each stage a
    :class:`LoadProgram` (these fields, a name, the microbatch count) when it places it, the stage
    validates it then and keeps it, and each :class:`RunStep` names it (``RunStep.program``),
    carrying only what changes from step to step (the step, its samples, the commit riding on it,
    the loss scale, the deadline). A :class:`RunStep` may still carry these fields itself instead
    (no ``program``): the coordinator's evaluation steps do, and any client that sends one step.
    A service placed anew holds no program, and a step naming one it does not hold is refused
    (``bad_request``) naming the fix. The service runs a step naming a program as the
    :class:`RunStep` with every field of this class copied from the program, so a per-plan field
    added here (an optional per-action list beside ``actions``, say) travels once with the others
    and reaches the step with no other change.
    """

    actions: list[Action] = Field(default_factory=list, max_length=1 << 20)
    zero_grad: bool = True
    source: Literal["train", "eval"] = "train"


PROGRAM_FIELDS: tuple[str, ...] = tuple(StepProgram.model_fields)
"""The per-plan fields a step naming a program takes from it (every field of :class:`StepProgram`)."""
_PROGRAM_DEFAULTS = {name: info.get_default(call_default_factory=True)
                     for name, info in StepProgram.model_fields.items()}


class LoadProgram(StepProgram):
    """Hold a :class:`StepProgram` under ``program`` for steps of ``num_microbatches`` microbatches.

    Validated once, on receipt (``bad_request`` if it fails: then nothing is held under the name);
    each :class:`RunStep` naming it must bring exactly ``num_microbatches`` microbatches. Loading
    under a name already held replaces that program; a stage holds at most :data:`MAX_PROGRAMS`.
    """

    program: ProgramName
    num_microbatches: int = Field(ge=1, le=1 << 16)

    @model_validator(mode="after")
    def _has_actions(self) -> LoadProgram:
        if not self.actions:
            raise ValueError(f"program {self.program!r} has no actions")
        return self


MAX_WINDOW_STEPS = 64  # steps one RunStep may carry (StepWindow.microbatches, and the step itself)


class StepWindow(Message):
    """The steps a :class:`RunStep` runs after its own, each committed by the stages themselves.

    [Note: a window of steps]
    A step the coordinator drives costs it one request and one reply per stage, read cold: 0.6-1.1 ms
    of its CPU on this machine's 55-80 ms steps, 1-1.5 % of the step. A window hands the stages the
    next ``len(microbatches)`` steps' samples with the request, and the stages decide each of those
    steps' commits themselves, as the coordinator would from their replies:

    * after each step but the window's last, every stage reports to stage 0 whether its gradients
      (and, the last stage, its losses) are finite and its gradients' squared norm
      (``services/compute/window.py``); stage 0 adds the norms, decides (commit, with the clipping
      coefficient of ``clip_grad_norm`` as :func:`~services.params.clipping.clip_coefficient` gives it;
      skip; or stop, per ``nonfinite``) and sends the verdict to every stage. Stage 0 ends a 1F1B or
      GPipe step last, so the reports wait for it, and the verdict reaches a stage before the
      activation it waits for anyway;
    * with replicas, each stage first sums over its data-parallel group (one all-reduce of one float)
      whether each replica's report is finite: after the gradients' all-reduce every replica holds the
      same gradients and norms, but not the same losses. Every replica's stage 0 then decides on the same
      reports, and every replica applies the same verdict;
    * a committed step is ``CommitStep(step=first_commit + k, optimizer=optimizer, grad_scale=...,
      train_step=...)`` as the coordinator would have sent it; a skipped step commits nothing; a stop
      ends the window there, the step not committed, and the reply says so;
    * the window's last step is committed by the next request, as every step is without a window.

    Only plans whose commit depends on nothing beyond what the stages report take windows (the
    collective path, every replica holding the whole gradient (ZeRO-1 at most), no fp16 loss scale:
    ``coordinator/runtime/driver.py``'s ``Runtime.window``); the others send one step per request.
    """

    microbatches: list[Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                                 Field(min_length=1, max_length=1 << 16)]] = Field(
        min_length=1, max_length=MAX_WINDOW_STEPS - 1)
    optimizer: OptimizerSpec
    first_commit: int = Field(ge=0)  # CommitStep.step of the window's first own commit
    clip_grad_norm: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    nonfinite: Literal["stop", "skip"] = "stop"


class WindowReply(Message):
    """A :class:`RunStep` with a :class:`StepWindow`: each step's reply in order (the request's own step
    first), and whether each step but the last was committed by the stages. A window stopped by a step
    that is not finite (``nonfinite: stop``) ends with that step's reply."""

    steps: list[StepReply] = Field(min_length=1, max_length=MAX_WINDOW_STEPS)
    committed: list[bool] = Field(max_length=MAX_WINDOW_STEPS)

    @model_validator(mode="after")
    def _one_verdict_per_step(self) -> WindowReply:
        if len(self.committed) != len(self.steps) - 1:
            raise ValueError(f"a window of {len(self.steps)} step replies carries {len(self.committed)} "
                             f"commit verdicts, not {len(self.steps) - 1} (every step but the last)")
        return self


class RunStep(StepProgram):
    """Run one step on a stage: a program it holds (``program``), or the action list it carries.

    ``microbatches[i]`` lists the sample indices of microbatch ``i`` (the data factory's
    indices); every stage of the pipeline gets the same samples. ``program`` names a
    :class:`LoadProgram` the stage holds, whose per-plan fields (:class:`StepProgram`'s: the
    action list, ``zero_grad``, ``source``) the step then runs with; a request naming one sets
    none of them itself (each keeps its default). Without ``program`` the request carries them
    (at least one action). See [Note: step programs]. ``timeout_ms`` bounds the whole step.

    ``commit`` carries the commit of the previous step (sent only once every stage of every
    replica finished it): the stage applies that update first, then runs this step, so a
    step costs one round trip instead of two. A request refused before it runs
    (``bad_request``, ``busy``, ``comm_failed``) applies nothing; once it runs, the commit is
    applied even if the step then fails (the previous step was complete). It is reported as
    an ``optimizer`` or ``push_pull`` phase of the reply.

    ``loss_scale`` multiplies the last stage's loss before its backward (fp16's dynamic loss
    scale, ``coordinator/runtime/scaler.py``); the losses reported stay unscaled, and the
    commit's ``grad_scale`` undoes it on the gradients.
    """

    step: int = Field(ge=0)
    microbatches: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = Field(
        min_length=1, max_length=1 << 16)
    program: ProgramName | None = None
    timeout_ms: int = Field(default=300_000, ge=1)
    commit: CommitStep | None = None
    loss_scale: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    window: StepWindow | None = None  # later steps to run, committed by the stages: see StepWindow

    @model_validator(mode="after")
    def _program_or_actions(self) -> RunStep:
        if self.program is None and not self.actions:
            raise ValueError("a step names a program it loaded (program) or carries its actions; it has "
                             "neither")
        if self.program is not None:  # compared with the defaults: a dumped request reads back the same
            own = [f for f in PROGRAM_FIELDS if getattr(self, f) != _PROGRAM_DEFAULTS[f]]
            if own:
                raise ValueError(f"a step naming program {self.program!r} takes {own} from it: send them "
                                 "in load_program, or send the step without program")
        return self


class PhaseTiming(Message):
    """A named phase outside the action list (``all_reduce``, ``tied_sync``, ``push_pull``, ``optimizer``)."""

    name: Name
    start: float
    end: float


class _Packed(Protocol):
    @property
    def times(self) -> bytes: ...


class Timed:
    """The action timings of a step's reply, read from its packed ``times`` (:func:`pack_times`): a mixin
    (no state of its own) of :class:`StepReply` and of its mirror as read (``services/protocol/hot.py``)."""

    __slots__ = ()

    @property
    def num_timed(self: _Packed) -> int:
        """How many actions ``times`` times."""
        return len(self.times) // TIMING_BYTES

    @property
    def starts(self: _Packed) -> list[float]:
        """``starts[k]``: when action ``k`` started (unpacked from ``times`` at each read)."""
        return unpack_times(self.times)[: len(self.times) // TIMING_BYTES]

    @property
    def ends(self: _Packed) -> list[float]:
        """``ends[k]``: when action ``k`` ended (unpacked from ``times`` at each read)."""
        return unpack_times(self.times)[len(self.times) // TIMING_BYTES:]

    @property
    def last_end(self: _Packed) -> float | None:
        """``max(ends)`` (None: no action timed), read in place: the coordinator asks it of every reply."""
        return last_end(self.times)


class StepReply(Message, Timed):
    """A finished step: per-microbatch losses (last stage only), one timing per action, what is not finite.

    A loss or a gradient that is NaN or Inf makes the coordinator stop the job or drop the step's
    update (see [Note: a step that is not finite] in ``coordinator/runtime/nonfinite.py``).

    Timings are wall-clock seconds (``time.time()``) packed in one byte string, ``times``: the
    action starts then the action ends, float64 little-endian (:func:`pack_times`), so that a reply
    of ``K`` actions is one msgpack ``bin`` of ``16 K`` bytes instead of ``2 K`` Python floats to
    build, check and keep; action ``k`` of the request ran from ``starts[k]`` to ``ends[k]``
    (the properties unpack them when read: see [Note: a step reply's few objects]).

    ``traffic`` is the worker process's counters (``comm/traffic.py``) as the step ends, or None when
    they did not change since the stage's last training reply: the coordinator's metrics keep each
    worker's latest counters. They ride on the reply every step sends anyway.
    """

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")  # times as JSON (logs)

    step: int
    stage: int
    losses: list[float]  # losses[i] is microbatch i's unweighted loss; empty but on the last stage
    # an evaluation step with a metric, last stage: metric_sums[i] sums microbatch i's per-sample values
    metric_sums: list[float] = Field(default_factory=list, max_length=1 << 16)
    times: bytes = Field(default=b"", max_length=MAX_TIMES_BYTES)  # pack_times(starts, ends)
    phases: list[PhaseTiming] = Field(default_factory=list)  # e.g. the gradient all-reduce, the commit
    # parameters whose gradient holds a NaN or Inf after the step (the first MAX_NONFINITE_NAMED of them)
    nonfinite_grads: list[str] = Field(default_factory=list, max_length=MAX_NONFINITE_NAMED)
    # the worker process's cumulative traffic after the step (bytes sent per backend, refusals per
    # reason: comm/traffic.py), for the coordinator's metrics; None: unchanged since the last reply
    traffic: TrafficCounts | None = None
    saved: list[SavedPart] = Field(default_factory=list, max_length=1 << 10)  # parts written since last reply
    # the sum of the squared L2 norms of the stage's parameter gradients once final (after the
    # all-reduce: every replica's is the same; sharded gradients, ZeRO-2/3: this replica's rows, the
    # coordinator adds the group's parts), for clipping by the global norm; None on the
    # parameter-server path (the shards hold the averaged gradient) and in a step without backwards
    grad_sq_norm: float | None = None
    # bytes of the stage's parameters, the gradients it holds and its optimizer state as the step ends
    # (before the step's own update: ZeRO-2 holds its gradient shards then), for memory reports
    held_bytes: int | None = Field(default=None, ge=0)
    # the worker's peak resident bytes since the stage was assigned, less what it held then
    # (comm/memcap.py's PeakProbe): the stage's tensors, transients and buffers, for memory reports
    peak_bytes: int | None = Field(default=None, ge=0)
    # parameter server: how many steps this replica's clock led the slowest replica's as the shards served
    # the pull of the commit this step applied (the most over the stage's shards; at most the plan's
    # staleness, 0 in sync mode); None on the collective path and in a step without a commit
    lead: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check_timings(self) -> StepReply:
        if len(self.times) % TIMING_BYTES:
            raise ValueError(f"times holds {len(self.times)} bytes, not a whole number of "
                             f"{TIMING_BYTES}-byte action timings (the starts, then the ends, as float64)")
        return self



class PhaseReport(Protocol):
    """A timed phase as the coordinator reads it: a :class:`PhaseTiming`, or its mirror decoded in C."""

    @property
    def name(self) -> str: ...

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


class StepReport(Protocol):
    """A stage's step as the coordinator reads it: a :class:`StepReply`, or the same fields decoded in C
    and kept as read (``services.protocol.hot.StepRead``; [Note: a step reply kept as read] there). The
    fields and properties mean what :class:`StepReply`'s do; nothing here changes them."""

    @property
    def step(self) -> int: ...

    @property
    def stage(self) -> int: ...

    @property
    def losses(self) -> Sequence[float]: ...

    @property
    def metric_sums(self) -> Sequence[float]: ...

    @property
    def times(self) -> bytes: ...

    @property
    def phases(self) -> Sequence[PhaseReport]: ...

    @property
    def nonfinite_grads(self) -> Sequence[str]: ...

    @property
    def traffic(self) -> TrafficReport | None: ...

    @property
    def saved(self) -> Sequence[SavedPart]: ...

    @property
    def grad_sq_norm(self) -> float | None: ...

    @property
    def held_bytes(self) -> int | None: ...

    @property
    def peak_bytes(self) -> int | None: ...

    @property
    def lead(self) -> int | None: ...

    @property
    def num_timed(self) -> int: ...

    @property
    def starts(self) -> list[float]: ...

    @property
    def ends(self) -> list[float]: ...

    @property
    def last_end(self) -> float | None: ...


def step_end(report: StepReport) -> float | None:
    """When a stage's step ended by its own timings: its last action's or phase's end (None: untimed)."""
    end = last_end(report.times)  # one pass in C over the step's actions' ends, in place
    for phase in report.phases:
        if end is None or phase.end > end:
            end = phase.end
    return end


def pack_times(starts: Sequence[float], ends: Sequence[float]) -> bytes:
    """:attr:`StepReply.times` of actions that ran from ``starts[k]`` to ``ends[k]``.

    Raises:
        ValueError: ``starts`` and ``ends`` differ in length.
    """
    if len(starts) != len(ends):
        raise ValueError(f"{len(starts)} action starts but {len(ends)} ends")
    packed = array("d", starts)
    packed.extend(ends)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack_times(times: bytes) -> list[float]:
    """The starts, then the ends, of :attr:`StepReply.times` (a whole number of timings)."""
    unpacked = array("d")
    unpacked.frombytes(times)
    if _BIG_ENDIAN:
        unpacked.byteswap()
    return unpacked.tolist()


def last_end(times: bytes) -> float | None:
    """The latest end in :attr:`StepReply.times` (None: no action timed), read in place: the ends only, by
    one cached unpacker per count of actions (0.76 us for 16 actions against 1.3 through a memoryview)."""
    n = len(times) // TIMING_BYTES
    if not n:
        return None
    ends = _ENDS.get(n)
    if ends is None:
        ends = struct.Struct(f"<{n}d").unpack_from
        if len(_ENDS) < _MAX_ENDS:  # a stage's count of actions: a few per run
            _ENDS[n] = ends
    return max(ends(times, n * (TIMING_BYTES // 2)))


_ENDS: dict[int, Callable[[bytes, int], tuple[float, ...]]] = {}  # by actions timed: their ends' unpacker
_MAX_ENDS = 1024


_BIG_ENDIAN = sys.byteorder == "big"


class TrafficReports:
    """What a stage's step replies carry as ``traffic``: the counters when they changed since the last
    training reply carried them, else None (the coordinator keeps each worker's latest).

    One per stage service: a stage placed anew (a new runtime) reports on its first step. Evaluation
    replies always carry them (the runtime reads only the training replies' counters, so they do not
    count as sent).
    """

    def __init__(self) -> None:
        self._sent: TrafficCounts | None = None

    def report(self, counts: TrafficCounts, *, training: bool = True) -> TrafficCounts | None:
        """``counts`` if a reply should carry them, else None."""
        if not training:
            return counts
        if counts == self._sent:
            return None
        self._sent = counts
        return counts


class TensorsReply(Message):
    """Named tensors follow as frames (``names`` in order); ``missing`` names parameters without grad."""

    names: list[str]
    missing: list[str] = Field(default_factory=list)


class ZeroGradRequest(Message):
    set_to_none: bool = True


class OptimizerStepRequest(Message):
    """Apply one local optimizer step; the first call builds the optimizer, later ones must match it."""

    optimizer: OptimizerSpec


class OptimizerStepReply(Message):
    steps: int  # optimizer steps applied so far by this service


class Reconnect(Message):
    """Replace the stage's communicator by a new one under ``comm_prefix`` (a new generation).

    ``dp_prefix``, if set, also replaces the stage's data-parallel group (collective path);
    ``tied_prefix``, if set, its tied parameters' groups.
    """

    comm_prefix: Name
    dp_prefix: str = ""
    tied_prefix: str = ""


WindowReply.model_rebuild()
