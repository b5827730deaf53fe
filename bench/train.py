"""Training throughput of cellmesh's plans against torch's own, side by side on one machine.

The baseline model (``bench.models:mlp``: 8 x Linear(1024, 1024) + GELU,
8.4 M parameters), global batch 64, float32, SGD, one torch thread per process, every
configuration on the same initial parameters and the same global batches:

* one process: plain torch (the base) and cellmesh with one worker; and, as the ceiling of
  any two-process plan on this machine, two torch processes each training that way at
  once without communicating (their joint samples/s);
* data parallel 2: torch ``DistributedDataParallel`` (gloo) and cellmesh (``zmq``);
* pipelines of 2 and of 4 stages x 8 microbatches (the 8 blocks split evenly), each
  cellmesh schedule next to torch's same schedule (``torch.distributed.pipelining``,
  ``PipelineStage`` built by splitting the model by hand, static shapes, gloo), one process
  per rank: GPipe (``ScheduleGPipe``), 1F1B (``Schedule1F1B``), zero bubble (cellmesh's
  ``zb-h1`` against ``ScheduleInterleavedZeroBubble`` with one stage per rank, torch's ZB-H1);
  on 2 ranks holding 2 stages each (4 stages of 2 blocks), interleaved 1F1B (cellmesh's
  :data:`INTERLEAVED` against ``ScheduleInterleaved1F1B``), and torch's
  ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` (2 stages per rank, the V) on
  their own. torch's multi-stage schedules need ``8 % max(1, 8 // ranks) == 0`` microbatches
  (met for 2 and 4 ranks); ZBV needs exactly 2 stages per rank;
* cellmesh 1F1B 2 x 8 on a model with uneven layers (``bench.models:uneven``): the cut
  the planner's cutter chooses against the even split by cells.

A cellmesh configuration whose plan cannot be made or run yet (a schedule not registered, or
not executed by the workers) is reported as not run, with the reason, and dropped from the
later rounds; the rest of the run goes on.

torch's configurations run in persistent spawned ranks (one gloo process group of 2 and one
of 4), cellmesh's on one ``LocalHarness`` of as many workers as the largest plan needs (each
job attaches, places its services, trains, releases them); their plans are fixed up front
from one profile per model. Each configuration warms up, then times ``--steps`` steps (a
step: the global batch, forward, backward, gradient sync, optimizer). Every round runs every
configuration once, each next to its peer, pairs rotated and swapped round by round, so CPU
steal hits them alike. The tables show the median over rounds and the spread (min-max); a
ratio is taken within each round. The loss after the last step is printed for every
configuration: exact modes end at the same value. For cellmesh they also show the
coordinator's own time per step (``StepRecord.coordinator_s``, and its CPU time), the
simulator's prediction (``Plan.step_time_s``) against the measured step, the measured bubble
of every step against the GPipe formula and the simulator's, and where a step's time goes
(from the step's event log).

    python bench/train.py [--steps 10] [--warmup 3] [--rounds 3] [--quick] [--only ddp,cm-dp2]
    python bench/train.py --save DIR     # also keep the profiles, each round's fresh profile, the steps
                                         # and every step's event log (JSON) in DIR
    python bench/train.py --replay DIR   # this tree's cost model against a run saved with --save DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from torch import nn

from bench.rounds import parse_rounds, round_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
GLOBAL_BATCH = 64
MICROBATCHES = 8
SEED = 0
LR = 0.01
MODEL, UNEVEN, DATA = "bench.models:mlp", "bench.models:uneven", "bench.models:regression"
# cellmesh's interleaved 1F1B, by the name it is registered under (coordinator/planning/schedules.py)
INTERLEAVED = "interleaved-1f1b"
PIPELINE_TARGET = 1.25  # the least samples/s ratio of a cellmesh pipeline schedule to torch's same one
LOSS = "torch.nn:MSELoss"


# -- torch's configurations, in two persistent ranks -----------------------------------------


def _torch_setup(model_path: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """The model, the samples and the sampler exactly as a cellmesh job with this model builds them."""
    from bench.models import regression
    from coordinator.planning.data import BatchSampler
    from coordinator.runtime.factories import build_model, seeded, unwrapped

    model = unwrapped(build_model(model_path, {}, SEED))
    x, y = seeded(SEED, regression)
    return model, x, y, BatchSampler(x.shape[0], GLOBAL_BATCH, shuffle=True, seed=SEED)


def _timed(step: Callable[[int], float], steps: int, warmup: int,
           barrier: Callable[[], None]) -> dict[str, Any]:
    for k in range(warmup):
        step(k)
    barrier()
    start = time.perf_counter()
    loss = 0.0
    for k in range(warmup, warmup + steps):
        loss = step(k)
    barrier()
    return {"step_s": (time.perf_counter() - start) / steps, "loss": loss}


def _single(rank: int, steps: int, warmup: int, barrier: Callable[[], None] = lambda: None) -> dict[str, Any]:
    model, x, y, sampler = _torch_setup(MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.MSELoss()

    def step(k: int) -> float:
        idx = torch.tensor(sampler.indices(k))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        return float(loss.item())

    return _timed(step, steps, warmup, barrier)


def _pair(rank: int, steps: int, warmup: int) -> dict[str, Any]:
    """Both ranks train the one-process configuration at once, without communicating.

    No two-process plan can beat this: the machine's throughput for two busy processes.
    ``step_s`` is per global batch over both (half a rank's step).
    """
    import torch.distributed as dist

    out = _single(rank, steps, warmup, dist.barrier)
    out["step_s"] /= WORLD
    return out


def _ddp(rank: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, x, y, sampler = _torch_setup(MODEL)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    share = GLOBAL_BATCH // WORLD

    def step(k: int) -> float:
        idx = torch.tensor(sampler.indices(k)[rank * share:(rank + 1) * share])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        return float(loss.item())

    out = _timed(step, steps, warmup, dist.barrier)
    loss = torch.tensor([out["loss"] / WORLD])
    dist.all_reduce(loss)  # the mean over the global batch, as cellmesh reports it
    out["loss"] = float(loss)
    return out


@dataclass(frozen=True)
class TorchPipe:
    """A ``torch.distributed.pipelining`` configuration: its schedule class and how stages sit on ranks.

    ``per_rank`` stages per rank (the model's 8 blocks split evenly over ``ranks * per_rank``
    stages); ``style`` places them as torch's schedules expect: ``loop`` gives rank ``r`` the
    stages ``r, r + R, ...`` (interleaved), ``v`` gives it ``r`` and ``2R - 1 - r`` (ZBV).
    """

    schedule: str  # a class of torch.distributed.pipelining
    per_rank: int = 1
    style: str = "loop"

    def stage_ids(self, rank: int, ranks: int) -> list[int]:
        if self.style == "v":
            return [rank, 2 * ranks - 1 - rank]
        return [rank + k * ranks for k in range(self.per_rank)]


def _pipelining(rank: int, ranks: int, steps: int, warmup: int, spec: TorchPipe) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    model, x, y, sampler = _torch_setup(MODEL)
    blocks = list(model.children())
    num_stages = ranks * spec.per_rank
    per = len(blocks) // num_stages
    ids = spec.stage_ids(rank, ranks)
    modules = [nn.Sequential(*blocks[i * per:(i + 1) * per]) for i in ids]
    mb = GLOBAL_BATCH // MICROBATCHES
    width = x.shape[1]
    # Static shapes up front (inferring them goes through object collectives, which need numpy).
    # requires_grad on the examples says which tensors carry gradients across the cut.
    stages = [PipelineStage(m, i, num_stages, torch.device("cpu"),
                            input_args=torch.empty(mb, width, requires_grad=i > 0),
                            output_args=torch.empty(mb, width, requires_grad=True))
              for m, i in zip(modules, ids, strict=True)]
    cls = getattr(pipelining, spec.schedule)
    sched = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], MICROBATCHES,
                loss_fn=nn.MSELoss())
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    first, last = 0 in ids, num_stages - 1 in ids

    def step(k: int) -> float:
        idx = torch.tensor(sampler.indices(k))
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x[idx],) if first else ()
        kwargs: dict[str, Any] = {"target": y[idx], "losses": losses} if last else {}
        sched.step(*args, **kwargs)
        opt.step()
        return float(torch.stack(losses).detach().mean()) if last else 0.0

    out = _timed(step, steps, warmup, dist.barrier)
    loss = torch.tensor([out["loss"]])
    dist.all_reduce(loss)  # only the rank holding the last stage adds its loss
    out["loss"] = float(loss)
    return out


# key -> (ranks, what); the pipelines split the model evenly over their stages
TORCH_PIPES: dict[str, tuple[int, TorchPipe]] = {
    "gpipe": (2, TorchPipe("ScheduleGPipe")),
    "1f1b": (2, TorchPipe("Schedule1F1B")),
    "zb": (2, TorchPipe("ScheduleInterleavedZeroBubble")),
    "interleaved": (2, TorchPipe("ScheduleInterleaved1F1B", 2)),
    "zb-interleaved": (2, TorchPipe("ScheduleInterleavedZeroBubble", 2)),
    "zbv": (2, TorchPipe("ScheduleZBVZeroBubble", 2, "v")),
    "gpipe-4": (4, TorchPipe("ScheduleGPipe")),
    "1f1b-4": (4, TorchPipe("Schedule1F1B")),
    "zb-4": (4, TorchPipe("ScheduleInterleavedZeroBubble")),
}
_TORCH_RUNNERS: dict[str, Callable[[int, int, int, int], dict[str, Any]]] = {
    "single": lambda r, n, s, w: _single(r, s, w),
    "pair": lambda r, n, s, w: _pair(r, s, w),
    "ddp": lambda r, n, s, w: _ddp(r, s, w),
    **{key: functools.partial(_pipelining, spec=spec) for key, (_, spec) in TORCH_PIPES.items()},
}


def _torch_rank(rank: int, ranks: int, port: int, commands: Any, results: Any) -> None:
    """Runs the configurations it is told to, until told None; every rank answers each one.

    A configuration that fails on a rank is reported as an error and the rank goes on with the
    next command (a failure torch raises on every rank alike, as a schedule's own checks, leaves
    the group usable).
    """
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timedelta(seconds=300))
    results.put(("ready", rank, None))
    while (command := commands.get()) is not None:
        name, steps, warmup = command
        try:
            out: Any = _TORCH_RUNNERS[name](rank, ranks, steps, warmup)
        except Exception as exc:  # reported; the driver drops the configuration
            results.put(("error", rank, f"{name}: {type(exc).__name__}: {exc}"))
            continue
        results.put((name, rank, out))
    dist.destroy_process_group()


class TorchPool:
    """``ranks`` torch processes in one gloo group; :meth:`run` runs one configuration on them."""

    def __init__(self, ranks: int) -> None:
        from comm.sockets import free_port

        ctx = mp.get_context("spawn")
        self.ranks = ranks
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(ranks)]
        port = free_port()
        self.procs = [ctx.Process(target=_torch_rank, args=(r, ranks, port, self.commands[r], self.results),
                                  daemon=True, name=f"torch-rank{r}") for r in range(ranks)]
        for p in self.procs:
            p.start()
        for _ in range(ranks):
            self.results.get(timeout=600)

    def run(self, name: str, steps: int, warmup: int) -> dict[str, Any]:
        """Rank 0's figures for ``name``.

        Raises:
            RuntimeError: A rank failed (naming it and the error).
        """
        ranks = 1 if name == "single" else self.ranks
        for r in range(ranks):
            self.commands[r].put((name, steps, warmup))
        answers = [self.results.get(timeout=600) for _ in range(ranks)]
        if errors := [f"rank {r}, {msg}" for tag, r, msg in answers if tag == "error"]:
            raise RuntimeError("; ".join(errors))
        return dict(next(out for _, r, out in answers if r == 0))

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# -- cellmesh's configurations, on one harness -----------------------------------------------


def _profile(model: str, size: int, repeats: int, scaled: bool = True) -> Any:
    """The model's profile on ``size`` samples, at least ``repeats`` timed runs per node and size (``scaled``
    False: that size alone, as ``Job.plan()`` times a plan's own size)."""
    from coordinator.planning.graph import build_graph
    from coordinator.planning.profile import profile_graph
    from coordinator.runtime.factories import build_data, build_model

    made = build_model(model, {}, SEED)
    inputs, _ = build_data(DATA, {}, SEED).load(list(range(size)))
    return profile_graph(build_graph(made, inputs), inputs, repeats=repeats, optimizer="sgd", num_threads=1,
                         scaled=scaled)


def _as_job_plan_prices(plan: Any, own: Any, resources: Any, request: Any) -> Any:
    """``plan`` (chosen on the sample's profile) priced as ``Job.plan()`` prices it: on ``own``, a profile at
    its own microbatch size, where that is not the sample's ([Note: the plan's own size] in
    coordinator/runtime/job.py)."""
    from coordinator.planning.planner import repriced

    return plan if own is None else repriced(plan, own, resources, request)


def _pipe(stages: int, schedule: str, balance: list[int] | None) -> dict[str, Any]:
    """The plan fields of a pipeline of ``stages`` stages x 8 microbatches (``balance``: blocks per stage)."""
    return dict(data_parallel=1, num_stages=stages, num_microbatches=MICROBATCHES, schedule=schedule,
                balance=balance)


# key -> (model, workers, plan fields); the pipelines use the splits of their torch peers
CELLMESH_SHAPES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "cm-1": (MODEL, 1, dict(data_parallel=1, num_stages=1, num_microbatches=1)),
    "cm-dp2": (MODEL, 2, dict(data_parallel=2, num_stages=1, num_microbatches=1)),
    "cm-gpipe": (MODEL, 2, _pipe(2, "gpipe", [4, 4])),
    "cm-1f1b": (MODEL, 2, _pipe(2, "1f1b", [4, 4])),
    "cm-zbh1": (MODEL, 2, _pipe(2, "zb-h1", [4, 4])),
    # 4 stages on 2 workers, each holding 2 (the schedule says which: Schedule.ranks)
    "cm-interleaved": (MODEL, 2, _pipe(4, INTERLEAVED, [2, 2, 2, 2])),
    "cm-gpipe-4": (MODEL, 4, _pipe(4, "gpipe", [2, 2, 2, 2])),
    "cm-1f1b-4": (MODEL, 4, _pipe(4, "1f1b", [2, 2, 2, 2])),
    "cm-zbh1-4": (MODEL, 4, _pipe(4, "zb-h1", [2, 2, 2, 2])),
    "cm-even": (UNEVEN, 2, _pipe(2, "1f1b", [4, 4])),
    "cm-auto": (UNEVEN, 2, _pipe(2, "1f1b", None)),  # the planner's cutter chooses the cut
}


