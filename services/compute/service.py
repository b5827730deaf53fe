"""The cell compute service: one pipeline stage's forward and backward, driven by action lists.

One service runs nodes ``[start, stop)`` of a model as stage ``s`` of ``p`` (see
:mod:`services.compute.stage` for the factories and :mod:`services.compute.executor` for how a step's
action list runs). RPC surface (service kind ``compute``):

* ``load_program(LoadProgram) -> Empty``: validate a step program once and hold it by name
  (:mod:`services.compute.programs`; an invalid one is a ``bad_request``).
* ``run_step(RunStep) -> StepReply``: resolve the step (a program the stage holds, else
  ``bad_request`` saying to load it; or the action list it carries, validated: an invalid list is
  a ``bad_request`` and nothing runs), then run it on the service's step thread; the reply
  (per-microbatch losses on the last stage, per-action timings) is sent from that thread when
  the step ends, with the worker's traffic counters (``comm/traffic.py``) for the coordinator's
  metrics. ``step_failed`` if it fails. An evaluation step (``source="eval"``) must have no
  backward; it reads the held-out data, runs in eval mode with the RNG untouched
  (``executor.evaluating``) and leaves the gradients as they are (``zero_grad`` off).
* ``parameters(Empty)`` / ``gradients(Empty) -> TensorsReply`` + tensors named
  as the model names them (copies; ``gradients`` sends zeros for, and lists as ``missing``,
  parameters without a gradient).
* ``zero_grad(ZeroGradRequest) -> Empty``.
* ``optimizer_step(OptimizerStepRequest) -> OptimizerStepReply``: a ``torch.optim``
  class by name; built on the first call and kept (its state lives with the stage), run
  on the step thread (refused when the replicas shard the optimizer: ``commit`` runs theirs).
* ``reconnect(Reconnect) -> Empty``: replace the communicator (a new generation prefix).
* ``commit(CommitStep) -> CommitReply``: apply the step's update, on the step thread: the
  gradients multiplied by ``grad_scale`` first (fp16's loss scale undone, clipping by the global
  norm), then the local optimizer (built on the first commit, as ``optimizer_step``, with the
  job's learning-rate scheduler: ``services/params/scheduling.py``), or, on the
  parameter-server path, push the gradients and pull the new values
  (:mod:`services.params.grad_path`). The coordinator commits only once every stage of every
  replica finished the step (a step is a transaction). A commit usually travels inside
  the next ``run_step`` (``RunStep.commit``), applied before that step's first action;
  this call commits the last step of a run.
* ``state(Empty) -> TensorsReply`` + parameters and buffers (copies), as the model names them.
* ``flush_saves(Empty) -> SavedParts``: wait (bounded) until every checkpoint part this stage
  was asked for is written; the parts not reported yet.

Checkpoints (``services/checkpoint/``). A commit may carry a ``save``: once the update is
applied, on the step thread, the stage copies its training state to host memory (replica 0:
parameters, buffers and optimizer state; every replica: its RNG state) and a background
thread writes it as the stage's part of the checkpoint while the next step runs. Each reply
lists the parts finished since the last (``saved``), which is how the coordinator learns
that a checkpoint is complete. An assignment with ``restore`` loads the stage's tensors (by
name: the checkpoint may come from any plan) before it answers, and the optimizer state
when the optimizer is built, at the first commit.

BatchNorm (see [Note: BatchNorm sees the global batch] in ``services/compute/batchnorm.py``). A
stage with BatchNorm layers takes one microbatch per training step (more is a ``bad_request``);
its replicas normalise with the statistics of all of them, all-reduced over the data-parallel
group; parameter-server mode with replicas is refused at assignment.

Data parallelism. Replicas of one stage synchronise gradients through the stage's
gradient path (:mod:`services.params.grad_path`): ``run_step`` begins it (waiting for the
data-parallel group, bounded by the step's deadline) and the executor arms and finishes
it around the last backward. With ``zero_stage`` 1 or 2 (:mod:`services.params.zero`) the
optimizer steps this replica's rows of each parameter and the next step's forward all-gathers the
rows bucket by bucket (a commit no step carries, or one that saves: an ``all_gather`` phase); a
checkpoint still holds whole optimizer state by name. A ZeRO-2
replica holds only its gradient shards after a step, so ``gradients`` lists every parameter as
missing then. With ``offload`` the optimizer is built over host-memory masters of what it would
step (``services/params/offload.py``): the commit copies the gradients there, steps, copies back.
Each step reply carries the bytes the stage holds (``StepReply.held_bytes``) and the
worker's peak since the stage's assignment (``peak_bytes``: :class:`comm.memcap.PeakProbe`). A step
or commit whose allocation fails (the worker's ``--memory-limit``: [Note: the memory cap] in
``comm/memcap.py``) fails with ``out_of_memory``, naming the worker, its cap and the action.

Tied parameters (``ComputeOptions.tied``: a Parameter other stages hold too, such as an
embedding tied to the output head). The executor sums their gradients over the holding
stages at the end of the step; in parameter-server mode only their owner pushes and pulls
them, and the commit then copies the owner's value to the other holders (a ``tied_share``
phase); a checkpoint holds them once, written by the owner. See [Note: tied parameters] in
:mod:`services.params.tied`.

One thing at a time: while a step or optimizer step runs, every state-touching call is
answered ``busy``.

Stages sharing a worker (``ComputeOptions.turns``, interleaved schedules): a training step's
actions take turns with theirs in the worker's order (``services/compute/turns.py``).

Communicator. The stages of one pipeline form a communicator (rank = stage index) that
meets under ``comm_prefix``; it is joined in the background from the moment of
assignment (:class:`~services.link.PipelineLink`), and ``run_step`` waits for it, bounded
by the step's deadline.

[Note: a failed step poisons the channels]
A step that fails after posting a transfer may leave messages in flight, and the
backends number messages per peer and tag, so later steps would read stale data. The
service then refuses ``run_step`` with ``comm_failed`` until ``reconnect`` gives it a
fresh communicator under a new prefix (every stage of the pipeline reconnects; then the
abandoned step can be run again: with ``zero_grad`` it gives the same gradients).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch

# the checkpoint path's modules count as the runtime's bytes: loaded here, before an assignment's peak
# is measured, not at the stage's first save (services/checkpoint/dcp.py imports them where used)
import torch.distributed.checkpoint
from pydantic import BaseModel, ValidationError

from comm import traffic
from comm.codec import describe_validation_error
from comm.factory import wire_device
from comm.logs import log_context
from comm.memcap import PeakProbe, is_allocation_failure, out_of_memory_message, release_freed
from comm.rpc import Call, RpcError, ServiceBase
from services import faults
from services.checkpoint.dcp import CheckpointFormatError
from services.checkpoint.stage_state import (
    FullState,
    OptimizerState,
    Restored,
    apply_optimizer_state,
    load_stage,
    snapshot,
)
from services.checkpoint.writer import PartWriter
from services.compute import turns
from services.compute.batchnorm import BatchNormSync, batch_norm_layers
from services.compute.executor import StepExecutor, StepFailed, evaluating
from services.compute.programs import Programs
from services.compute.randomness import ModelRandomness
from services.compute.stage import Stage, build_stage, check_samples, make_optimizer
from services.compute.update import local_update, scale_grads
from services.compute.window import Verdict, agree
from services.factories import FactoryAllowList
from services.link import PipelineLink
from services.params import scheduling
from services.params.grad_path import build_path
from services.params.offload import HostCopy
from services.params.sharded_path import FullyShardedPath
from services.params.tied import TiedSync
from services.params.zero import ZeroPath, check_elementwise, state_bytes
from services.protocol import (
    Assignment,
    CommitReply,
    CommitStep,
    ComputeOptions,
    Empty,
    LoadProgram,
    OptimizerSpec,
    OptimizerStepReply,
    OptimizerStepRequest,
    PhaseTiming,
    Reconnect,
    RunStep,
    SavedParts,
    StepReply,
    StepWindow,
    TensorsReply,
    TrafficReports,
    WindowReply,
    ZeroGradRequest,
)

__all__ = ["CellComputeService"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The host answers `timeout` this long after a step's own deadline, if the step thread has
# not answered by then (it normally does: every wait inside a step is bounded by the deadline).
_REPLY_GRACE = timedelta(seconds=5)
OPTIMIZER_STEP_TIMEOUT = timedelta(seconds=600)
FLUSH_TIMEOUT = timedelta(seconds=600)  # writing the last checkpoint parts at the end of a run


class CellComputeService(ServiceBase):
    """Serves one pipeline stage. Build it with :meth:`from_assignment`.

    Args:
        stage: The built stage.
        options: Its plan fields (backend, registry, prefix, timeouts).
        seed: The job's seed: it keys the random draws of the stage's forwards
            (``services/compute/randomness/``).

    Timeouts: ``options.comm_timeout_ms`` bounds the communicator's rendezvous and is the
    default of its transfers; ``RunStep.timeout_ms`` bounds a whole step, waiting for the
    communicator included; :data:`OPTIMIZER_STEP_TIMEOUT` bounds an optimizer step.
    """

    def __init__(self, stage: Stage, options: ComputeOptions, seed: int) -> None:
        self._batch_norm = batch_norm_layers(stage.module)
        if self._batch_norm and options.num_replicas > 1 and options.grad_path != "collective":
            raise ValueError(f"BatchNorm layer {self._batch_norm[0]} needs the statistics of every replica, "
                             "and parameter-server mode has no data-parallel group to share them: use "
                             "collective mode")
        if self._batch_norm and stage.pieces is not None:
            raise ValueError(f"BatchNorm layer {self._batch_norm[0]} updates its running statistics in each "
                             "training forward, and recompute runs its forward twice: drop plan.recompute, "
                             "or freeze the layer (eval mode)")
        self._stage = stage
        self._comm_timeout = timedelta(milliseconds=options.comm_timeout_ms)
        self._randomness = ModelRandomness(stage.module, seed)
        self._tag = f"[stage {stage.index}/{stage.num_stages}]"
        self._lock = threading.Lock()  # guards the fields below
        self._busy: str | None = None
        self._closed = False
        self._poisoned: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-stage{stage.index}")
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: scheduling.Scheduler | None = None  # the optimizer's, if the job has one
        self._optimizer_spec: OptimizerSpec | None = None
        self._optimizer_steps = 0
        self._offload = options.offload  # the optimizer steps host masters (services/params/offload.py)
        self._host: HostCopy | None = None  # made with the optimizer
        self._link = PipelineLink(backend=options.comm_backend, rank=stage.index, world_size=stage.num_stages,
                                  registry_url=options.registry, prefix=options.comm_prefix,
                                  timeout=timedelta(milliseconds=options.comm_timeout_ms))
        if options.zero_stage in (2, 3) and options.tied is not None:
            raise ValueError(f"stage {stage.index} holds parameters tied to other stages "
                             f"({', '.join(t.name for t in options.tied.params)}), whose gradients are "
                             "summed over the stages after the step, and plan.zero="
                             f"{options.zero_stage} keeps only a shard of each gradient: use plan.zero=1")
        self._path = build_path(stage.module, options)
        self._zero = self._path if isinstance(self._path, ZeroPath | FullyShardedPath) else None
        self._tied = TiedSync.build(stage.parameters(), options)
        self._mirrors = self._tied.mirrors if self._tied is not None else frozenset()
        self._batch_norm_sync = (BatchNormSync(stage.module, self._path.group)
                                 if self._batch_norm and options.num_replicas > 1 else None)
        self._state_keys = options.state_keys
        self._precision = options.precision
        self._part = f"r{options.replica}-s{stage.index}"
        self._replica, self._replicas = options.replica, options.num_replicas
        self._zero_stage = options.zero_stage
        self._writer = PartWriter(before_write=lambda snap: faults.at(snap.step, "save"))  # fault injection
        self._restored = Restored()
        self._turns = turns.acquire(options.turns.key, options.turns.order) if options.turns else None
        self._programs = Programs(stage, self._batch_norm)  # the host thread's alone
        self._probe = PeakProbe()
        self._traffic = TrafficReports()  # the counters ride on a reply when they changed

    @classmethod
    def from_assignment(cls, assignment: Assignment, factories: FactoryAllowList) -> CellComputeService:
        """Build the stage (synchronously, so factory errors answer the assignment) and start connecting.

        Only the factories ``factories`` allows are resolved (the worker's job's).

        Raises:
            RpcError: ``bad_request`` naming the bad option or factory.
        """
        try:
            options = ComputeOptions.model_validate(assignment.options)
        except ValidationError as exc:
            raise RpcError("bad_request", f"compute options: {describe_validation_error(exc)}") from None
        # a worker loaded it at start (services/host/worker.py); a service hosted elsewhere loads it here,
        # before the peak: the optimizer's constructor and recompute import it, the runtime's bytes
        importlib.import_module("torch._dynamo")
        probe = PeakProbe().start()  # the worker's peak from here: the stage's tensors and what runs them
        try:
            stage = build_stage(assignment, options, factories)
            restored = Restored()
            if options.restore:
                restored = load_stage(Path(options.restore), f"r{options.replica}-s{options.stage}",
                                      stage.state(), stage.parameters(), options.state_keys)
            service = cls(stage, options, assignment.seed)
            service._restored = restored
            service._probe = probe
        except CheckpointFormatError as exc:
            raise RpcError("bad_request", f"stage {options.stage}: restoring: {exc}") from None
        except ValueError as exc:  # a factory, the trace, the node range or the registry URL
            raise RpcError("bad_request", f"stage {options.stage}: {exc}") from None
        log.info("[stage %d/%d] nodes %s, %d parameters", options.stage, options.num_stages,
                 list(stage.nodes), sum(p.numel() for _, p in stage.parameters()))
        return service

    # -- one thing at a time ------------------------------------------------------------

    def _check_idle(self, what: str) -> None:
        if self._closed:
            raise RpcError("closed", f"stage {self._stage.index} is shutting down")
        if self._busy is not None:
            raise RpcError("busy", f"stage {self._stage.index} cannot {what} while it runs {self._busy}")

    def _submit(self, call: Call, what: str, timeout: timedelta, work: Callable[[], BaseModel]) -> None:
        """Run ``work`` on the step thread and answer ``call`` from there (bounded by ``timeout``)."""
        with self._lock:
            self._check_idle(what)
            self._busy = what

        def on_timeout() -> tuple[str, str]:
            seconds = timeout.total_seconds()
            return "timeout", f"stage {self._stage.index}: {what} did not finish within {seconds:.1f}s"

        call.defer(timeout + _REPLY_GRACE, on_timeout)

        def run() -> None:
            reply: BaseModel | None = None
            error: tuple[str, str] | None = None
            try:
                reply = work()
            except Exception as exc:
                if not is_allocation_failure(exc):
                    error = self._error(what, exc)
                else:  # the worker's memory cap, or the machine's: the job cannot go on as planned
                    failed = (str(exc) if isinstance(exc, StepFailed)
                              else f"stage {self._stage.index}: {what}: {type(exc).__name__}: {exc}")
                    error = ("out_of_memory", out_of_memory_message(failed))
                    log.error("%s %s", self._tag, error[1])
            finally:
                with self._lock:
                    self._busy = None  # before answering: the caller may send the next request at once
            if error is not None and error[0] == "out_of_memory":
                # the failed step's tensors may wait in reference cycles for the collector: free them before
                # answering, or the worker meets the next request at its cap (a thread's stack, a buffer)
                release_freed()
            if error is not None:
                call.fail(*error)
            elif reply is not None:
                call.reply(reply)

        self._pool.submit(contextvars.copy_context().run, run)  # the step thread logs the request's context

    def _error(self, what: str, exc: Exception) -> tuple[str, str]:
        """The error reply for ``exc`` raised by ``what`` on the step thread."""
        if isinstance(exc, StepFailed):
            log.error("%s %s failed: %s", self._tag, what, exc)
            return "step_failed", str(exc)
        if isinstance(exc, RpcError):
            return exc.code, exc.message
        log.error("%s %s failed", self._tag, what, exc_info=exc)
        return "internal", f"stage {self._stage.index}: {what}: {type(exc).__name__}: {exc}"

    # -- RPCs -----------------------------------------------------------------------------

    def rpc_run_step(self, request: RunStep, call: Call) -> None:
        stage = self._stage
        with self._lock:
            self._check_idle(f"step {request.step}")
            if self._poisoned is not None:
                raise RpcError("comm_failed", f"stage {stage.index}: {self._poisoned}; reconnect every stage "
                                              "under a new comm_prefix before the next step")
            window = request.window
            optimizer = self._commit_optimizer(request.commit) if request.commit is not None else None
            if window is not None and self._optimizer_spec not in (None, window.optimizer):
                raise RpcError("bad_request", f"stage {stage.index}: the optimizer is "
                                              f"{self._optimizer_spec}; the window's is {window.optimizer} "
                                              "(reassign the stage to change it)")
        try:
            request, trains = self._programs.resolve(request)
            check_samples(stage, request.microbatches, request.source)
            for later in window.microbatches if window is not None else ():
                check_samples(stage, later, request.source)
            if window is not None and (not trains or request.source == "eval"):
                raise ValueError("a window of steps takes a training list (with backwards); send the steps "
                                 "of this list one by one")
            if window is not None and (self._zero_stage >= 2 or not self._path.updates_locally):
                raise ValueError("a window of steps is for stages updating locally whose replicas hold the "
                                 "whole gradient (the stages decide each commit together); this stage has "
                                 + (f"plan.zero={self._zero_stage}" if self._zero_stage >= 2 else
                                    "its update on the parameter server") + ": send the steps one by one")
            positions = turns.positions(self._turns, stage.index, request.actions, request.source)
        except ValueError as exc:  # an unknown program, a ScheduleError, a sample out of range, BatchNorm
            raise RpcError("bad_request", f"step {request.step}: {exc}") from None
        timeout = timedelta(milliseconds=request.timeout_ms)

        def run() -> BaseModel:
            held = optimizer
            reply = self._one_step(request, request.commit, held, trains, positions, timeout,
                                   counters=window is None)
            if window is None:
                return reply
            replies, committed = [reply], []
            commits = window.first_commit
            for k, microbatches in enumerate(window.microbatches):
                verdict = self._verdict(reply, window, timeout)
                if verdict.action == "stop":
                    break
                committed.append(verdict.action == "commit")
                commit = None
                if verdict.action == "commit":
                    commit = CommitStep(step=commits, optimizer=window.optimizer,
                                        timeout_ms=request.timeout_ms, grad_scale=verdict.grad_scale,
                                        train_step=request.step + k)
                    commits += 1
                    if held is None:  # built at its first update, as a commit the coordinator sends builds it
                        with self._lock:
                            held = self._commit_optimizer(commit)
                later = request.model_copy(update={"step": request.step + k + 1, "microbatches": microbatches,
                                                   "commit": None, "window": None})
                with log_context(step=later.step):  # the records of each step of the window name it
                    reply = self._one_step(later, commit, held, trains, positions, timeout, counters=False)
                replies.append(reply)
            # the worker's counters once, on the window's last reply (the coordinator keeps the latest)
            replies[-1] = replies[-1].model_copy(update={"traffic": self._traffic.report(traffic.snapshot())})
            return WindowReply(steps=replies, committed=committed)

        steps = 1 + (len(window.microbatches) if window is not None else 0)
        self._submit(call, f"step {request.step}" if steps == 1 else
                     f"steps {request.step}-{request.step + steps - 1}", timeout * steps, run)

    def _verdict(self, reply: StepReply, window: StepWindow, timeout: timedelta) -> Verdict:
        """Every stage's verdict on the commit of the step ``reply`` answers ([Note: a window of steps])."""
        stage = self._stage
        try:
            comm = self._link.wait(timeout)
            device = wire_device(comm.backend, stage.device) if comm is not None else stage.device
            group = self._path.group() if self._replicas > 1 else None
            if self._replicas > 1 and group is None:
                raise RuntimeError(f"the data-parallel group of {self._replicas} replicas is not formed")
            group_device = wire_device(group.backend, stage.device) if group is not None else stage.device
            with self._lock:
                closing = self._closed
            return agree(comm, stage.index, stage.num_stages, reply, window.clip_grad_norm, window.nonfinite,
                         device, timeout, group, group_device, closing)
        except (TimeoutError, RuntimeError) as exc:
            with self._lock:
                self._poisoned = f"step {reply.step}'s verdict failed"
            raise StepFailed(f"stage {stage.index}, step {reply.step}: agreeing on its commit: {exc}",
                             transfers_posted=True) from exc

    def _one_step(self, request: RunStep, commit: CommitStep | None, optimizer: torch.optim.Optimizer | None,
                  trains: bool, positions: list[int] | None, timeout: timedelta, *, counters: bool = True,
                  ) -> StepReply:
        """Apply ``commit`` (the previous step's), then run the step ``request`` names; its reply (with the
        worker's traffic counters if ``counters`` and they changed)."""
        stage = self._stage
        deadline = time.monotonic() + timeout.total_seconds()
        if self._batch_norm_sync is not None:
            self._batch_norm_sync.begin(deadline)
        faults.at(request.step, "step")
        phases: list[PhaseTiming] = []
        if commit is not None:  # the previous step's update first: it was complete
            phases = self._apply_commit(commit, optimizer, timeout, request.step)
        try:
            comm = self._link.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
            self._path.begin(timedelta(seconds=max(0.0, deadline - time.monotonic())))
        except (TimeoutError, RuntimeError) as exc:
            raise StepFailed(f"stage {stage.index}, step {request.step}: {exc}",
                             transfers_posted=False) from exc
        start = time.monotonic()
        try:
            with (evaluating(stage.module) if request.source == "eval" else contextlib.nullcontext(),
                  turns.taking(self._turns, request.step, stage.index, positions, deadline) as taking):
                reply = StepExecutor(stage, comm, request, trains, deadline, self._path,
                                     self._precision, self._tied, self._randomness, taking).run()
        except TimeoutError as exc:  # the worker's previous step did not end
            self._path.abandon()
            raise StepFailed(f"stage {stage.index}, step {request.step}: {exc}",
                             transfers_posted=False) from exc
        except StepFailed as exc:
            self._path.abandon()
            reduced = self._batch_norm_sync is not None and self._batch_norm_sync.reduced
            if exc.transfers_posted or self._path.launched or reduced:
                with self._lock:
                    self._poisoned = f"step {request.step} failed after posting transfers"
            raise
        log.debug("%s step %d: %d actions in %.3fs", self._tag, request.step, len(request.actions),
                  time.monotonic() - start)
        if request.source != "eval":
            self.finished_step = request.step
        lead = self._path.lead if commit is not None else None  # async parameter server
        return reply.model_copy(update={"phases": [*phases, *reply.phases], "lead": lead,
                                        "held_bytes": self._held_bytes(),
                                        "peak_bytes": self._probe.peak(), "traffic": self._traffic.report(
                                            traffic.snapshot(), training=request.source != "eval")
                                        if counters else None,
                                        "saved": self._writer.finished()})

    def rpc_load_program(self, request: LoadProgram, call: Call) -> Empty:
        try:
            self._programs.load(request)
        except ValueError as exc:
            raise RpcError("bad_request", f"stage {self._stage.index}, program {request.program}: "
                                          f"{exc}") from None
        return Empty()

    def rpc_parameters(self, request: Empty, call: Call) -> TensorsReply:
        with self._lock:
            self._check_idle("send its parameters")
            self._check_whole("send its parameters")
            # copies: the reply's frames are sent zero-copy after this returns
            call.tensors_out = [(name, p.detach().clone()) for name, p in self._stage.parameters()]
        return TensorsReply(names=[name for name, _ in call.tensors_out])

    def rpc_gradients(self, request: Empty, call: Call) -> TensorsReply:
        with self._lock:
            self._check_idle("send its gradients")
            self._check_whole("send its gradients")
            params = self._stage.parameters()
            call.tensors_out = [(n, p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                for n, p in params]
        return TensorsReply(names=[n for n, _ in params], missing=[n for n, p in params if p.grad is None])

    def _check_whole(self, what: str) -> None:
        """Raise RpcError if the stage's parameters are spread over its group (ZeRO-3, after a step)."""
        if isinstance(self._path, FullyShardedPath) and self._path.sharded:
            raise RpcError("bad_request", f"stage {self._stage.index}: its parameters are fully sharded "
                                          f"(plan.zero=3) over its data-parallel group, so it cannot {what} "
                                          "alone: ask every replica for its state (the job's final state)")

    def rpc_zero_grad(self, request: ZeroGradRequest, call: Call) -> Empty:
        with self._lock:
            self._check_idle("zero its gradients")
            for _, p in self._stage.parameters():
                if request.set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        return Empty()

    def rpc_optimizer_step(self, request: OptimizerStepRequest, call: Call) -> None:
        if self._zero is not None:
            raise RpcError("bad_request", f"stage {self._stage.index}: its replicas shard the optimizer "
                                          f"(plan.zero={self._zero.stage}), whose step all-gathers the "
                                          "parameters: apply updates with commit")
        with self._lock:
            self._check_idle("apply an optimizer step")
            optimizer = self._optimizer or self._build_optimizer(request.optimizer)
        if request.optimizer != self._optimizer_spec:
            raise RpcError("bad_request", f"stage {self._stage.index}: the optimizer is "
                                          f"{self._optimizer_spec}; got {request.optimizer} (reassign "
                                          "the stage to change it)")

        def run() -> BaseModel:
            if self._host is not None:
                self._host.pull_grads()
            optimizer.step()
            if self._host is not None:
                self._host.push_params()
            self._optimizer_steps += 1
            return OptimizerStepReply(steps=self._optimizer_steps)

        self._submit(call, "an optimizer step", OPTIMIZER_STEP_TIMEOUT, run)

    def _build_optimizer(self, spec: OptimizerSpec) -> torch.optim.Optimizer:
        params: list[tuple[str, torch.Tensor]] = list(self._stage.parameters())
        restored = self._restored.optimizer_state
        try:
            if self._zero is not None:  # the optimizer steps this replica's rows of each parameter
                check_elementwise(spec.name)
                restored = self._zero.shard_restored(self._stage.parameters(), restored)
                params = self._zero.optimizer_params(self._stage.parameters())
            if self._offload:  # the optimizer's tensors are host masters of the device's
                self._host = HostCopy(params)
                params = self._host.masters()
            optimizer = make_optimizer(spec, [p for _, p in params], fused=True)
            # on the initial rate, before any restored state: [Note: a scheduler's position]
            self._scheduler = (scheduling.build_scheduler(spec.scheduler, optimizer)
                               if spec.scheduler is not None else None)
        except ValueError as exc:
            raise RpcError("bad_request", f"stage {self._stage.index}: {exc}") from None
        apply_optimizer_state(optimizer, params, Restored(restored))
        self._restored = Restored()  # applied: the checkpoint's tensors are not kept
        self._optimizer, self._optimizer_spec = optimizer, spec
        return optimizer

    def _commit_optimizer(self, commit: CommitStep) -> torch.optim.Optimizer | None:
        """The local optimizer ``commit`` applies (built on first use; None on the parameter-server path).

        Call with the lock held.

        Raises:
            RpcError: ``bad_request`` if ``commit`` names another optimizer than the stage's.
        """
        if not self._path.updates_locally:
            return None
        optimizer = self._optimizer or self._build_optimizer(commit.optimizer)
        if commit.optimizer != self._optimizer_spec:
            raise RpcError("bad_request", f"stage {self._stage.index}: the optimizer is "
                                          f"{self._optimizer_spec}; got {commit.optimizer} (reassign "
                                          "the stage to change it)")
        return optimizer

    def _apply_commit(self, commit: CommitStep, optimizer: torch.optim.Optimizer | None,
                      timeout: timedelta, step: int) -> list[PhaseTiming]:
        """Apply the update of the step ``commit`` names (on the step thread, serving ``step``); its
        phases. Then snapshot the state for a checkpoint if the commit carries a ``save``.

        Raises:
            StepFailed: The parameter-server exchange failed.
        """
        phases: list[PhaseTiming] = []
        if optimizer is not None:
            faults.at(step, "optimizer")
            start = time.time()
            self._update(optimizer, commit)
            phases.append(PhaseTiming(name="optimizer", start=start, end=time.time()))
            if self._zero is not None:
                zero = self._zero
                # before a step (step >= 0) without a checkpoint, its forward gathers the parameters
                defer = step >= 0 and commit.save is None
                gathered = self._in_group(commit, "all-gathering the parameters",
                                          lambda: zero.gather_params(timeout, defer=defer))
                phases += [gathered] if gathered is not None else []
        else:
            faults.at(step, "push_pull")
            owned = [(n, p) for n, p in self._stage.parameters() if n not in self._mirrors]
            scale_grads(owned, commit.grad_scale)  # fp16's unscale: the shards take unscaled gradients
            try:
                phase = self._path.exchange(commit.step, owned, timeout, train_step=commit.train_step)
            except Exception as exc:
                raise StepFailed(f"stage {self._stage.index}, commit of step {commit.step}: push/pull: "
                                 f"{type(exc).__name__}: {exc}", transfers_posted=False) from exc
            phases += [phase] if phase is not None else []
            if self._tied is not None:
                try:
                    phases.append(self._tied.share(timeout))
                except Exception as exc:  # a broadcast may be left half-done: the groups need a reconnect
                    what = f"stage {self._stage.index}, commit of step {commit.step}: sharing tied parameters"
                    with self._lock:
                        self._poisoned = f"{what} failed"
                    raise StepFailed(f"{what}: {type(exc).__name__}: {exc}", transfers_posted=True) from exc
        self._optimizer_steps += 1
        if commit.save is not None:
            start = time.time()
            state: OptimizerState | None = optimizer
            if self._host is not None and optimizer is not None:  # the masters' state, by the device tensors
                state = self._host.device_state(optimizer)
            if self._zero is not None and state is not None:  # whole tensors, as every plan saves them
                zero, held = self._zero, state
                state = FullState(self._in_group(commit, "all-gathering the optimizer state",
                                                 lambda: zero.full_state(held, timeout)))
            whole = self._in_group(commit, "gathering the parameters whole",  # ZeRO-3's: a collective
                                   lambda: self._whole_state(timeout))
            snap = snapshot(commit.save.step, self._part, whole, self._stage.parameters(),
                            state, self._state_keys, share=(self._replica, self._replicas),
                            skip=self._mirrors)
            self._writer.submit(snap, Path(commit.save.directory))
            phases.append(PhaseTiming(name="snapshot", start=start, end=time.time()))
        return phases

    def _update(self, optimizer: torch.optim.Optimizer, commit: CommitStep) -> None:
        """The local update (:func:`~services.compute.update.local_update`).

        Raises:
            StepFailed: The scheduler cannot step (OneCycleLR past its ``total_steps``) or is past the step.
        """
        params: list[tuple[str, torch.Tensor]] = list(self._stage.parameters())
        if self._zero is not None:
            self._zero.attach_grads(self._stage.parameters())
            params = self._zero.optimizer_params(self._stage.parameters())
        try:
            local_update(params, optimizer, self._scheduler, commit, self._host)
        except ValueError as exc:
            raise StepFailed(f"stage {self._stage.index}, commit of step {commit.train_step + 1}: {exc}",
                             transfers_posted=False) from exc

    def _in_group(self, commit: CommitStep, what: str, run: Callable[[], T]) -> T:
        """ZeRO: a collective of the commit in the sharding group (on failure the group must reconnect)."""
        try:
            return run()
        except Exception as exc:
            where = f"stage {self._stage.index}, commit of step {commit.step}: {what}"
            with self._lock:
                self._poisoned = f"{where} failed"
            raise StepFailed(f"{where}: {type(exc).__name__}: {exc}", transfers_posted=True) from exc

    def _held_bytes(self) -> int:
        """Bytes of the stage's parameters, the gradients it holds and its optimizer state (offloaded: with
        the host's masters and their gradients)."""
        host = self._host.host_bytes() if self._host is not None else 0
        if self._zero is not None:
            return self._zero.held_bytes(self._optimizer) + host
        params = [p for _, p in self._stage.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        return (sum(t.numel() * t.element_size() for t in [*params, *grads]) + host
                + (state_bytes(self._optimizer) if self._optimizer is not None else 0))

    def rpc_commit(self, request: CommitStep, call: Call) -> None:
        with self._lock:
            self._check_idle(f"commit step {request.step}")
            optimizer = self._commit_optimizer(request)
        timeout = timedelta(milliseconds=request.timeout_ms)

        def run() -> BaseModel:
            phases = self._apply_commit(request, optimizer, timeout, -1)
            return CommitReply(step=request.step, optimizer_steps=self._optimizer_steps, phases=phases,
                               saved=self._writer.finished())

        self._submit(call, f"commit of step {request.step}", timeout, run)

    def rpc_state(self, request: Empty, call: Call) -> TensorsReply:
        with self._lock:
            self._check_idle("send its state")
            try:
                # ZeRO-3: an all-gather per unit, so the coordinator asks every replica of the group
                tensors = self._whole_state(self._comm_timeout)
                call.tensors_out = [(name, t.detach().clone()) for name, t in tensors]
            except Exception as exc:
                if not is_allocation_failure(exc):
                    raise
                call.tensors_out = []
                failed = f"stage {self._stage.index}: copying its state to send: {type(exc).__name__}: {exc}"
                raise RpcError("out_of_memory", out_of_memory_message(failed)) from None
        return TensorsReply(names=[name for name, _ in call.tensors_out])

    def _whole_state(self, timeout: timedelta) -> list[tuple[str, torch.Tensor]]:
        """The stage's parameters and buffers, a fully sharded stage's gathered whole (a collective)."""
        if isinstance(self._path, FullyShardedPath):
            return self._path.whole(self._stage.state(), timeout)
        return self._stage.state()

    def rpc_flush_saves(self, request: Empty, call: Call) -> None:
        call.defer(FLUSH_TIMEOUT + _REPLY_GRACE, lambda: ("timeout", f"stage {self._stage.index}: checkpoint "
                                                                     "parts still being written"))

        def wait() -> None:
            try:
                call.reply(SavedParts(parts=self._writer.flush(FLUSH_TIMEOUT)))
            except TimeoutError as exc:
                call.fail("timeout", f"stage {self._stage.index}: {exc}")

        threading.Thread(target=wait, daemon=True, name=f"flush-stage{self._stage.index}").start()

    def rpc_reconnect(self, request: Reconnect, call: Call) -> Empty:
        with self._lock:
            self._check_idle("reconnect")
            self._poisoned = None
        if request.dp_prefix:
            self._path.reconnect(request.dp_prefix)
        if request.tied_prefix and self._tied is not None:
            self._tied.reconnect(request.tied_prefix)
        self._link.connect(request.comm_prefix)
        log.info("%s reconnecting under %s", self._tag, request.comm_prefix)
        return Empty()

    def on_close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._writer.close()
        if self._turns is not None:
            turns.release(self._turns.key)

        # Closing a communicator waits for its in-flight operations (one to a dead peer waits
        # out its timeout): not on the host thread, which serves every service of the worker,
        # unless no thread can start (the release must not fail: the service is gone either way).
        def close_comms() -> None:
            self._link.close()
            self._path.close()
            if self._tied is not None:
                self._tied.close()

        try:
            threading.Thread(target=close_comms, daemon=True, name=f"close-stage{self._stage.index}").start()
        except RuntimeError as exc:  # no memory for a thread's stack (a worker at its memory cap)
            log.warning("%s closing its communicators on the host thread: %s", self._tag, exc)
            close_comms()
