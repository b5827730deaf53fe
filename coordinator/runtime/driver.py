"""Drives a plan on running workers: places services, dispatches steps, commits them, collects state.

One :class:`Runtime` per plan and run (``RunSpec.run``, unique: a new run never reads an
old one's keys). Placement follows the plan exactly: the worker ``plan.placement[r][s]``
hosts ``{run}/compute-r{r}-s{s}``, stage ``s`` of replica ``r``, with the stage's boundary
specs derived from the plan's cuts, its pipeline communicator under
``/cellmesh/{job}/runs/{run}/pipe/r{r}``, (collective mode) its data-parallel group
under ``/cellmesh/{job}/runs/{run}/dp/s{s}`` and the groups of the parameters it holds with
other stages under ``/cellmesh/{job}/runs/{run}/tied/r{r}`` (``coordinator/runtime/tied.py``).
In parameter-server mode the workers of each stage also host its parameter shards
(``{run}/ps-s{s}-{i}``), set up from the coordinator's copy of the model before any step and
saved into checkpoints with the stages (``coordinator/runtime/shards.py``).
:meth:`Runtime.close` releases them all. Each stage runs on the device its worker's card allows
(``cpu`` or ``cuda:LOCAL_RANK``) and each group talks over the backend those devices call for
(``coordinator/runtime/devices.py``): refused before any step, naming the worker, when a stage is
asked onto a GPU its worker does not have. A plan with several stages per worker (``Plan.chunks``,
interleaved schedules) places each stage as its own service on its rank's worker
(``placement[r][s]`` is ``placement[r][s % R]``), and gives the services of one rank the rank's
merged order (``ComputeOptions.turns``) to take turns in (``services/compute/turns.py``).

A step is a transaction: parameters and optimizer state change only when the coordinator
commits it, and it commits a step only once every stage of every replica finished it.
:meth:`Runtime.run_step` sends one ``run_step`` to every stage of every replica at once
and awaits them through the event loop. Each names the stage's training program, which
:meth:`Runtime.place` sent once (``load_program``: the action list and the other per-plan
fields, validated by the stage on receipt; [Note: step programs] in
``services/protocol/compute.py``), so a step's request carries only the step, its samples, the
commit riding on it, the loss scale and the deadline. Every runtime places its services anew
(a new plan, a recovery's replacement, a resume) and so sends them their programs again; a
reconnected stage keeps its own. Evaluation steps carry their (forward-only) lists themselves:
they are rare, and their microbatch count varies. The request carries the commit of the previous
step (``RunStep.commit``), which each stage applies before its first action. So a step
costs one round trip, and the last stage's optimizer overlaps the first stage's. The last
step of a run is committed by :meth:`Runtime.commit` (a ``commit`` round), which
:meth:`Runtime.state` calls first. A step that fails is never committed. A commit also carries
the step's clipping coefficient (``coordinator/runtime/clipping.py``) and its training step,
where the learning-rate schedulers stand (``services/params/scheduling.py``); a step runs
``accumulate`` global batches (``coordinator/runtime/accumulation.py``).

Asynchronous parameter server (``plan.staleness = S > 0``): the shards apply each replica's push
on arrival and hold a replica's pull until it is within ``S`` steps of the slowest, so the replicas
need not move together. The smallest sound change to the lock step above: the runtime keeps each
replica's progress (``coordinator/runtime/async_steps.py``) and sends a replica its next step, with
its own commit riding on it, as soon as every stage of that replica answered its last one, within
``S`` steps of the oldest step not finished everywhere; :meth:`Runtime.run_step` still returns
one record per step (once every replica finished it), and requests of later steps stay in flight
across calls. The session gives it the later steps' batches (``upcoming``) and the end of the
``fit`` call. Each replica decides its own commit; what needs every replica's step together
(schedulers, clipping, fp16, skipping, checkpoints, evaluation) is refused before any worker
starts. See [Note: replicas at their own pace].

A step whose loss or gradients are not finite is dropped or stops the job: see
``coordinator/runtime/nonfinite.py``. :meth:`Runtime.evaluate` runs an evaluation step on the
held-out data (see [Note: how a job evaluates] in ``coordinator/runtime/evaluation.py``). Under
``fp16`` the runtime holds the loss scale: each request carries it, each commit its inverse, and a
step whose gradients overflow is dropped and backs it off ([Note: the loss scale] in
``coordinator/runtime/scaler.py``).


Failure semantics: an error reply, a worker whose registry lease lapses (its card
vanishes), or a round that outlasts its bound stops the job with :class:`JobFailed`
naming the worker, the service and the step. When a service reports an error, the
workers are probed first (``worker.status``, bounded): a worker that does not answer is
named as the cause, since a dead stage makes its neighbours fail too.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta

import torch

from comm.codec import unpack
from comm.heap import release, settle
from comm.rpc.hot import PackedBody
from comm.traffic import TrafficCounts, TrafficReport, latest_by
from coordinator.planning.devices import DeviceError
from coordinator.planning.plan import Plan
from coordinator.runtime.accumulation import accumulated_schedule
from coordinator.runtime.async_steps import AsyncProgress
from coordinator.runtime.clipping import global_norm, grad_scale, norm_parts
from coordinator.runtime.devices import place_devices
from coordinator.runtime.errors import JobError, JobFailed
from coordinator.runtime.evaluation import forward_actions
from coordinator.runtime.loop import EventLoop, Reply, WorkerJoined, WorkerLost
from coordinator.runtime.nonfinite import NonFiniteStep, first_nonfinite, overflowed, refuse
from coordinator.runtime.records import StepRecord, _Service
from coordinator.runtime.runspec import RunSpec, boundary_spec
from coordinator.runtime.scaler import LossScaler
from coordinator.runtime.shards import ParamShards
from coordinator.runtime.tied import tied_per_stage
from services.params.zero import check_elementwise
from services.protocol import (
    Assignment,
    AssignmentReply,
    CommitReply,
    CommitStep,
    ComputeOptions,
    Empty,
    LoadProgram,
    Release,
    RunStep,
    SavedPart,
    SavedParts,
    SaveRequest,
    ShardAddress,
    StepReply,
    TensorsReply,
    TiedOptions,
    TurnsOptions,
    WindowReply,
    WorkerCard,
    WorkerStatus,
)
from services.protocol.compute import MAX_WINDOW_STEPS, StepReport, step_end
from services.protocol.hot import StepRead, WindowRead

__all__ = ["Runtime"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT = timedelta(seconds=2)
NAMED = 8  # workers a message names before it counts the rest (a line per message, not per worker)
TRAIN_PROGRAM = "train"  # the name of each stage's training program (RunStep.program)
Batches = Sequence[Sequence[Sequence[int]]]  # [replica][microbatch] -> sample indices


def _latest_reports(ids: dict[int, _Service], replies: dict[int, Reply]) -> list[tuple[str, TrafficReport]]:
    """Each window reply's latest counters, with its worker: a service's reports are made in turn by one
    process whose counts only grow, so its last one holds the most of each (a stage reports on a window's
    last step only, so the scan from the end stops at once)."""
    reports = []
    for rid, reply in replies.items():
        for body in reversed(reply.body.steps):
            if body.traffic is not None:
                reports.append((ids[rid].worker, body.traffic))
                break
    return reports


def _some(items: Sequence[str]) -> str:
    """The first :data:`NAMED` of ``items``, then how many more."""
    shown = ", ".join(items[:NAMED])
    return shown if len(items) <= NAMED else f"{shown} and {len(items) - NAMED} more"


class Runtime:
    """Runs ``plan`` on connected workers through ``loop``.

    Args:
        plan: The plan (its placement names the workers).
        spec: The factories, optimizer, seed, backend and bounds.
        loop: The started event loop.
        registry_url: What the services rendezvous through.
        addresses: Each placed worker's service-host address.
        initial_params: The initial parameters by the stages' names (parameter-server setup; dropped once the
            shards hold them, empty in collective mode).

    Timeouts: ``spec.call_timeout`` bounds placement and state collection;
    ``spec.step_timeout`` bounds a step's round and the last step's commit round.
    """

    def __init__(self, plan: Plan, spec: RunSpec, loop: EventLoop, registry_url: str,
                 addresses: Mapping[str, str], initial_params: Mapping[str, torch.Tensor]) -> None:
        self.plan = plan
        self.spec = spec
        self.loop = loop
        self.registry_url = registry_url
        self.addresses = dict(addresses)
        self.initial_params = initial_params
        self.commits = 0  # updates committed so far
        self._span: tuple[int, int] | None = None  # the steps of the request in flight (first, count)
        self._finished: dict[str, int] = {}  # each service's last finished step, by the last status probe
        self._uncommitted = False  # the last step run awaits its commit
        self._pending = (0, 1.0)  # that step (train_step) and its commit's grad_scale
        self._last_good: tuple[int, float] | None = None  # the last finite step and its loss
        self._first_request = self._first_commit = True  # the first request, the first with a commit
        self._commit_dump: dict[str, object] | None = None  # CommitStep dumped, for the fields that vary
        self._optimizer_dump: dict[str, object] | None = None  # the optimizer's spec dumped, for windows
        self._first_window = True  # a window's request not checked yet
        self.scaler = LossScaler(spec.scaler) if plan.precision == "fp16" else None
        self._shards = ParamShards(plan, spec.run, addresses, initial_params, spec.holders,
                                   clip_grad_norm=spec.clip_grad_norm)  # no shards in collective mode
        self.traffic: dict[str, TrafficCounts] = {}  # each worker's latest counters (see StepRecord)
        # plan.staleness > 0: each replica's progress, made at the first step ([Note: replicas at their own
        # pace] in coordinator/runtime/async_steps.py); its requests not answered yet outlive a run_step
        self._async: AsyncProgress | None = None
        self._async_ids: dict[int, _Service] = {}
        # per stage, validated, as the training programs carry them (a step runs `accumulate` global batches)
        self._schedule = accumulated_schedule(plan.schedule(), spec.accumulate)
        self._actions = self._schedule.actions
        self._programs = [LoadProgram(program=TRAIN_PROGRAM, num_microbatches=self._schedule.num_microbatches,
                                      actions=list(acts)) for acts in self._actions]
        self.services = [_Service(plan.placement[r][s], f"{spec.run}/compute-r{r}-s{s}", r, s)
                         for r in range(plan.data_parallel) for s in range(plan.num_stages)]
        self.workers = sorted({sv.worker for sv in self.services})
        self._placed = frozenset(self.workers)  # what each membership event is checked against
        for w in self.workers:
            loop.connect(w, self.addresses[w])
        # the process each worker is (a loss reported for an earlier one, replaced since, is stale)
        self._incarnations = {w: self._incarnation(w) for w in self.workers}

    # -- placement ----------------------------------------------------------------------

    def place(self) -> None:
        """Assign every service the plan needs (shards first, set up; then every stage).

        Raises:
            JobFailed: A worker refused an assignment (a factory error, a bad option) or vanished.
        """
        plan, spec = self.plan, self.spec
        # a worker whose card vanished before this runtime was made (lost while the previous runtime was
        # released after another loss) sends no loss event now: it is lost, not a placement to wait on
        gone = [w for w in self.workers if self._incarnations[w] is None]
        if gone:
            raise self._lost(gone[0], "placing the stages", None)
        cards = {w: card for w in self.workers if (card := self._card(w)) is not None}  # what each one has
        try:
            placed = place_devices(plan, spec.devices, cards)
        except DeviceError as exc:
            raise JobFailed(f"placing the stages: {exc}") from None
        if plan.chunks > 1 and "nccl" in placed.pipeline:  # two ranks of one NCCL communicator on one GPU
            raise JobFailed(f"placing the stages: the plan puts {plan.chunks} stages on each worker, and "
                            "NCCL takes one rank per GPU: set runtime.pipeline_backend to zmq or gloo, "
                            "or use a schedule with one stage per worker")
        log.info("[coordinator %s] %s", spec.run, placed)
        shards = self._place_shards(self._shards)
        self.initial_params = {}  # the shards hold them now: no copy of the model stays here
        gen = f"/cellmesh/{spec.job}/runs/{spec.run}"
        tied = tied_per_stage(spec.tied, [(st.start, st.stop) for st in plan.stages])
        ids: dict[int, _Service] = {}
        if plan.offload and plan.mode != "collective":
            raise JobError("plan.offload moves the optimizer of collective mode to host memory; in "
                           "parameter-server mode the shards run the optimizer: drop plan.offload, or set "
                           "plan.mode: collective")
        on_cpu = sorted(w for w in self.workers if not placed.devices[w].startswith("cuda"))
        if plan.offload and on_cpu:  # it runs (services/params/offload.py: [Note: offload on a CPU worker])
            log.warning("[coordinator %s] plan.offload saves no memory on CPU workers (%s): their device is "
                        "the host, so the optimizer's host copy only adds a copy of the parameters and the "
                        "time to copy; drop plan.offload unless the workers run on CUDA", spec.run,
                        ", ".join(on_cpu))
        if plan.zero_stage:
            try:
                check_elementwise(spec.optimizer.name)
            except ValueError as exc:
                raise JobError(str(exc)) from None
        for sv in self.services:
            st = plan.stages[sv.stage]
            # the stage's tensors' keys (a tied copy another stage writes is restored from the same keys)
            keys = {k: v for k, v in spec.state_keys.items()
                    if any(st.start <= i < st.stop for i in spec.holders.get(k, ()))}
            options = ComputeOptions(
                stage=sv.stage, num_stages=plan.num_stages, device=placed.devices[sv.worker],
                comm_backend=placed.pipeline[sv.replica],  # type: ignore[arg-type]  # a Backend, by resolve_backend
                dp_backend=placed.data_parallel[sv.stage],  # type: ignore[arg-type]
                registry=self.registry_url, comm_prefix=f"{gen}/pipe/r{sv.replica}",
                comm_timeout_ms=int(spec.call_timeout.total_seconds() * 1000),
                factory_kwargs=spec.model_kwargs, data=spec.data, data_kwargs=spec.data_kwargs,
                loss=spec.loss, loss_kwargs=spec.loss_kwargs,
                incoming=boundary_spec(st.incoming, plan.microbatch_size) if sv.stage > 0 else None,
                outgoing=(boundary_spec(st.outgoing, plan.microbatch_size)
                          if sv.stage < plan.num_stages - 1 else None),
                replica=sv.replica, num_replicas=plan.data_parallel, grad_path=plan.mode,
                dp_prefix=f"{gen}/dp/s{sv.stage}",
                shards=shards[sv.stage], restore=spec.restore, precision=plan.precision,
                eval_data=spec.eval_data, eval_data_kwargs=spec.eval_data_kwargs, metric=spec.metric,
                leaves=list(spec.leaves), state_keys=keys,
                tied=(TiedOptions(prefix=f"{gen}/tied/r{sv.replica}", params=tied[sv.stage])
                      if tied[sv.stage] else None), turns=self._turns(sv),
                zero_stage=plan.zero_stage, shard_factor=plan.shard_factor, recompute=plan.recompute,
                offload=plan.offload, gather_bytes=spec.gather_bytes)
            assignment = Assignment(service=sv.name, kind="compute", factory=spec.model,
                                    nodes=[st.start, st.stop], seed=spec.seed,
                                    options=options.model_dump(mode="json"))
            ids[self.loop.send(sv.worker, "worker", "assign", assignment, AssignmentReply)] = sv
        self._gather(ids, "placing the stages", spec.call_timeout, None)
        self._load_programs()
        log.info("[coordinator %s] placed %d stages on %s", spec.run, len(self.services),
                 _some(self.workers))
        settle()  # the heap so far is not scanned again while this runtime runs (comm/heap.py)

    def _turns(self, sv: _Service) -> TurnsOptions | None:
        """The turns ``sv`` takes with the other stages of its worker (None: it holds one stage)."""
        if self.plan.chunks == 1:
            return None
        rank = self._schedule.rank_of(sv.stage)
        return TurnsOptions(key=f"{self.spec.run}/r{sv.replica}/rank{rank}",
                            order=list(self._schedule.rank_actions(rank)))

    def _load_programs(self) -> None:
        """Send every stage its training program (once per placement: a service placed anew holds none).

        Raises:
            JobFailed: A stage refused its program or vanished.
        """
        ids = {self.loop.send(sv.worker, sv.name, "load_program", self._programs[sv.stage], Empty): sv
               for sv in self.services}
        self._gather(ids, "loading the stages' programs", self.spec.call_timeout, None)

    def _place_shards(self, shards: ParamShards) -> list[list[ShardAddress]]:
        """Assign and set up the shards (restored from ``spec.restore``, if any); their addresses per stage.

        Raises:
            JobFailed: A worker refused an assignment or vanished.
        """
        ids = {self.loop.send(sv.worker, "worker", "assign", a, AssignmentReply): sv
               for sv, a in shards.assignments()}
        self._gather(ids, "placing the parameter shards", self.spec.call_timeout, None)
        for line in shards.set_up(self.spec.optimizer, self.spec.state_keys, self.spec.restore,
                                  self.spec.call_timeout):
            log.info("[coordinator %s] %s", self.spec.run, line)
        return shards.addresses

    # -- steps --------------------------------------------------------------------------

    @property
    def parts(self) -> list[str]:
        """The checkpoint parts the services write (each stage's replicas share its tensors)."""
        return [f"r{sv.replica}-s{sv.stage}" for sv in self.services] + self._shards.parts

    def part_writers(self) -> dict[str, str]:
        """Each checkpoint part (:meth:`parts`) -> the worker that writes it."""
        writers = {f"r{sv.replica}-s{sv.stage}": sv.worker for sv in self.services}
        writers.update({self._shards.part(sv): sv.worker for sv in self._shards.services})
        return writers

    @property
    def can_save(self) -> bool:
        """Whether the next :meth:`run_step` or :meth:`commit` carries a commit (a save rides on it)."""
        return self._uncommitted

    def run_step(self, step: int, batches: Batches, save: SaveRequest | None = None, *,
                 upcoming: Callable[[int], Batches] | None = None, end: int | None = None) -> StepRecord:
        """Run one step, carrying the previous step's commit; ``batches[r][m]``: replica r, microbatch m
        (``accumulate`` global batches: ``coordinator/runtime/accumulation.py``'s ``step_batches``).

        Asynchronous plans (``plan.staleness > 0``) run each replica at its own pace: later steps
        (below ``end``, with the batches ``upcoming(step)`` gives) may go to a replica that finished
        this one; the record is this step's, once every replica finished it (see [Note: replicas at
        their own pace] in ``coordinator/runtime/async_steps.py``).

        ``save`` rides on that commit (see ``coordinator/runtime/checkpoints.py``; the shards get theirs
        at once: [Note: a shard's part of a checkpoint]); give it only when :attr:`can_save`.

        The step's own update is committed by the next :meth:`run_step` (inside its
        requests) or by :meth:`commit`; :meth:`state` commits first.

        Raises:
            JobFailed: Naming the worker, the service and the step.
        """
        if self.plan.staleness:
            assert save is None, "an asynchronous plan takes no checkpoint"
            return self._run_async(step, batches, upcoming, step + 1 if end is None else end)
        return self.run_steps(step, [batches], save)[0]

    @property
    def window(self) -> int:
        """How many steps one request may carry: 1, or :data:`MAX_WINDOW_STEPS` where the stages can decide
        every commit themselves (the collective path with the whole gradient on every replica, ZeRO-1 at
        most; no fp16 loss scale: see [Note: a window of steps] in ``services/protocol/compute.py``)."""
        if (self.plan.staleness or self.scaler is not None or self.plan.zero_stage >= 2
                or self._shards.services or self.plan.mode != "collective"):
            return 1
        return MAX_WINDOW_STEPS

    def run_steps(self, step: int, batches: Sequence[Batches], save: SaveRequest | None = None
                  ) -> list[StepRecord]:
        """Run steps ``step .. step + len(batches) - 1`` (``batches[k]``: step ``step + k``'s, as
        :meth:`run_step` takes them) in one request per stage: the stages commit each step but the last
        themselves ([Note: a window of steps] in ``services/protocol/compute.py``); at most :attr:`window`
        steps. Their records, in order: fewer than asked when a step that is not finite stops the job (then
        :class:`~coordinator.runtime.nonfinite.NonFiniteStep` is raised, as by :meth:`run_step`).

        ``save`` rides on the commit the request carries (the previous step's), as in :meth:`run_step`.

        Raises:
            JobFailed: Naming the worker, the service and the step.
        """
        assert 1 <= len(batches) <= self.window, f"{len(batches)} steps in one request, at most {self.window}"
        assert not self.plan.staleness
        start, polled = time.time(), self.loop.poll_seconds
        timeout_ms = int(self.spec.step_timeout.total_seconds() * 1000)
        commit = self._commit_fields(save) if self._uncommitted else None
        assert save is None or commit is not None, "a save rides on a commit: check can_save first"
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        # fp16: a replica weighs its loss by its share of the global batch under the scale, as one process's
        # loss is (the replicas' gradients are then averaged; the unscale gives the factor back), so its fp16
        # backward holds one process's values and overflows where one process's does (before: at d times
        # them, a step one process keeps was skipped and the scale halved)
        replica_scale = loss_scale / self.plan.data_parallel if self.scaler is not None else loss_scale
        # RunStep, dumped (the services validate it): what the step changes, and the program it runs; packed
        # once per replica, whose stages all get it ([Note: a request packed once] in comm/rpc/hot.py)
        shared: dict[str, object] = {"step": step, "program": TRAIN_PROGRAM, "timeout_ms": timeout_ms,
                                     "loss_scale": replica_scale, "commit": commit}
        if self._optimizer_dump is None:
            self._optimizer_dump = self.spec.optimizer.model_dump(mode="python")
        window: dict[str, object] = {"optimizer": self._optimizer_dump,
                                     "first_commit": self.commits + (commit is not None),
                                     "clip_grad_norm": self.spec.clip_grad_norm,
                                     "nonfinite": self.spec.nonfinite}
        # the samples go as given (msgpack packs any sequence as an array): a copy would read every index
        requests = [{**shared, "microbatches": mbs} for mbs in batches[0]]
        if len(batches) > 1:  # each replica's samples of the later steps
            for r, request in enumerate(requests):
                request["window"] = {**window, "microbatches": [later[r] for later in batches[1:]]}
        if (self._first_request or (commit is not None and self._first_commit)
                or (len(batches) > 1 and self._first_window)):
            RunStep.model_validate(requests[0])  # the shape, checked once (and a window's once)
            self._first_request, self._first_commit = False, self._first_commit and commit is None
            self._first_window = self._first_window and len(batches) == 1
        per_replica = [PackedBody(request) for request in requests]
        ids: dict[int, _Service] = {}
        send = self.loop.send
        kind = WindowReply if len(batches) > 1 else StepReply
        for sv in self.services:
            ids[send(sv.worker, sv.name, "run_step", per_replica[sv.replica], kind)] = sv
        if commit is not None and self._shards.services:  # the shards' part of the commit (none: no shards)
            self._shards.send_round(self.loop, self._commit_request(save), save, self.spec.step_timeout)
        what = f"step {step}" if len(batches) == 1 else f"steps {step}-{step + len(batches) - 1}"
        # a window's replies and records are a few thousand young objects, read cold: the cyclic collector
        # waits until they are made (the young generation's scans cost 0.1 ms a step, measured); nothing of
        # theirs is cyclic, so reference counting frees them as before
        paused = len(batches) > 1 and gc.isenabled()
        if paused:
            gc.disable()
        try:
            return self._finish_steps(ids, step, batches, commit, loss_scale, replica_scale, start, polled,
                                      what)
        finally:
            if paused:
                gc.enable()

    def _finish_steps(self, ids: dict[int, _Service], step: int, batches: Sequence[Batches],
                      commit: dict[str, object] | None, loss_scale: float, replica_scale: float, start: float,
                      polled: float, what: str) -> list[StepRecord]:
        """:meth:`run_steps` once its requests are sent: the replies, then the records."""
        self._span = (step, len(batches))  # a failure names the step of the window it happened in
        try:
            replies = self._gather(ids, what, self.spec.step_timeout * len(batches) + timedelta(seconds=10),
                                   step)
        finally:
            self._span = None
        if commit is not None:
            self.commits += 1
        per_step = self._per_step(ids, replies, len(batches))
        traffic: dict[str, TrafficCounts] | None = None
        if len(per_step) > 1:  # a window's counters ride on its last replies: each record made now shows them
            self.traffic.update(latest_by(_latest_reports(ids, replies)))
            traffic = dict(self.traffic)  # one copy the window's records share (a worker's entry per record)
        records: list[StepRecord] = []
        ended = time.time()
        coordinator_s = max(0.0, (ended - start) - (self.loop.poll_seconds - polled)) / len(per_step)
        for k, (bodies, committed) in enumerate(per_step):
            last = k == len(per_step) - 1
            end = ended if last else max((t for _, body in bodies if (t := step_end(body)) is not None),
                                         default=ended)
            try:
                records.append(self._account(step + k, batches[k], bodies, committed, loss_scale,
                                             replica_scale, start, end, coordinator_s, traffic))
            except NonFiniteStep as exc:
                exc.before = records
                raise
            start = end
        return records

    def _per_step(self, ids: dict[int, _Service], replies: dict[int, Reply], steps: int
                  ) -> list[tuple[list[tuple[_Service, StepReport]], bool | None]]:
        """Each step's replies (by service) and whether the stages committed it (None: the request's last
        step, whose commit is the coordinator's)."""
        if steps == 1:
            bodies: list[tuple[_Service, StepReport]] = []
            for rid, reply in replies.items():
                assert isinstance(reply.body, StepRead | StepReply)
                bodies.append((ids[rid], reply.body))
            return [(bodies, None)]
        windows: list[tuple[_Service, WindowRead | WindowReply]] = []
        for rid, reply in replies.items():
            assert isinstance(reply.body, WindowRead | WindowReply)
            windows.append((ids[rid], reply.body))
        counts = {len(w.steps) for _, w in windows}
        verdicts = {tuple(w.committed) for _, w in windows}
        if len(counts) != 1 or len(verdicts) != 1:  # every stage applies stage 0's verdicts: a bug if not
            raise JobError(f"the stages of a window of {steps} steps disagree on its commits: "
                           + "; ".join(f"stage {sv.stage} ran {len(w.steps)} steps, committed {w.committed}"
                                       for sv, w in windows))
        ran = counts.pop()
        committed = verdicts.pop()
        return [([(sv, w.steps[k]) for sv, w in windows], committed[k] if k < ran - 1 else None)
                for k in range(ran)]

    def _account(self, step: int, batches: Batches, bodies: list[tuple[_Service, StepReport]],
                 committed: bool | None, loss_scale: float, replica_scale: float, start: float, end: float,
                 coordinator_s: float, traffic: dict[str, TrafficCounts] | None = None) -> StepRecord:
        """The record of ``step`` from its replies; decide its commit (``committed`` None), or check the
        stages' (True: they committed it, False: they dropped it). ``traffic``: the workers' counters the
        record shows (None: the latest, with this step's)."""
        total = sum(len(mb) for per in batches for mb in per)
        loss = 0.0
        for sv, body in bodies:
            if body.step != step:
                raise JobError(f"stage {sv.stage} (worker {sv.worker}) answered step {body.step} for step "
                               f"{step}")
            for m, value in enumerate(body.losses):
                loss += value * len(batches[sv.replica][m]) / total
        if traffic is None:
            self.traffic.update(latest_by((sv.worker, body.traffic) for sv, body in bodies))
            traffic = dict(self.traffic)
        bad = first_nonfinite(bodies)
        overflow = self.scaler is not None and overflowed(self.spec.run, step, bodies, self.scaler,
                                                          last_good=self._last_good)
        skipped = overflow or bad is not None
        parts = norm_parts(self.plan.zero_stage, self.plan.shard_factor)
        norm = global_norm(bodies, replica_scale, parts)
        if committed is not None and committed == skipped:
            raise JobError(f"step {step}: the stages {'committed' if committed else 'dropped'} it, and its "
                           f"replies say it is {'not ' if skipped else ''}finite")
        if committed:  # the stages applied it: the next request carries no commit of it
            self._last_good = (step, loss)
            self.commits += 1
            self._uncommitted = False
        else:
            self._uncommitted = committed is None and not skipped  # a dropped step is never committed
            if not skipped:
                self._last_good = (step, loss)
                # the commit unscales fp16's gradients and clips them by the global norm of the unscaled ones
                self._pending = (step, grad_scale(bodies, self.spec.clip_grad_norm, replica_scale, parts))
            elif bad is not None and not overflow:
                refuse(self.spec.run, self.spec.nonfinite, step, *bad, last_good=self._last_good)
        return StepRecord(step=step, loss=loss, num_samples=total, start=start, end=end,
                          coordinator_s=coordinator_s, skipped=skipped, loss_scale=loss_scale, grad_norm=norm,
                          replies=bodies, actions=self._actions,
                          saved=[*(part for _, body in bodies for part in body.saved), *self._shards.saved()],
                          traffic=traffic)

    def _run_async(self, step: int, batches: Batches, upcoming: Callable[[int], Batches] | None,
                   last: int) -> StepRecord:
        """:meth:`run_step` of an asynchronous plan: send each replica its steps as it finishes the last,
        within the window; return once every replica finished ``step``."""
        start, polled = time.time(), self.loop.poll_seconds
        if self._async is None:
            self._async = AsyncProgress(self.plan.data_parallel, self.plan.staleness, step)
        progress, ids = self._async, self._async_ids
        timeout_ms = int(self.spec.step_timeout.total_seconds() * 1000)

        def send(r: int, j: int) -> None:
            assert j == step or upcoming is not None, "an asynchronous plan sends ahead: give upcoming"
            mbs = (batches if j == step else upcoming(j))[r]  # type: ignore[misc]  # upcoming: checked
            rep = progress.replicas[r]
            request: dict[str, object] = {"step": j, "program": TRAIN_PROGRAM, "timeout_ms": timeout_ms,
                                          "loss_scale": 1.0, "microbatches": [list(mb) for mb in mbs]}
            if rep.uncommitted is not None:  # its own last step's push and pull
                request["commit"] = CommitStep(step=rep.commits, optimizer=self.spec.optimizer,
                                               timeout_ms=timeout_ms, train_step=rep.uncommitted
                                               ).model_dump(mode="python")
            sent = []
            for sv in self.services:
                if sv.replica == r:
                    sent.append(rid := self.loop.send(sv.worker, sv.name, "run_step", request, StepReply))
                    ids[rid] = sv
            progress.sent(r, j, sent, committing="commit" in request)

        def dispatch() -> None:
            for r, j in progress.sendable(step, last):
                send(r, j)

        def on_reply(reply: Reply) -> None:
            sv = ids.pop(reply.id)
            assert isinstance(reply.body, StepRead | StepReply)
            done = progress.answered(sv.replica, reply.id, sv, reply.body)
            if done is not None:
                bad = first_nonfinite(done)
                if bad is not None:  # runtime.nonfinite is stop (skip is refused): raises
                    refuse(self.spec.run, self.spec.nonfinite, reply.body.step, *bad,
                           last_good=self._last_good)
                dispatch()

        dispatch()
        # a replica's request may wait in its pull for the slowest, up to its own bound
        bound = (self.spec.step_timeout + timedelta(seconds=10)) * (self.plan.staleness + 1)
        self._gather(ids, f"step {step}", bound, step, on_reply=on_reply,
                     until=lambda: progress.complete(step))
        bodies = [pair for r in range(self.plan.data_parallel) for pair in progress.finished[step][r]]
        del progress.finished[step]
        total = sum(len(mb) for per in batches for mb in per)
        loss = sum(value * len(batches[sv.replica][m]) / total
                   for sv, body in bodies for m, value in enumerate(body.losses))
        self.traffic.update(latest_by((sv.worker, body.traffic) for sv, body in bodies))
        self._last_good = (step, loss)
        end_time = time.time()
        return StepRecord(step=step, loss=loss, num_samples=total, start=start, end=end_time,
                          coordinator_s=max(0.0, (end_time - start) - (self.loop.poll_seconds - polled)),
                          replies=bodies, actions=self._actions, traffic=dict(self.traffic))

    def _commit_async(self) -> None:
        """Commit each replica's last step (asynchronous plans), once none runs one."""
        progress = self._async
        if progress is None:
            return
        assert progress.idle(), "every step sent was collected"
        timeout_ms = int(self.spec.step_timeout.total_seconds() * 1000)
        ids: dict[int, _Service] = {}
        for r, rep in enumerate(progress.replicas):
            if rep.uncommitted is None:
                continue
            commit = CommitStep(step=rep.commits, optimizer=self.spec.optimizer, timeout_ms=timeout_ms,
                                train_step=rep.uncommitted)
            ids.update({self.loop.send(sv.worker, sv.name, "commit", commit, CommitReply): sv
                        for sv in self.services if sv.replica == r})
            rep.commits, rep.uncommitted = rep.commits + 1, None
        if ids:
            bound = (self.spec.step_timeout + timedelta(seconds=10)) * (self.plan.staleness + 1)
            self._gather(ids, "the replicas' last commits", bound, None)

    def evaluate(self, step: int, batches: Sequence[Sequence[Sequence[int]]]
                 ) -> tuple[list[tuple[int, StepReport]], list[SavedPart]]:
        """Run one evaluation step on the held-out samples ``batches[r][m]`` (a replica with none sits it
        out); the last stages' replies, with their replica, and the checkpoint parts the replies report
        (written since the last). Commit the last step first (:meth:`commit`).

        Raises:
            JobFailed: Naming the worker and the service.
        """
        assert not self._uncommitted, "commit the last step first: the evaluation must see its update"
        timeout_ms = int(self.spec.step_timeout.total_seconds() * 1000)
        ids: dict[int, _Service] = {}
        for sv in self.services:
            mbs = batches[sv.replica]
            if mbs:
                request = RunStep(step=step, microbatches=[list(mb) for mb in mbs], source="eval",
                                  actions=list(forward_actions(self.plan.num_stages, len(mbs))[sv.stage]),
                                  zero_grad=False, timeout_ms=timeout_ms)
                ids[self.loop.send(sv.worker, sv.name, "run_step", request, StepReply)] = sv
        replies = self._gather(ids, f"the evaluation after step {step}",
                               self.spec.step_timeout + timedelta(seconds=10), step)
        last = self.plan.num_stages - 1
        # a reply read in C carries no parts (hot.py leaves those to the models)
        saved = [part for r in replies.values() if isinstance(r.body, StepReply) for part in r.body.saved]
        return ([(ids[i].replica, r.body) for i, r in replies.items() if ids[i].stage == last],
                [*saved, *self._shards.saved()])

    def commit(self, save: SaveRequest | None = None) -> list[SavedPart]:
        """Commit the last step run, if its commit has not gone out with a later step (``save`` rides
        on it); the checkpoint parts the replies report.

        Raises:
            JobFailed: A stage could not apply the update (names the worker and the service).
        """
        if self.plan.staleness:
            assert save is None, "an asynchronous plan takes no checkpoint"
            self._commit_async()
            return []
        if not self._uncommitted:
            return []
        commit = self._commit_request(save)
        ids = {self.loop.send(sv.worker, sv.name, "commit", commit, CommitReply): sv for sv in self.services}
        self._shards.send_round(self.loop, commit, save, self.spec.step_timeout)
        bound = self.spec.step_timeout + timedelta(seconds=10)
        replies = self._gather(ids, f"the commit of update {self.commits}", bound, None)
        self.commits += 1
        self._uncommitted = False
        return [*(part for r in replies.values() if isinstance(r.body, CommitReply) for part in r.body.saved),
                *self._shards.saved()]

    def _commit_fields(self, save: SaveRequest | None) -> dict[str, object]:
        """``self._commit_request(save).model_dump(mode="python")``, built from the first one's dump: the rest
        of a run's commits differ only in their step, scale and save (the services validate each)."""
        if self._commit_dump is None:
            self._commit_dump = self._commit_request(None).model_dump(mode="python")
        train_step, scale = self._pending
        return {**self._commit_dump, "step": self.commits, "grad_scale": scale, "train_step": train_step,
                "save": None if save is None else save.model_dump(mode="python")}

    def _commit_request(self, save: SaveRequest | None) -> CommitStep:
        """The commit (number ``self.commits``) of the last step run, with ``save`` riding on it."""
        train_step, scale = self._pending
        return CommitStep(step=self.commits, optimizer=self.spec.optimizer,
                          timeout_ms=int(self.spec.step_timeout.total_seconds() * 1000), save=save,
                          grad_scale=scale, train_step=train_step)

    def flush_saves(self) -> list[SavedPart]:
        """Wait until every service (and shard) wrote the checkpoint parts it was asked for; the parts not
        reported yet.

        Raises:
            JobFailed: A service did not finish within ``spec.step_timeout`` or vanished.
        """
        ids = {self.loop.send(sv.worker, sv.name, "flush_saves", Empty(), SavedParts): sv
               for sv in self.services}
        replies = self._gather(ids, "writing the checkpoint", self.spec.step_timeout, None, saves=True)
        return [*(part for r in replies.values() if isinstance(r.body, SavedParts) for part in r.body.parts),
                *self._shards.saved()]

    def state(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters and buffers (replica 0), by the stages' names, as copies.

        Commits the last step first (:meth:`commit`).

        Raises:
            JobFailed: A stage did not answer or vanished.
        """
        self.commit()
        # ZeRO-3: each replica gathers its stage's parameters with its group, so every replica is asked
        ids = {self.loop.send(sv.worker, sv.name, "state", Empty(), TensorsReply): sv
               for sv in self.services if sv.replica == 0 or self.plan.zero_stage == 3}
        out: dict[str, torch.Tensor] = {}
        replies = self._gather(ids, "collecting the final state", self.spec.call_timeout, None)
        for rid, reply in replies.items():
            if ids[rid].replica == 0:
                out.update({k: v.clone() for k, v in reply.tensors.items()})
        if self.plan.staleness:  # the shards hold every replica's pushes; replica 0 pulled before the last
            out.update(self._shards.values(self.spec.call_timeout))
        return out

    def close(self, timeout: timedelta = timedelta(seconds=10), *, skip: str = "") -> None:
        """Release every service this runtime placed (best effort, bounded; never raises), but on ``skip``
        (a worker known lost: a frozen one would only make this wait)."""
        release()  # what this runtime leaves behind can be collected (comm/heap.py)
        self._shards.forget(self.loop)
        ids = {self.loop.send(sv.worker, "worker", "release", Release(service=sv.name), Empty): sv
               for sv in [*self.services, *self._shards.services]
               if sv.worker in self.loop.members and sv.worker != skip}
        try:
            self._gather(ids, "releasing the services", timeout, None)
        except JobFailed as exc:
            log.warning("[coordinator %s] %s", self.spec.run, exc)

    # -- waiting ------------------------------------------------------------------------

    def _gather(self, ids: dict[int, _Service], what: str, timeout: timedelta,
                step: int | None, *, saves: bool = False, on_reply: Callable[[Reply], None] | None = None,
                until: Callable[[], bool] | None = None) -> dict[int, Reply]:
        """The replies to ``ids`` (and, with ``saves``, every shard save's answer), bounded by ``timeout``.

        A shard save's answer is kept whenever it comes (:meth:`ParamShards.take`), never a failure.
        With ``until`` (asynchronous plans), gather until it holds instead, handing each reply to
        ``on_reply`` (which may add requests to ``ids``); the requests still unanswered then are kept.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        replies: dict[int, Reply] = {}
        saving = self._shards.saving if saves else {}
        rounds = self._shards.rounds  # a held round's norm and apply requests (clipping; shards.py)
        done = until if until is not None else (lambda: len(replies) >= len(ids))
        completed = False
        try:
            while not done() or saving or rounds:
                event = self.loop.next_event(timedelta(seconds=max(0.0, deadline - time.monotonic())))
                if event is None:
                    missing = [*(ids[i] for i in ids if i not in replies), *(sv for sv, _ in saving.values()),
                               *rounds.values()]
                    sv = missing[0]
                    raise JobFailed(f"{what}: no reply within {timeout.total_seconds():.0f}s from "
                                    + _some([f"worker {m.worker} (service {m.name})" for m in missing]),
                                    worker=sv.worker, service=sv.name, step=step)
                if isinstance(event, Reply) and self._shards.take(event, self.loop):
                    if self._shards.refused is not None:
                        sv = next(s for s in self._shards.services if s.name == event.service)
                        raise self._failure(self._shards.refused, sv, what, step)
                    continue
                # a card gone, or put by another process under the name (a container restarted in place
                # before its predecessor's lease lapsed): the process this runtime placed is gone
                if isinstance(event, WorkerLost | WorkerJoined) and event.name in self._placed and self._gone(
                        event.name):
                    raise self._lost(event.name, what, step)
                if isinstance(event, Reply) and event.id in ids:
                    if not event.ok:
                        raise self._failure(event, ids[event.id], what, step)
                    replies[event.id] = event
                    if on_reply is not None:
                        on_reply(event)
            completed = True
        finally:
            if until is None or not completed:
                for i in list(ids):
                    if i not in replies:
                        self.loop.forget(i)
        return replies

    def _hosted(self, worker: str) -> list[str]:
        return [sv.name for sv in [*self.services, *self._shards.services] if sv.worker == worker]

    def placed_incarnation(self, worker: str) -> str | None:
        """The incarnation of the process this runtime placed services on as ``worker``."""
        return self._incarnations.get(worker)

    def _card(self, worker: str) -> WorkerCard | None:
        """The card of the process registered as ``worker`` now (None: none is)."""
        kv = self.loop.registry.get(f"{self.loop.prefix}{worker}")
        return unpack(kv.value, WorkerCard) if kv is not None else None

    def _incarnation(self, worker: str) -> str | None:
        """The incarnation of the process registered as ``worker`` now (None: no card)."""
        card = self._card(worker)
        return card.incarnation if card is not None else None

    def _gone(self, worker: str) -> bool:
        """Whether the process this runtime placed on ``worker`` is gone (its card vanished or another
        process registered under its name since): a loss event about an earlier process is not."""
        now = self._incarnation(worker)
        return now is None or now != self._incarnations.get(worker)

    def _lost(self, worker: str, what: str, step: int | None, *, probed: bool = False) -> JobFailed:
        hosted = self._hosted(worker)
        if not probed and self._span is not None and self._span[1] > 1:  # which step of the window: ask
            self._unresponsive(gone={worker})  # the survivors; the lost one would only run out the clock
        return JobFailed(f"worker {worker} (hosting {', '.join(hosted)}) lost its registry lease during "
                         f"{what}: its process died, stopped or was restarted", worker=worker,
                         service=hosted[0] if hosted else "", step=self._failed_step(step), lost=True)

    def _failed_step(self, step: int | None) -> int | None:
        """The step a failure during the request in flight happened in: with a window of several steps, the
        first one a service of it has not finished by the last status probe (its first step if none
        answered), else ``step``."""
        span = self._span
        if span is None or span[1] == 1 or step != span[0]:
            return step
        finished = [self._finished[sv.name] for sv in self.services if sv.name in self._finished]
        first, count = span
        return min(max(min(finished, default=first - 1) + 1, first), first + count - 1)

    def _failure(self, reply: Reply, sv: _Service, what: str, step: int | None) -> JobFailed:
        replaced = [w for w in self.workers if self._gone(w)]
        if replaced:  # a step failing because a peer's process is gone (a restarted one answers probes)
            return self._lost(replaced[0], what, step)
        detail = f"worker {sv.worker}, service {sv.name}: [{reply.code}] {reply.message}"
        silent = self._unresponsive()
        step = self._failed_step(step)
        if silent:
            hosted = self._hosted(silent[0])
            return JobFailed(f"{what} failed: worker {silent[0]} (hosting {', '.join(hosted)}) does not "
                             f"answer; its process died or froze. Then {detail}", worker=silent[0],
                             service=hosted[0] if hosted else "", step=step, lost=True)
        return JobFailed(f"{what} failed: {detail}", worker=sv.worker, service=sv.name, step=step)

    def _unresponsive(self, gone: Collection[str] = ()) -> list[str]:
        """The placed workers that do not answer ``worker.status`` within :data:`PROBE_TIMEOUT`, not asking
        those known ``gone`` and no longer waiting for one whose card vanishes meanwhile (both count as
        unresponsive)."""
        ids = {self.loop.send(w, "worker", "status", Empty(), WorkerStatus): w
               for w in self.workers if w not in gone}
        answered: set[str] = set()
        vanished: set[str] = set()
        deadline = time.monotonic() + PROBE_TIMEOUT.total_seconds()
        while len(answered) + len(vanished) < len(ids):
            event = self.loop.next_event(timedelta(seconds=max(0.0, deadline - time.monotonic())))
            if event is None:
                break
            if isinstance(event, WorkerLost) and event.name in ids.values() and self._gone(event.name):
                vanished.add(event.name)
            if isinstance(event, Reply) and event.id in ids:
                answered.add(ids[event.id])
                if isinstance(event.body, WorkerStatus):
                    self._finished.update(event.body.finished)
        for i in ids:
            self.loop.forget(i)
        return [w for w in self.workers if w not in answered]