def _cellmesh_jobs(keys: list[str], careful_repeats: int, save: str = ""
                   ) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
    """The cellmesh configurations ``keys`` as jobs with their plans fixed, a second prediction of each
    plan, and why each configuration without a job has none.

    The plans come from one profile per model taken as ``Job.plan()`` takes it (8 samples,
    at least 3 runs per node and size, see coordinator/planning/profile.py), shared by the model's
    jobs, so their predictions (and the even and the auto cut) differ only by the plan; a plan of
    microbatches of another size is priced again on one profile of its own size (one size, at least
    3 runs), as ``Job.plan()`` prices it. The
    second prediction plays the same plan against a careful profile: on the plan's own
    microbatch size (no scaling), at least ``careful_repeats`` runs. A plan that cannot be made
    (an unknown schedule, a shape the planner refuses) leaves its configuration out, with the reason.
    ``save``: a directory to write the plans' profiles to (``profile-<model>.json``, and
    ``profile-<model>-<size>.json`` at a plan's own size), so another cost model can be played against
    the very profiles of this run.
    """
    from coordinator.planning.config import PlanConfig
    from coordinator.planning.planner import choose_plan
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    sample = min(8, GLOBAL_BATCH // WORLD)  # as Job.plan()
    models = {CELLMESH_SHAPES[k][0] for k in keys}
    profiles = {(model, sample, 3): _profile(model, sample, 3) for model in sorted(models)}
    if save:
        os.makedirs(save, exist_ok=True)
        for (model, _, _), prof in profiles.items():
            prof.save(os.path.join(save, f"profile-{model.rsplit(':', 1)[1]}.json"))
    jobs, careful, refused = {}, {}, {}
    for key in keys:
        model, workers, fields = CELLMESH_SHAPES[key]
        resources = Resources.local(max(WORLD, workers))
        try:
            request = PlanConfig(**fields)
            plan = choose_plan(profiles[(model, sample, 3)], resources, request, global_batch=GLOBAL_BATCH)
            own = None
            if plan.microbatch_size != sample:
                size = plan.microbatch_size
                if (model, size, 3) not in profiles:
                    profiles[(model, size, 3)] = _profile(model, size, 3, scaled=False)
                    if save:
                        profiles[(model, size, 3)].save(
                            os.path.join(save, f"profile-{model.rsplit(':', 1)[1]}-{size}.json"))
                own = profiles[(model, size, 3)]
            plan = _as_job_plan_prices(plan, own, resources, request)
        except Exception as exc:  # reported: the configuration is not run
            refused[key] = f"no plan: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        jobs[key] = Job(model=model, loss=LOSS, data=DATA, optimizer="SGD", optimizer_kwargs={"lr": LR},
                        resources=resources, global_batch=GLOBAL_BATCH, seed=SEED, plan=plan,
                        step_timeout_s=120)
        index = (model, plan.microbatch_size, careful_repeats)
        if index not in profiles:
            profiles[index] = _profile(*index)
        fixed = {**fields, "balance": [st.stop - st.start for st in plan.stages]}
        careful[key] = choose_plan(profiles[index], resources, PlanConfig(**fixed),
                                   global_batch=GLOBAL_BATCH).step_time_s
    return jobs, careful, refused


