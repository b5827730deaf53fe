"""Hollow workers: the real worker host, many to a process, whose compute does no tensor work.

For measuring the coordinator against hundreds of workers on one machine, as Kubernetes' kubemark
measures its control plane with hollow nodes. A hollow worker is a real
:class:`~services.host.worker.Worker`: its own :class:`~comm.rpc.host.ServiceHost` (socket, thread,
CURVE keys and the job's ZAP handler), its own registry connection, card and lease kept by the real
keepalive, the real ``worker`` control service. Only what an assignment of kind ``compute`` builds
differs (:data:`HOLLOW_BUILDERS`, handed to the worker: the worker's code is not copied):
:class:`HollowCompute` answers every RPC of the compute service with the real reply types.

[Note: what a hollow stage does and does not do]
* ``load_program`` validates the action list with the real rules
  (``services.compute.actions.validate_stage``) and holds it; ``run_step`` resolves it as the real
  stage does (an unknown program or a wrong microbatch count is a ``bad_request``).
* A step runs on the stage's own step thread, walking its action list: ``F``/``B``/``I``/``W`` sleep
  ``action_seconds`` (``B`` twice as long; 0 by default: the coordinator's own cost is what is
  measured), each stretched by up to ``action_jitter`` of itself at random (stragglers: the replies
  of a step then come one by one, as real workers' do, not all at once), and the pipeline
  transfers are real: ``SEND_F``/``SEND_B`` post an ``isend`` of a cached zero tensor of the
  boundary's shape and dtype on the stage's real pipeline communicator
  (:class:`~services.link.PipelineLink`, joined through the registry as the real stage joins), and
  ``RECV_F``/``RECV_B`` wait for the peer's, with the same tags. They go through the sockets, never
  shared memory (``CELLMESH_SHM=0``): every stage of a fleet is on one host, and each same-host pair
  of a communicator would map an inbox of its own in ``/dev/shm`` (tens of MiB each) for tensors of a
  few hundred bytes. So a pipeline's stages wait on each
  other as real ones do, and the registry sees the communicators' rendezvous keys.
* The gradient sync among replicas is skipped: the coordinator takes no part in it, and 512
  replicas' all-reduce rings in one Python process on a shared machine would measure that process,
  not the coordinator. The data-parallel groups' rendezvous keys are therefore missing from the
  registry counts (one key per replica and placement, not per step).
* A window of steps (``RunStep.window``) runs as the real stage runs it: after each step the stages
  agree on its commit over the pipeline communicator (``services/compute/window.py``), and the reply
  is the real :class:`~services.protocol.WindowReply`.
* The reply is the real :class:`~services.protocol.StepReply`: one timing per action, a loss per
  microbatch on the last stage (:data:`HOLLOW_LOSS`), a gradient norm when the step trains, the
  process's traffic counters, the stage's held bytes.
* ``parameters``, ``gradients`` and ``state`` send zeros of the stage's real names, shapes and
  dtypes, from a stage built once per (factory, arguments, nodes) and shared by every hollow
  stage of the process (:class:`StageShapes`); ``commit`` and ``optimizer_step`` count updates.
  Checkpoints are not written (``commit.save`` is refused): a hollow job takes none.

The fleet (:func:`main`, ``python -m services.host.hollow``) runs ``--workers N`` hollow workers
in one process, named ``{prefix}{first}`` on, with the keys of ``--keys-dir`` installed once for all.
It reads commands on stdin, one a line, for fault injection: ``crash NAME`` stops a worker as a
``kill -9`` would (its host closes, its lease is no longer renewed and lapses; its card is not
deleted); ``drain NAME`` drains it cleanly. It prints ``up N`` once every card is published and
``crashed NAME T`` (``time.time()``) after a crash. SIGTERM drains every worker.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import zmq
from pydantic import BaseModel, ValidationError

from comm import auth, traffic
from comm.base import Communicator, Work
from comm.codec import describe_validation_error
from comm.heap import settle_imports
from comm.logs import configure_logging
from comm.registry import connect_registry, follows_presence
from comm.registry.base import Registry
from comm.rpc import Call, RpcError, ServiceBase
from comm.sockets import shared_context
from services.compute.actions import validate_stage
from services.compute.boundary import empty_buffers, transfer_tag
from services.compute.stage import build_stage
from services.compute.window import agree
from services.factories import FactoryAllowList
from services.host.worker import SERVICE_BUILDERS, ServiceBuilder, Worker, allowed_factories
from services.link import PipelineLink
from services.protocol import (
    MAX_PROGRAMS,
    Action,
    Assignment,
    BoundarySpec,
    CommitReply,
    CommitStep,
    ComputeOptions,
    Empty,
    LoadProgram,
    OptimizerStepReply,
    OptimizerStepRequest,
    Reconnect,
    RunStep,
    SavedParts,
    StepReply,
    TensorsReply,
    TrafficReports,
    WindowReply,
    ZeroGradRequest,
    pack_times,
)

__all__ = ["HOLLOW_BUILDERS", "HOLLOW_LOSS", "HollowCompute", "StageShapes", "main"]

log = logging.getLogger(__name__)

HOLLOW_LOSS = 1.0  # every microbatch's loss, as the last stage reports it
_REPLY_GRACE = timedelta(seconds=5)  # as the real stage: `timeout` is answered this long after a deadline
SHM_ENV = "CELLMESH_SHM"  # "0": the fleet's communicators send through their sockets (comm/zmq/shm.py)
MAX_SOCKETS = 1 << 16  # the fleet's ZeroMQ context: a worker's host, registry and links take a few each
_COMPUTE = frozenset({"F", "B", "I", "W"})


class StageShapes:
    """The named tensors of each distinct stage, built once per process (every hollow stage of a
    (factory, arguments, nodes) shares them: read-only zeros, sent as copies by the host)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[str, tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]] = {}

    def of(self, assignment: Assignment, options: ComputeOptions, factories: FactoryAllowList
           ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """The stage's parameters and its whole state (parameters and buffers), as zeros.

        Raises:
            ValueError: As :func:`~services.compute.stage.build_stage` (a factory, the node range).
        """
        key = "|".join([assignment.factory, str(assignment.nodes), options.model_dump_json(
            include={"factory_kwargs", "data", "data_kwargs", "loss", "leaves", "precision"})])
        with self._lock:
            found = self._built.get(key)
            if found is None:
                stage = build_stage(assignment, options.model_copy(update={"device": "cpu"}), factories)
                params = [(n, torch.zeros_like(p, device="cpu")) for n, p in stage.parameters()]
                state = [(n, torch.zeros_like(t, device="cpu")) for n, t in stage.state()]
                found = self._built[key] = (params, state)
        return found


SHAPES = StageShapes()


class HollowCompute(ServiceBase):
    """A compute service that does no tensor work (see [Note: what a hollow stage does and does not do]).

    Args:
        options: The stage's plan fields, as the real stage takes them.
        params: Its parameters' names and shapes (zeros); ``state``: with its buffers.
        action_seconds: How long a forward takes (a backward twice, ``I``/``W`` once each).
        action_jitter: Each compute action lasts up to this fraction longer, at random.
    """

    def __init__(self, options: ComputeOptions, params: list[tuple[str, torch.Tensor]],
                 state: list[tuple[str, torch.Tensor]], action_seconds: float = 0.0,
                 action_jitter: float = 0.0) -> None:
        self._options = options
        self._index, self._stages = options.stage, options.num_stages
        self._params, self._state = params, state
        self._held_bytes = sum(t.numel() * t.element_size() for _, t in params)
        self._traffic = TrafficReports()  # as the real stage: the counters ride on a reply when they changed
        self._seconds = action_seconds
        self._jitter = action_jitter
        self._programs: dict[str, LoadProgram] = {}
        self._lock = threading.Lock()
        self._busy: str | None = None
        self._closed = False
        self._updates = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hollow-stage{self._index}")
        self._link = PipelineLink(backend="zmq", rank=self._index, world_size=self._stages,
                                  registry_url=options.registry, prefix=options.comm_prefix,
                                  timeout=timedelta(milliseconds=options.comm_timeout_ms))
        self._sent: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}  # cached zeros per boundary

    @classmethod
    def from_assignment(cls, assignment: Assignment, factories: FactoryAllowList,
                        action_seconds: float = 0.0, action_jitter: float = 0.0) -> HollowCompute:
        """Check the options and the factories as the real stage does; the stage's shapes from the cache.

        Raises:
            RpcError: ``bad_request`` naming the bad option or factory.
        """
        try:
            options = ComputeOptions.model_validate(assignment.options)
        except ValidationError as exc:
            raise RpcError("bad_request", f"compute options: {describe_validation_error(exc)}") from None
        if options.restore:
            raise RpcError("bad_request", f"stage {options.stage}: a hollow worker restores no checkpoint")
        try:
            params, state = SHAPES.of(assignment, options, factories)
            return cls(options, params, state, action_seconds, action_jitter)
        except ValueError as exc:
            raise RpcError("bad_request", f"stage {options.stage}: {exc}") from None

    # -- one thing at a time, as the real stage -------------------------------------------

    def _check_idle(self, what: str) -> None:
        if self._closed:
            raise RpcError("closed", f"stage {self._index} is shutting down")
        if self._busy is not None:
            raise RpcError("busy", f"stage {self._index} cannot {what} while it runs {self._busy}")

    def _submit(self, call: Call, what: str, timeout: timedelta, work: Callable[[], BaseModel]) -> None:
        with self._lock:
            self._check_idle(what)
            self._busy = what
        call.defer(timeout + _REPLY_GRACE,
                   lambda: ("timeout", f"stage {self._index}: {what} did not finish within "
                                       f"{timeout.total_seconds():.1f}s"))

        def run() -> None:
            reply: BaseModel | None = None
            error: tuple[str, str] | None = None
            try:
                reply = work()
            except RpcError as exc:
                error = (exc.code, exc.message)
            except Exception as exc:
                error = ("step_failed", f"stage {self._index}: {what}: {type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._busy = None
            if error is not None:
                call.fail(*error)
            elif reply is not None:
                call.reply(reply)

        self._pool.submit(contextvars.copy_context().run, run)

    # -- RPCs -----------------------------------------------------------------------------

    def rpc_load_program(self, request: LoadProgram, call: Call) -> Empty:
        try:
            validate_stage(request.actions, stage=self._index, num_stages=self._stages,
                           num_microbatches=request.num_microbatches)
        except ValueError as exc:
            raise RpcError("bad_request", f"stage {self._index}, program {request.program}: {exc}") from None
        self._programs.pop(request.program, None)
        if len(self._programs) >= MAX_PROGRAMS:
            raise RpcError("bad_request", f"stage {self._index} holds {MAX_PROGRAMS} programs already")
        self._programs[request.program] = request
        return Empty()

    def _resolve(self, request: RunStep) -> tuple[list[Action], bool]:
        if request.program is None:
            actions = request.actions
            trains = validate_stage(actions, stage=self._index, num_stages=self._stages,
                                    num_microbatches=len(request.microbatches))
            return actions, trains
        held = self._programs.get(request.program)
        if held is None:
            raise ValueError(f"stage {self._index} holds no program {request.program!r}: send it with "
                             "load_program first")
        if len(request.microbatches) != held.num_microbatches:
            raise ValueError(f"program {request.program!r} runs {held.num_microbatches} microbatches, the "
                             f"step brings {len(request.microbatches)}")
        return held.actions, any(a.kind in ("B", "I") for a in held.actions)

    def rpc_run_step(self, request: RunStep, call: Call) -> None:
        with self._lock:
            self._check_idle(f"step {request.step}")
        if request.commit is not None and request.commit.save is not None:
            raise RpcError("bad_request", f"stage {self._index}: a hollow stage writes no checkpoint")
        try:
            actions, trains = self._resolve(request)
        except ValueError as exc:
            raise RpcError("bad_request", f"step {request.step}: {exc}") from None
        timeout = timedelta(milliseconds=request.timeout_ms)

        window = request.window
        if window is not None and not trains:
            raise RpcError("bad_request", f"step {request.step}: a window of steps takes a training list")

        def one(step: int, microbatches: list[list[int]], committed: bool, counters: bool = True
                ) -> StepReply:
            deadline = time.monotonic() + timeout.total_seconds()
            if committed:
                self._updates += 1
            comm = self._link.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
            starts, ends = self._walk(actions, microbatches, comm, deadline)
            if request.source != "eval":
                self.finished_step = step
            last = self._index == self._stages - 1
            return StepReply(step=step, stage=self._index,
                             losses=[HOLLOW_LOSS] * len(microbatches) if last else [],
                             times=pack_times(starts, ends),
                             traffic=(self._traffic.report(traffic.snapshot(),
                                                           training=request.source != "eval")
                                      if counters else None),
                             grad_sq_norm=1.0 if trains and self._options.grad_path == "collective" else None,
                             held_bytes=self._held_bytes)

        def run() -> BaseModel:
            reply = one(request.step, request.microbatches, request.commit is not None, window is None)
            if window is None:
                return reply
            replies, committed = [reply], []
            # the stages' verdicts, as real ones agree (the replicas' part skipped, as their gradient sync)
            for k, microbatches in enumerate(window.microbatches):
                comm = self._link.wait(timeout)
                with self._lock:
                    closing = self._closed
                verdict = agree(comm, self._index, self._stages, reply, window.clip_grad_norm,
                                window.nonfinite, "cpu", timeout, closing=closing)
                if verdict.action == "stop":
                    break
                committed.append(verdict.action == "commit")
                reply = one(request.step + k + 1, microbatches, verdict.action == "commit", False)
                replies.append(reply)
            replies[-1] = replies[-1].model_copy(update={"traffic": self._traffic.report(traffic.snapshot())})
            return WindowReply(steps=replies, committed=committed)

        steps = 1 + (len(window.microbatches) if window is not None else 0)
        self._submit(call, f"step {request.step}", timeout * steps, run)

    def _walk(self, actions: Sequence[Action], microbatches: list[list[int]], comm: Communicator | None,
              deadline: float) -> tuple[list[float], list[float]]:
        """Run the list: sleep for compute, real transfers of cached tensors; each action's timing."""
        starts: list[float] = []
        ends: list[float] = []
        sends: list[Work] = []
        for action in actions:
            start = time.time()
            if action.kind in _COMPUTE:
                seconds = self._seconds * (2 if action.kind == "B" else 1)
                seconds *= 1 + self._jitter * random.random()
                if seconds > 0:
                    time.sleep(seconds)
            else:
                assert comm is not None and action.peer is not None, "a transfer needs the pipeline"
                left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
                tensors = self._boundary(action.kind, len(microbatches[action.microbatch]))
                tags = [(i, transfer_tag(action.microbatch, i)) for i, _ in tensors]
                if action.kind.startswith("SEND"):
                    sends += [comm.isend(t, action.peer, tag=tag) for (_, t), (_, tag) in zip(tensors, tags,
                                                                                             strict=True)]
                else:
                    for (_, t), (_, tag) in zip(tensors, tags, strict=True):
                        comm.irecv(t, action.peer, tag=tag).wait(left)
            starts.append(start)
            ends.append(time.time())
        for work in sends:
            work.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return starts, ends

    def _boundary(self, kind: str, samples: int) -> list[tuple[int, torch.Tensor]]:
        """The cached tensors a transfer of ``kind`` moves for a microbatch of ``samples`` samples."""
        found = self._sent.get((kind, samples))
        if found is None:
            spec: BoundarySpec | None = (self._options.incoming if kind in ("RECV_F", "SEND_B")
                                         else self._options.outgoing)
            assert spec is not None, f"stage {self._index} has no boundary for {kind}"
            grads = kind in ("SEND_B", "RECV_B")
            found = [(i, t.zero_()) for i, t in empty_buffers(spec, samples, grad_only=grads)]
            self._sent[(kind, samples)] = found
        return found

    def rpc_commit(self, request: CommitStep, call: Call) -> CommitReply:
        with self._lock:
            self._check_idle(f"commit step {request.step}")
        if request.save is not None:
            raise RpcError("bad_request", f"stage {self._index}: a hollow stage writes no checkpoint")
        self._updates += 1
        return CommitReply(step=request.step, optimizer_steps=self._updates, phases=[])

    def rpc_optimizer_step(self, request: OptimizerStepRequest, call: Call) -> OptimizerStepReply:
        with self._lock:
            self._check_idle("apply an optimizer step")
        self._updates += 1
        return OptimizerStepReply(steps=self._updates)

    def rpc_zero_grad(self, request: ZeroGradRequest, call: Call) -> Empty:
        with self._lock:
            self._check_idle("zero its gradients")
        return Empty()

    def _tensors(self, call: Call, named: list[tuple[str, torch.Tensor]], what: str) -> TensorsReply:
        with self._lock:
            self._check_idle(what)
        call.tensors_out = list(named)  # read-only zeros shared by the process: never written
        return TensorsReply(names=[n for n, _ in named])

    def rpc_parameters(self, request: Empty, call: Call) -> TensorsReply:
        return self._tensors(call, self._params, "send its parameters")

    def rpc_gradients(self, request: Empty, call: Call) -> TensorsReply:
        return self._tensors(call, self._params, "send its gradients")

    def rpc_state(self, request: Empty, call: Call) -> TensorsReply:
        return self._tensors(call, self._state, "send its state")

    def rpc_flush_saves(self, request: Empty, call: Call) -> SavedParts:
        return SavedParts(parts=[])

    def rpc_reconnect(self, request: Reconnect, call: Call) -> Empty:
        with self._lock:
            self._check_idle("reconnect")
        self._link.connect(request.comm_prefix)
        return Empty()

    def on_close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        threading.Thread(target=self._link.close, daemon=True, name=f"close-hollow{self._index}").start()


def hollow_builders(action_seconds: float = 0.0, action_jitter: float = 0.0) -> dict[str, ServiceBuilder]:
    """The worker's builders with a hollow ``compute`` (barriers and parameter servers stay real)."""

    def build(assignment: Assignment, factories: FactoryAllowList) -> ServiceBase:
        return HollowCompute.from_assignment(assignment, factories, action_seconds, action_jitter)

    return {**SERVICE_BUILDERS, "compute": build}


HOLLOW_BUILDERS = hollow_builders()


# -- the fleet: many hollow workers in one process ----------------------------------------------


class Fleet:
    """``count`` hollow workers named ``{prefix}{first + i}``, each with its own registry connection."""

    def __init__(self, url: str, job: str, count: int, *, prefix: str = "local-", first: int = 0,
                 lease_ttl: timedelta = timedelta(seconds=5), factories: FactoryAllowList | None = None,
                 action_seconds: float = 0.0, action_jitter: float = 0.0) -> None:
        self.url = url
        self.registries: list[Registry] = []
        self.workers: dict[str, Worker] = {}
        builders = hollow_builders(action_seconds, action_jitter)
        presence = follows_presence(url)
        for i in range(first, first + count):
            registry = connect_registry(url, request_timeout=min(timedelta(seconds=10), lease_ttl))
            self.registries.append(registry)
            name = f"{prefix}{i}"
            self.workers[name] = Worker(registry, job, name, lease_ttl=lease_ttl, host="127.0.0.1",
                                        factories=factories, follows_presence=presence, builders=builders)

    def start(self) -> Fleet:
        for worker in self.workers.values():
            worker.start()
        return self

    def crash(self, name: str) -> None:
        """Stop ``name`` as a killed process stops: its host closes, its lease lapses, its card stays."""
        worker = self.workers[name]
        if worker._keepalive is not None:
            worker._keepalive.stop(revoke=False)
        if worker._coordinator is not None:
            worker._coordinator.close()
        worker.stopped.set()
        worker.host.shutdown(timedelta(seconds=2))

    def drain(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Drain every worker at once (bounded), then close the registry connections."""
        threads = [threading.Thread(target=w.drain, args=(timeout,), daemon=True)
                   for w in self.workers.values()]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout.total_seconds() + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for registry in self.registries:
            registry.close()


def _commands(fleet: Fleet, stop: threading.Event) -> None:
    for line in sys.stdin:
        words = line.split()
        if len(words) == 2 and words[0] == "crash" and words[1] in fleet.workers:
            fleet.crash(words[1])
            print(f"crashed {words[1]} {time.time():.6f}", flush=True)
        elif len(words) == 2 and words[0] == "drain" and words[1] in fleet.workers:
            fleet.workers[words[1]].drain()
            print(f"drained {words[1]}", flush=True)
        else:
            print(f"unknown command {line.strip()!r}: crash NAME or drain NAME", flush=True)
    stop.set()  # stdin closed: the parent is gone


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.host.hollow",
                                     description="run many hollow cellmesh workers in one process")
    parser.add_argument("--registry", required=True, help="tcp://host:port or etcd://host:port")
    parser.add_argument("--job", required=True)
    parser.add_argument("--workers", type=int, required=True, help="how many hollow workers")
    parser.add_argument("--prefix", default="local-", help="names are PREFIX0, PREFIX1, ...")
    parser.add_argument("--first", type=int, default=0, help="the first name's number")
    parser.add_argument("--lease-ttl", type=float, default=5.0)
    parser.add_argument("--action-ms", type=float, default=0.0, help="milliseconds a forward takes")
    parser.add_argument("--action-jitter", type=float, default=0.0,
                        help="each compute action lasts up to this fraction longer, at random")
    parser.add_argument("--factory", action="append", default=[], metavar="MODULE:FUNCTION")
    parser.add_argument("--keys-dir", default=None)
    parser.add_argument("--insecure", action="store_true")
    args = parser.parse_args(argv)
    os.environ[SHM_ENV] = "0"  # before any communicator: see [Note: what a hollow stage does and does not do]
    configure_logging()
    # a process of many hosts: libzmq's default of 1,023 sockets per context holds about 250 of them
    shared_context().set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    auth.install(auth.credentials_for("worker", args.keys_dir, insecure=args.insecure))
    torch.set_num_threads(1)
    settle_imports()  # the leases' refresh threads never wait out a full scan of the imports
    fleet = Fleet(args.registry, args.job, args.workers, prefix=args.prefix, first=args.first,
                  lease_ttl=timedelta(seconds=args.lease_ttl),
                  factories=allowed_factories(None, args.factory),
                  action_seconds=args.action_ms / 1000, action_jitter=args.action_jitter)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        fleet.start()
        print(f"up {len(fleet.workers)}", flush=True)
        threading.Thread(target=_commands, args=(fleet, stop), daemon=True, name="hollow-commands").start()
        while not stop.wait(0.5):
            pass
    finally:
        fleet.drain()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