@dataclass
class Breakdown:
    """Where one cellmesh step's time went (seconds), from its event log.

    A step's request carries the previous step's commit, so its optimizer runs at the
    step's start, before the first action.
    """

    step: float  # the step's wall time
    compute: list[float]  # per stage (replica 0): forward + backward (B, or I + W)
    dispatch: float  # step start -> the first event of any stage began (the run_step request)
    optimizer: float  # the slowest stage's optimizer step (the previous step's commit)
    run: float  # the first action -> the last action or all-reduce ended, any stage
    all_reduce: float  # the all-reduce phase, slowest replica (0 without one)
    tail: float  # the last action ended -> the coordinator had every reply


def _stage_compute(b: Breakdown, stage: int) -> float:
    return b.compute[stage]


def breakdown(record: Any, num_stages: int) -> Breakdown:
    ev = record.events
    compute = [sum(e.end - e.start for e in ev if e.replica == 0 and e.stage == s and e.action is not None
                   and e.action.kind in ("F", "B", "I", "W")) for s in range(num_stages)]
    runs = [e for e in ev if e.name not in ("optimizer", "push_pull")]
    opts = [e for e in ev if e.name in ("optimizer", "push_pull")]
    first, run_end = min(e.start for e in runs), max(e.end for e in runs)
    reduce = [e.end - e.start for e in ev if e.name == "all_reduce"]
    return Breakdown(step=record.seconds, compute=compute,
                     dispatch=min(e.start for e in ev) - record.start,
                     optimizer=max((e.end - e.start for e in opts), default=0.0), run=run_end - first,
                     all_reduce=max(reduce, default=0.0), tail=record.end - run_end)


def fresh_prediction(job: Any, save: str = "") -> float:
    """The job's plan predicted again from a profile taken now, as ``Job.plan()`` takes it.

    Taken right before the configuration runs, so the profile sees the machine's load of that
    minute (on a shared machine the load drifts between the run's first profile and its rounds).
    ``save``: a file to write that profile to.
    """
    from coordinator.planning.config import PlanConfig
    from coordinator.planning.planner import choose_plan

    plan = job.plan()
    fields = dict(data_parallel=plan.data_parallel, num_stages=plan.num_stages, schedule=plan.schedule_name,
                  num_microbatches=plan.num_microbatches, balance=[st.stop - st.start for st in plan.stages])
    sample = min(8, GLOBAL_BATCH // WORLD)
    # the plan's own size alone where Job.plan() prices it there ([Note: the plan's own size])
    own = plan.microbatch_size != sample
    profile = _profile(job.config.model.factory, plan.microbatch_size if own else sample, 3, scaled=not own)
    if save:
        profile.save(save)
    fresh = choose_plan(profile, job.resources, PlanConfig(**fields), global_batch=GLOBAL_BATCH)
    return float(fresh.step_time_s)


def compute_bubble(stages: list[list[tuple[float, float, str]]]) -> float | None:
    """The idle share of a step's span when only compute (F, B, I, W) counts as busy.

    ``stages[s]``: stage ``s``'s ``(start, end, kind)`` actions. run.json's bubble counts every
    action as busy, a receive's wait for its data too; this one counts that wait as idle, as the
    simulator plays it.
    """
    from coordinator.runtime.bubble import bubble_fraction

    spans = [t for acts in stages for t in acts]
    if not spans:
        return None
    first, last = min(t[0] for t in spans), max(t[1] for t in spans)
    compute = [[(a, b) for a, b, kind in acts if kind in ("F", "B", "I", "W")] for acts in stages]
    # the span is every action's; the busy time only compute's (a marker keeps each stage's span)
    return bubble_fraction([[*acts, (first, first), (last, last)] for acts in compute])


def _with_compute(planned: Any, forward_s: Sequence[float], backward_s: Sequence[float]) -> Any:
    """``planned`` (the plan's :class:`StageCosts`) with each stage's forward and backward per microbatch
    replaced; its ``W`` and its tail after its last send (``StagePlan.weight_s``, ``tail_s``) scale as its
    backward did."""
    import dataclasses

    ratio = [b / p if p > 0 else 1.0 for b, p in zip(backward_s, planned.backward_s, strict=True)]
    return dataclasses.replace(
        planned, forward_s=tuple(forward_s), backward_s=tuple(backward_s),
        weight_backward_s=tuple(w * r for w, r in zip(planned.weight_backward_s, ratio, strict=False)),
        tail_s=tuple(t * r for t, r in zip(planned.tail_s, ratio, strict=False)))


def replay(plan: Any, forward_s: list[float], backward_s: list[float]) -> float:
    """The plan's predicted step with the profile's compute times replaced by measured ones.

    ``forward_s[s]`` / ``backward_s[s]``: stage ``s``'s measured time per microbatch. The
    transfers, the optimizer, the gradient sync and the overheads are the cost model's, as in the plan
    (:func:`_with_compute`).
    """
    from coordinator.planning.prediction import plan_costs
    from coordinator.planning.simulator import simulate

    costs = _with_compute(plan_costs(plan), forward_s, backward_s)
    return float(simulate(plan.schedule(), costs).step_time_s + plan.sync_time_s + plan.overhead_s)


def run_cellmesh(job: Any, harness: Any, steps: int, warmup: int) -> dict[str, Any]:
    # A step's request commits the previous step, so the first step after the warm-up (whose
    # last step was committed on its own) is left out of the timing: each timed step then
    # carries one commit, and the job trains warmup + steps steps as torch's do. cpu: the
    # coordinator thread's CPU time after each step; a window of several steps (runtime.steps_per_request)
    # hands its records over at its end, so the CPU per step is taken over the whole fit (up to the last
    # step's record, before the final commit).
    cpu: list[float] = []
    with job.attach(harness):
        job.fit(max(0, warmup - 1))
        pids = {name: proc.pid for name, proc in harness.procs.items()}
        before = {name: _process_cpu_s(pid) for name, pid in pids.items()}
        started = time.thread_time()
        result = job.fit(steps + 1, callback=lambda _: cpu.append(time.thread_time()))
        after = {name: _process_cpu_s(pid) for name, pid in pids.items()}
    worker_cpu = {name: (a - b) / (steps + 1) for name in pids
                  if (b := before[name]) is not None and (a := after[name]) is not None}
    recs = result.steps[1:]
    wall = recs[-1].end - recs[0].start
    stages = job.plan().num_stages
    durations = {kind: [[e.end - e.start for r in recs for e in r.events if e.replica == 0 and e.stage == s
                         and e.action is not None and e.action.kind == kind] for s in range(stages)]
                 for kind in "FBIW"}
    # a split backward (zb-h1): a microbatch's backward is its I and its W
    backward = [b or [i + w for i, w in zip(durations["I"][s], durations["W"][s], strict=True)]
                for s, b in enumerate(durations["B"])]
    from coordinator.runtime.bubble import measured_bubble

    bubbles = [b for b in map(measured_bubble, recs) if b is not None]
    idle = [b for b in (compute_bubble([[(e.start, e.end, e.action.kind) for e in r.events
                                          if e.replica == 0 and e.stage == s and e.action is not None]
                                         for s in range(stages)]) for r in recs) if b is not None]
    return {"step_s": wall / steps, "loss": recs[-1].loss, "bubbles": bubbles, "compute_bubbles": idle,
            "coordinator_s": sum(r.coordinator_s for r in recs) / steps,
            "coordinator_frac": sum(r.coordinator_s for r in recs) / sum(r.seconds for r in recs),
            "coordinator_cpu_s": (cpu[-1] - started) / (steps + 1),
            "forward_s": durations["F"], "backward_s": backward,
            "breakdowns": [breakdown(r, stages) for r in recs], "events": [_event_log(r) for r in recs],
            "worker_cpu_s": worker_cpu}


def _process_cpu_s(pid: int) -> float | None:
    """A process's user + system CPU seconds so far (Linux's /proc; None elsewhere or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_replay(plan: Any, resources: Any, worker_cpu: dict[str, float]) -> float | None:
    """The plan's step played at the pace of shared cores ([Note: shared cores] in
    coordinator/planning/simulator.py) with each stage's work the CPU time its worker spent per step.

    The wall-time replay (:func:`replay`) is only fair where each worker has a core: a median of actions
    timed while 2 to 4 workers took turns on 2 cores is neither their work nor their pace. Here a stage's
    forward and backward are its worker's CPU seconds per step (replica 0's; a worker holding several
    stages splits its own by the plan's shares), shaped as the plan's (forward against backward, ``W`` and
    tail scaled with the backward), and the play shares the host's cores among the busy ones, with no
    further slowdown (the CPU time holds it). A worker's CPU time also holds its transfers' copies, which
    the cost model's transfers count again: expect a few percent over the measured step.
    """
    from coordinator.planning.planner import shared_cores
    from coordinator.planning.prediction import plan_costs
    from coordinator.planning.simulator import Sharing, simulate

    planned = plan_costs(plan)
    m = plan.num_microbatches
    per_stage = [f + b for f, b in zip(planned.forward_s, planned.backward_s, strict=True)]
    holders: dict[str, list[int]] = {}
    for st in plan.stages:
        holders.setdefault(st.workers[0], []).append(st.index)
    if any(w not in worker_cpu for w in holders):
        return None
    work = [0.0] * plan.num_stages
    for w, held in holders.items():
        total = sum(per_stage[s] for s in held) or 1.0
        for s in held:
            work[s] = worker_cpu[w] * per_stage[s] / total
    ratio = [work[s] / (m * per_stage[s]) if per_stage[s] > 0 else 1.0 for s in range(plan.num_stages)]
    costs = _with_compute(planned, [f * r for f, r in zip(planned.forward_s, ratio, strict=True)],
                          [b * r for b, r in zip(planned.backward_s, ratio, strict=True)])
    schedule = plan.schedule()
    by_name = {w.name: w for w in resources.workers}
    ranks = [[by_name[name] for name in dict.fromkeys(n for s in stages for n in plan.stages[s].workers)]
             for stages in map(schedule.stages_of, range(schedule.num_ranks))]  # a worker counts once
    shared = shared_cores(resources, ranks)
    sharing = Sharing(shared.cores, shared.wants, 1.0, 1.0)
    return float(simulate(schedule, costs, sharing).step_time_s + plan.sync_time_s + plan.overhead_s)


def _event_log(record: Any) -> dict[str, Any]:
    """A step's wall time and its events as JSON (``--save``): per event its stage, replica, name, kind and
    microbatch (None for a phase), start and end in seconds from the step's start."""
    return {"seconds": record.seconds, "events": [
        [e.stage, e.replica, e.name, e.action.kind if e.action is not None else None,
         e.action.microbatch if e.action is not None else None, e.start - record.start, e.end - record.start]
        for e in record.events]}


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    system: str  # "torch" or "cellmesh"
    peer: str | None = None  # the configuration this one is compared with
    target: float | None = None  # the least samples/s ratio to the peer the issue asks
    pipeline: int = 0  # a pipeline of the baseline model on this many processes (best against best)


CONFIGS = (
    Config("single", "torch, 1 process", "torch"),
    Config("cm-1", "cellmesh, 1 worker", "cellmesh", "single"),
    Config("pair", "torch, 2 independent processes at once (2-process ceiling)", "torch", "single"),
    Config("ddp", "torch DDP, 2 processes", "torch"),
    Config("cm-dp2", "cellmesh data parallel 2", "cellmesh", "ddp", 1.05),
    Config("gpipe", "torch pipelining GPipe 2x8", "torch", pipeline=2),
    Config("cm-gpipe", "cellmesh GPipe 2x8", "cellmesh", "gpipe", PIPELINE_TARGET, 2),
    Config("1f1b", "torch pipelining 1F1B 2x8", "torch", pipeline=2),
    Config("cm-1f1b", "cellmesh 1F1B 2x8", "cellmesh", "1f1b", PIPELINE_TARGET, 2),
    Config("zb", "torch pipelining InterleavedZeroBubble 2x8 (1 stage/rank: ZB-H1)", "torch", pipeline=2),
    Config("cm-zbh1", "cellmesh zb-h1 2x8", "cellmesh", "zb", PIPELINE_TARGET, 2),
    Config("interleaved", "torch pipelining Interleaved1F1B 2 ranks x 2 stages x 8", "torch", pipeline=2),
    Config("cm-interleaved", f"cellmesh {INTERLEAVED} 2 workers x 2 stages x 8", "cellmesh", "interleaved",
           PIPELINE_TARGET, 2),
    Config("zb-interleaved", "torch pipelining InterleavedZeroBubble 2 ranks x 2 stages x 8", "torch",
           pipeline=2),
    Config("zbv", "torch pipelining ZBVZeroBubble 2 ranks x 2 stages (V) x 8", "torch", pipeline=2),
    Config("gpipe-4", "torch pipelining GPipe 4x8", "torch", pipeline=4),
    Config("cm-gpipe-4", "cellmesh GPipe 4x8", "cellmesh", "gpipe-4", PIPELINE_TARGET, 4),
    Config("1f1b-4", "torch pipelining 1F1B 4x8", "torch", pipeline=4),
    Config("cm-1f1b-4", "cellmesh 1F1B 4x8", "cellmesh", "1f1b-4", PIPELINE_TARGET, 4),
    Config("zb-4", "torch pipelining InterleavedZeroBubble 4x8 (1 stage/rank: ZB-H1)", "torch", pipeline=4),
    Config("cm-zbh1-4", "cellmesh zb-h1 4x8", "cellmesh", "zb-4", PIPELINE_TARGET, 4),
    Config("cm-even", "uneven model, even split [4, 4], 1F1B 2x8", "cellmesh"),
    Config("cm-auto", "uneven model, auto-cut, 1F1B 2x8", "cellmesh", "cm-even"),
)


def torch_ranks(key: str) -> int:
    """The processes torch's configuration ``key`` runs on (its pool)."""
    return TORCH_PIPES[key][0] if key in TORCH_PIPES else WORLD


def round_order(configs: list[Config], index: int) -> list[Config]:
    """Round ``index``'s order: a configuration stays next to its peer; pairs rotate, and swap every round."""
    groups: list[list[Config]] = []
    for c in configs:
        if groups and c.peer == groups[-1][0].key:
            groups[-1].append(c)
        else:
            groups.append([c])
    shift = index % len(groups)
    groups = groups[shift:] + groups[:shift]
    return [c for g in groups for c in (reversed(g) if index % 2 else g)]


@dataclass
class Results:
    rounds: list[dict[str, dict[str, Any]]] = field(default_factory=list)

    failed: dict[str, str] = field(default_factory=dict)  # key -> why it was not run (or stopped)

    def values(self, key: str, what: str) -> list[float]:
        return [r[key][what] for r in self.rounds if key in r and what in r[key]]

    def ratios(self, key: str, peer: str) -> list[float]:
        return [r[peer]["step_s"] / r[key]["step_s"] for r in self.rounds if key in r and peer in r]

    def best(self, keys: list[str]) -> tuple[list[float], str]:
        """Per round, the smallest step of ``keys`` (those run in it); and the key fastest in most rounds."""
        steps, wins = [], []
        for r in self.rounds:
            ran = [k for k in keys if k in r]
            if ran:
                fastest = min(ran, key=lambda k: r[k]["step_s"])
                steps.append(r[fastest]["step_s"])
                wins.append(fastest)
        return steps, max(set(wins), key=wins.count) if wins else ""


def _cell(values: list[float], fmt: str = ".1f", unit: str = "") -> str:
    """Median (min-max); one value if they all print alike."""
    if not values:
        return "-"
    low, mid, high = (format(v, fmt) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid}{unit}" if low == high else f"{mid}{unit} ({low}-{high})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _gpipe_bubble(p: int, m: int) -> float:
    """The GPipe formula: the idle share of equal stages with free transfers."""
    return (p - 1) / (m + p - 1)


def _targets(results: Results, labels: dict[str, str]) -> list[str]:
    """The targets' table: each cellmesh configuration with a target against its peer, then the best
    cellmesh pipeline against the best torch one per process count."""
    out = ["", "## Against the targets", "",
           "Ratios of samples/s (the peer's step over cellmesh's), taken within each round: median "
           "(min-max); a verdict on the median.", "",
           "| comparison | ratio | target | verdict |", "|---|---|---|---|"]
    for c in CONFIGS:
        if c.target is None or c.peer is None:
            continue
        ratios = results.ratios(c.key, c.peer)
        if not ratios:
            why = results.failed.get(c.key) or results.failed.get(c.peer) or "not run"
            out.append(f"| {c.label} vs {labels[c.peer]} | - | >= {c.target:.2f}x | not measured: {why} |")
            continue
        ok = statistics.median(ratios) >= c.target
        out.append(f"| {c.label} vs {labels[c.peer]} | {_cell(ratios, '.2f', 'x')} | >= {c.target:.2f}x "
                   f"| {'met' if ok else 'missed'} |")
    for n in sorted({c.pipeline for c in CONFIGS if c.pipeline}):
        cm, cm_key = results.best([c.key for c in CONFIGS if c.pipeline == n and c.system == "cellmesh"])
        pt, pt_key = results.best([c.key for c in CONFIGS if c.pipeline == n and c.system == "torch"])
        if not cm or not pt:
            continue
        ratios = [t / c for c, t in zip(cm, pt, strict=False)]
        ok = statistics.median(ratios) >= PIPELINE_TARGET
        out.append(f"| best cellmesh pipeline on {n} processes ({labels[cm_key]}) vs best torch one "
                   f"({labels[pt_key]}) | {_cell(ratios, '.2f', 'x')} | >= {PIPELINE_TARGET:.2f}x "
                   f"| {'met' if ok else 'missed'} |")
    return out


def _bubbles(results: Results, jobs: dict[str, Any]) -> list[str]:
    """Per cellmesh pipeline: each timed step's measured bubble against the formula and the simulator."""
    from coordinator.planning.prediction import predict
    from coordinator.runtime.bubble import predicted_bubble

    out = ["", "## cellmesh: the bubble", "",
           "The idle share of each timed step's pipeline, from the actions the stages timed "
           "(`coordinator/runtime/bubble.py`, run.json's `bubbles`): median (min-max) over every timed "
           "step of every round; against the GPipe formula (p-1)/(m+p-1) (p: the workers of a replica's "
           "pipeline) and the simulator's prediction for the plan (the same arithmetic on its timeline). "
           "Both count a worker busy while it computes (F, B, I, W). The compute-only columns are this "
           "script's own arithmetic per stage, as a cross-check (a worker holding two stages, as interleaved "
           "plans place them, counts them apart there, so its bubble looks larger).", "",
           "| configuration | p x m | (p-1)/(m+p-1) | predicted | measured | measured / predicted "
           "| compute only: predicted | measured |",
           "|---|---|---|---|---|---|---|---|"]
    for c in CONFIGS:
        if c.key not in jobs or not results.values(c.key, "bubbles"):
            continue
        plan = jobs[c.key].plan()
        if plan.num_stages == 1:
            continue
        measured = [b for bs in results.values(c.key, "bubbles") for b in bs]
        ranks = plan.schedule().num_ranks
        formula = _gpipe_bubble(ranks, plan.num_microbatches)
        predicted = predicted_bubble(predict(plan)) or 0.0
        ratio = _cell([b / predicted for b in measured], ".2f") if predicted > 0 else "-"
        sim = predict(plan)
        only = compute_bubble([[(t.start, t.end, t.action.kind) for t in played] for played in sim.timeline])
        idle = [b for bs in results.values(c.key, "compute_bubbles") for b in bs]
        out.append(f"| {c.label} | {ranks} x {plan.num_microbatches} | {formula:.3f} | {predicted:.3f} "
                   f"| {_cell(measured, '.3f')} | {ratio} | {only or 0.0:.3f} | {_cell(idle, '.3f')} |")
    return out


def report(results: Results, jobs: dict[str, Any], careful: dict[str, float], args: argparse.Namespace,
           elapsed: float, load: tuple[float, float]) -> str:
    out = ["# training throughput: cellmesh against torch, 2 and 4 processes on loopback", "",
           f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores ({_cpu_model()}), "
           f"torch {torch.__version__}, Python {platform.python_version()}",
           f"8 x Linear(1024, 1024) + GELU, global batch {GLOBAL_BATCH}, float32, SGD, 1 thread per process; "
           f"{len(results.rounds)} rounds x {args.steps} timed steps after {args.warmup} warm-up steps "
           f"(run took {elapsed:.0f} s); median (min-max) over rounds",
           f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (this run's own "
           "processes add up to 2)", ""]
    out += ["| configuration | samples/s | ms/step | vs peer (samples/s) | target | vs 1 process "
            "| loss after last step |", "|---|---|---|---|---|---|---|"]
    labels = {c.key: c.label for c in CONFIGS}
    for c in CONFIGS:
        steps = results.values(c.key, "step_s")
        if not steps:
            if c.key in results.failed:
                out.append(f"| {c.label} | not run: {results.failed[c.key]} | | | | | |")
            continue
        rate = [GLOBAL_BATCH / s for s in steps]
        vs_peer = f"{_cell(results.ratios(c.key, c.peer), '.2f', 'x')} vs {labels[c.peer]}" if c.peer else ""
        target = ""
        if c.target is not None and results.ratios(c.key, c.peer or ""):
            ok = statistics.median(results.ratios(c.key, c.peer or "")) >= c.target
            target = f">= {c.target:.2f}x: {'met' if ok else 'missed'}"
        base = _cell(results.ratios(c.key, "single"), ".2f", "x") if c.key != "single" else ""
        loss = _cell(results.values(c.key, "loss"), ".6f")
        stopped = f" (stopped: {results.failed[c.key]})" if c.key in results.failed else ""
        out.append(f"| {c.label}{stopped} | {_cell(rate)} | {_cell([s * 1e3 for s in steps])} | {vs_peer} "
                   f"| {target} | {base} | {loss} |")
    out += _targets(results, labels)
    out += _bubbles(results, jobs)
    cellmesh = [c for c in CONFIGS if c.system == "cellmesh" and results.values(c.key, "step_s")]
    out += ["", "## cellmesh: the coordinator's time and the predicted step", "",
            "Coordinator ms/step: `StepRecord.coordinator_s`, the step's wall time less the coordinator's "
            "waits in its poller (target < 0.5% of the step); CPU ms/step: the coordinator thread's CPU "
            "time per step (the same work without the time it waited for a core). Predicted: "
            "`Plan.step_time_s` (simulator + gradient sync + optimizer + messages) from the profile "
            "`Job.plan()` takes (8 and 32 samples, lower quartile of at least 3 runs per node and size; a "
            "plan of microbatches of another size priced again on that size alone, as `Job.plan()` does; "
            "target: within 15% of the measured step); fresh: the same plan against a profile taken "
            "as `Job.plan()` takes it right before the configuration ran in the round (the load of that "
            "minute); careful: the same plan against a profile on "
            "the plan's own microbatch size, at least 15 runs; "
            "replay: the simulator fed the forward and backward times measured in the round (median per "
            "stage and microbatch), transfers and gradient sync from the cost model; CPU replay: the "
            "simulator at the pace of shared cores fed each stage's CPU seconds per step (its worker's, "
            "`cpu_replay`: fair where workers take turns on cores, which the wall-time replay is not).", "",
            "| configuration | plan | coordinator ms/step | % of step | coordinator CPU ms/step | % of step "
            "| measured ms | predicted ms | predicted / measured | fresh / measured | careful / measured "
            "| replay / measured | CPU replay / measured |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cellmesh:
        plan = jobs[c.key].plan()
        steps = results.values(c.key, "step_s")
        shape = (f"d={plan.data_parallel} p={plan.num_stages} {plan.schedule_name} m={plan.num_microbatches} "
                 f"cut {list(plan.bounds)}")
        wall = [v * 1e3 for v in results.values(c.key, "coordinator_s")]
        cpu = [v * 1e3 for v in results.values(c.key, "coordinator_cpu_s")]
        predicted, good = plan.step_time_s, careful[c.key]
        fresh = results.values(c.key, "fresh_s")
        replays = [replay(plan, [statistics.median(f) for f in r[c.key]["forward_s"]],
                          [statistics.median(b) for b in r[c.key]["backward_s"]])
                   for r in results.rounds if c.key in r and all(r[c.key]["forward_s"])]
        cpu_replays = [(cpu_replay(plan, jobs[c.key].resources, r[c.key].get("worker_cpu_s", {})),
                        r[c.key]["step_s"]) for r in results.rounds if c.key in r]
        out.append(
            f"| {c.label} | {shape} | {_cell(wall, '.2f')} "
            f"| {_cell([v * 100 for v in results.values(c.key, 'coordinator_frac')], '.2f')}% "
            f"| {_cell(cpu, '.2f')} | {_cell([v / s / 10 for v, s in zip(cpu, steps, strict=True)], '.2f')}% "
            f"| {_cell([s * 1e3 for s in steps])} | {predicted * 1e3:.1f} "
            f"| {_cell([predicted / s for s in steps], '.2f')} "
            f"| {_cell([f / s for f, s in zip(fresh, steps, strict=True)], '.2f')} "
            f"| {_cell([good / s for s in steps], '.2f')} "
            f"| {_cell([p / s for p, s in zip(replays, steps, strict=False)], '.2f')} "
            f"| {_cell([p / s for p, s in cpu_replays if p is not None], '.2f')} |")
    out += ["", "## cellmesh: where a step goes", "",
            "Medians over every timed step of every round, ms, from the step's event log: compute = "
            "forward + backward per stage; dispatch = step start to the first event on a stage (the "
            "request on its way); optimizer = the slowest stage's optimizer step (the previous step's "
            "commit, at the step's start); run = first action to the last action or all-reduce; "
            "all-reduce = the wait for the buckets after the last backward; tail = run end to the "
            "step's end (the replies).", "",
            "| configuration | step | compute per stage | dispatch | optimizer | run | all-reduce "
            "| tail |", "|---|---|---|---|---|---|---|---|"]
    for c in cellmesh:
        bds = [b for r in results.rounds if c.key in r for b in r[c.key]["breakdowns"]]

        def med(fn: Callable[[Breakdown], float], bds: list[Breakdown] = bds) -> str:
            return f"{statistics.median(fn(b) for b in bds) * 1e3:.1f}"

        stages = jobs[c.key].plan().num_stages
        compute = " / ".join(med(functools.partial(_stage_compute, stage=s)) for s in range(stages))
        out.append(f"| {c.label} | {med(lambda b: b.step)} | {compute} | {med(lambda b: b.dispatch)} "
                   f"| {med(lambda b: b.optimizer)} | {med(lambda b: b.run)} | {med(lambda b: b.all_reduce)} "
                   f"| {med(lambda b: b.tail)} |")
    return "\n".join(out)


def replay_saved(directory: str) -> str:
    """This tree's cost model played against a ``--save`` directory: per configuration, the plan its
    profiles give now against the steps measured then (median, and min-max over rounds) and against
    the prediction of that run's tree, as a markdown table."""
    from coordinator.planning.config import PlanConfig
    from coordinator.planning.planner import choose_plan
    from coordinator.planning.profile import Profile
    from coordinator.planning.resources import Resources

    with open(os.path.join(directory, "steps.json"), encoding="utf-8") as f:
        steps = json.load(f)
    rows = ["| configuration | measured ms | predicted then | now | then / measured | now / measured "
            "| fresh now / measured |", "|---|---|---|---|---|---|---|"]
    for c in CONFIGS:
        if c.key not in steps or c.key not in CELLMESH_SHAPES:
            continue
        model, workers, fields = CELLMESH_SHAPES[c.key]
        resources = Resources.local(max(WORLD, workers))

        def predict(path: str, fields: dict[str, Any] = fields, resources: Resources = resources,
                    sized: bool = False) -> float:
            """The plan on the profile at ``path``; ``sized``: priced again as ``Job.plan()`` prices it, on
            the profile of its own size saved beside (``profile-<model>-<size>.json``) if there is one."""
            request = PlanConfig(**fields)
            plan = choose_plan(Profile.load(path), resources, request, global_batch=GLOBAL_BATCH)
            own = path.replace(".json", f"-{plan.microbatch_size}.json")
            if sized and os.path.exists(own):
                plan = _as_job_plan_prices(plan, Profile.load(own), resources, request)
            return float(plan.step_time_s)

        now = predict(os.path.join(directory, f"profile-{model.rsplit(':', 1)[1]}.json"), sized=True)
        measured, then = steps[c.key]["step_s"], steps[c.key]["predicted_s"]
        ratios = [_cell([p / x for x in measured], ".2f") for p in (then, now)]
        # each round against the profile taken right before it ran (--save keeps them)
        fresh = [predict(path) / x for i, x in enumerate(measured)
                 if os.path.exists(path := os.path.join(directory, f"fresh-{c.key}-{i}.json"))]
        rows.append(f"| {c.label} | {_cell([x * 1e3 for x in measured])} | {then * 1e3:.1f} "
                    f"| {now * 1e3:.1f} | {ratios[0]} | {ratios[1]} | {_cell(fresh, '.2f')} |")
    return "\n".join(rows)


def main() -> None:
    parser = round_parser(__doc__, "configuration")
    parser.add_argument("--only", default="", help="comma-separated configuration keys (default: all)")
    parser.add_argument("--save", default="", help="a directory for the run's profiles and measured steps "
                                                   "(JSON), to play another cost model against them")
    parser.add_argument("--replay", default="", help="a --save directory: print this tree's predicted step "
                                                     "against its measured ones and its run's prediction "
                                                     "(runs nothing)")
    args = parse_rounds(parser)
    if args.replay:
        print(replay_saved(args.replay))
        return
    from comm.allocator import tune_malloc

    tune_malloc()
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness

    configs = [c for c in CONFIGS if not args.only or c.key in args.only.split(",")]
    started, load = time.monotonic(), os.getloadavg()[0]
    results = Results()
    # profile and plan before anything else runs
    jobs, careful, results.failed = _cellmesh_jobs([c.key for c in configs if c.system == "cellmesh"],
                                                   5 if args.quick else 15, args.save)
    for key, job in jobs.items():
        print(f"[plan] {key}: {job.plan().summary()}, cut {list(job.plan().bounds)}; careful profile: "
              f"{careful[key] * 1e3:.1f} ms", file=sys.stderr)
    for key, why in results.failed.items():
        print(f"[plan] {key}: not run: {why}", file=sys.stderr)
    configs = [c for c in configs if c.key not in results.failed]
    pools = {n: TorchPool(n) for n in sorted({torch_ranks(c.key) for c in configs if c.system == "torch"})}
    factories = sorted({name for job in jobs.values() for name in job_factories(job.config)})
    workers = max((job.resources.num_workers for job in jobs.values()), default=WORLD)
    harness = LocalHarness([f"local-{i}" for i in range(workers)], job="bench-train", threads=1,
                           python_path=[ROOT], lease_ttl=timedelta(seconds=5), factories=factories)
    try:
        if jobs:
            harness.start()
        for i in range(args.rounds):
            measured: dict[str, dict[str, Any]] = {}
            for c in round_order(configs, i):
                t0 = time.monotonic()
                try:
                    if c.system == "torch":
                        measured[c.key] = pools[torch_ranks(c.key)].run(c.key, args.steps, args.warmup)
                    else:
                        saved = os.path.join(args.save, f"fresh-{c.key}-{i}.json") if args.save else ""
                        fresh = fresh_prediction(jobs[c.key], saved)
                        measured[c.key] = run_cellmesh(jobs[c.key], harness, args.steps, args.warmup)
                        measured[c.key]["fresh_s"] = fresh
                except Exception as exc:  # reported; the configuration leaves the run
                    results.failed[c.key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    print(f"[round {i + 1}/{args.rounds}] {c.key}: failed: {results.failed[c.key]}",
                          file=sys.stderr)
                    continue
                print(f"[round {i + 1}/{args.rounds}] {c.key}: {measured[c.key]['step_s'] * 1e3:.1f} ms/step "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
            results.rounds.append(measured)
            configs = [c for c in configs if c.key not in results.failed]
    finally:
        harness.close()
        for pool in pools.values():
            pool.close()
    if args.save:
        steps = {c.key: {"step_s": results.values(c.key, "step_s"),
                         "fresh_s": results.values(c.key, "fresh_s"),
                         "predicted_s": jobs[c.key].plan().step_time_s if c.key in jobs else None,
                         "load": load}
                 for c in CONFIGS if results.values(c.key, "step_s")}
        for c in configs:  # each cellmesh step's event log, by round
            logs = [r[c.key]["events"] for r in results.rounds if c.key in r and "events" in r[c.key]]
            if logs:
                with open(os.path.join(args.save, f"events-{c.key}.json"), "w", encoding="utf-8") as f:
                    json.dump(logs, f)
        with open(os.path.join(args.save, "steps.json"), "w", encoding="utf-8") as f:
            json.dump(steps, f, indent=1)
    print(report(results, jobs, careful, args, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
