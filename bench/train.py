"""Training throughput of cellmesh's plans against torch's own, side by side on one machine.

The baseline model (``bench.models:mlp``: 8 x Linear(1024, 1024) + GELU,
8.4 M parameters), global batch 64, float32, SGD, one torch thread per process, every
configuration on the same initial parameters and the same global batches:

* one process: plain torch (the base) and cellmesh with one worker; and, as the ceiling of
  any two-process plan on this machine, two torch processes each training that way at
  once without communicating (their joint samples/s);
* data parallel 2: torch ``DistributedDataParallel`` (gloo) and cellmesh (``zmq``);
* 2 stages x 8 microbatches, GPipe and 1F1B: ``torch.distributed.pipelining``
  (``PipelineStage`` built by splitting the model by hand, static shapes, gloo) and cellmesh;
* cellmesh ZB-H1 2 x 8 (each backward split into I and W, the weight gradients deferred) against
  cellmesh 1F1B;
* cellmesh 1F1B 2 x 8 on a model with uneven layers (``bench.models:uneven``): the cut
  the planner's cutter chooses against the even split by cells.

torch's configurations run in two persistent spawned ranks (one gloo process group),
cellmesh's on one ``LocalHarness`` of two workers (each job attaches, places its services,
trains, releases them); their plans are fixed up front from one profile per model. Each
configuration warms up, then times ``--steps`` steps (a step: the global batch, forward,
backward, gradient sync, optimizer). Every round runs every configuration once, each next
to its peer, pairs rotated and swapped round by round, so CPU steal hits them alike. The
tables show the median over rounds and the spread (min-max); a ratio is taken within each
round. The loss after the last step is printed for every configuration: exact modes end
at the same value. For cellmesh they also show the coordinator's own time per step
(``StepRecord.coordinator_s``, and its CPU time), the simulator's prediction
(``Plan.step_time_s``) against the measured step, and where a step's time goes (from the
step's event log).

    python bench/train.py [--steps 10] [--warmup 3] [--rounds 3] [--quick] [--only ddp,cm-dp2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
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


def _pipelining(rank: int, steps: int, warmup: int, schedule: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model, x, y, sampler = _torch_setup(MODEL)
    blocks = list(model.children())
    half = len(blocks) // WORLD
    module = nn.Sequential(*blocks[rank * half:(rank + 1) * half])
    mb = GLOBAL_BATCH // MICROBATCHES
    width = x.shape[1]
    # Static shapes up front (inferring them goes through object collectives, which need numpy).
    # requires_grad on the examples says which tensors carry gradients across the cut.
    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"),
                          input_args=torch.empty(mb, width, requires_grad=rank > 0),
                          output_args=torch.empty(mb, width, requires_grad=True))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, MICROBATCHES, loss_fn=nn.MSELoss())
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    last = rank == WORLD - 1

    def step(k: int) -> float:
        idx = torch.tensor(sampler.indices(k))
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x[idx])
        else:
            sched.step(target=y[idx], losses=losses)
        opt.step()
        return float(torch.stack(losses).detach().mean()) if last else 0.0

    out = _timed(step, steps, warmup, dist.barrier)
    loss = torch.tensor([out["loss"]])
    dist.all_reduce(loss)
    out["loss"] = float(loss)
    return out


_TORCH_RUNNERS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "single": _single,
    "pair": _pair,
    "ddp": _ddp,
    "gpipe": lambda r, s, w: _pipelining(r, s, w, "gpipe"),
    "1f1b": lambda r, s, w: _pipelining(r, s, w, "1f1b"),
}


def _torch_rank(rank: int, port: int, commands: Any, results: Any) -> None:
    """Runs the configurations it is told to, until told None; rank 0 reports."""
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    results.put(("ready", rank))
    while (command := commands.get()) is not None:
        name, steps, warmup = command
        try:
            out = _TORCH_RUNNERS[name](rank, steps, warmup)
        except Exception as exc:
            results.put(("error", f"rank {rank}, {name}: {type(exc).__name__}: {exc}"))
            raise
        if rank == 0:
            results.put((name, out))
    dist.destroy_process_group()


class TorchPool:
    """The two torch ranks; :meth:`run` runs one configuration on one or both of them."""

    def __init__(self) -> None:
        from comm.sockets import free_port

        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(WORLD)]
        port = free_port()
        self.procs = [ctx.Process(target=_torch_rank, args=(r, port, self.commands[r], self.results),
                                  daemon=True, name=f"torch-rank{r}") for r in range(WORLD)]
        for p in self.procs:
            p.start()
        for _ in range(WORLD):
            self._get()

    def _get(self) -> tuple[str, Any]:
        tag, value = self.results.get(timeout=600)
        if tag == "error":
            raise RuntimeError(f"torch peer failed: {value}")
        return tag, value

    def run(self, name: str, steps: int, warmup: int) -> dict[str, Any]:
        ranks = 1 if name == "single" else WORLD
        for r in range(ranks):
            self.commands[r].put((name, steps, warmup))
        _, out = self._get()
        return dict(out)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# -- cellmesh's configurations, on one harness -----------------------------------------------


def _profile(model: str, size: int, repeats: int) -> Any:
    """The model's profile on ``size`` samples, at least ``repeats`` timed runs per node and size."""
    from coordinator.planning.graph import build_graph
    from coordinator.planning.profile import profile_graph
    from coordinator.runtime.factories import build_data, build_model

    made = build_model(model, {}, SEED)
    inputs, _ = build_data(DATA, {}, SEED).load(list(range(size)))
    return profile_graph(build_graph(made, inputs), inputs, repeats=repeats, optimizer="sgd", num_threads=1)


def _cellmesh_jobs(careful_repeats: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Every cellmesh configuration as a job with its plan fixed, and a second prediction of each plan.

    The plans come from one profile per model taken as ``Job.plan()`` takes it (8 samples,
    at least 3 runs per node and size, see coordinator/planning/profile.py), shared by the model's
    jobs, so their predictions (and the even and the auto cut) differ only by the plan. The
    second prediction plays the same plan against a careful profile: on the plan's own
    microbatch size (no scaling), at least ``careful_repeats`` runs.
    """
    from coordinator.planning.config import PlanConfig
    from coordinator.planning.planner import choose_plan
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    resources = Resources.local(WORLD)
    pipe = dict(data_parallel=1, num_stages=2, num_microbatches=MICROBATCHES)
    shapes: dict[str, tuple[str, dict[str, Any]]] = {
        "cm-1": (MODEL, dict(data_parallel=1, num_stages=1, num_microbatches=1)),
        "cm-dp2": (MODEL, dict(data_parallel=2, num_stages=1, num_microbatches=1)),
        # the split torch's pipelining peers use: 4 blocks per stage
        "cm-gpipe": (MODEL, dict(schedule="gpipe", balance=[4, 4], **pipe)),
        "cm-1f1b": (MODEL, dict(schedule="1f1b", balance=[4, 4], **pipe)),
        "cm-zbh1": (MODEL, dict(schedule="zb-h1", balance=[4, 4], **pipe)),
        "cm-even": (UNEVEN, dict(schedule="1f1b", balance=[4, 4], **pipe)),
        "cm-auto": (UNEVEN, dict(schedule="1f1b", **pipe)),  # the planner's cutter chooses the cut
    }
    sample = min(8, GLOBAL_BATCH // WORLD)  # as Job.plan()
    profiles = {(model, sample, 3): _profile(model, sample, 3) for model in (MODEL, UNEVEN)}
    jobs, careful = {}, {}
    for key, (model, fields) in shapes.items():
        plan = choose_plan(profiles[(model, sample, 3)], resources, PlanConfig(**fields),
                           global_batch=GLOBAL_BATCH)
        jobs[key] = Job(model=model, loss=LOSS, data=DATA, optimizer="SGD", optimizer_kwargs={"lr": LR},
                        resources=resources, global_batch=GLOBAL_BATCH, seed=SEED, plan=plan,
                        step_timeout_s=120)
        index = (model, plan.microbatch_size, careful_repeats)
        if index not in profiles:
            profiles[index] = _profile(*index)
        fixed = {**fields, "balance": [st.stop - st.start for st in plan.stages]}
        careful[key] = choose_plan(profiles[index], resources, PlanConfig(**fixed),
                                   global_batch=GLOBAL_BATCH).step_time_s
    return jobs, careful


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


def replay(plan: Any, resources: Any, forward_s: list[float], backward_s: list[float]) -> float:
    """The plan's predicted step with the profile's compute times replaced by measured ones.

    ``forward_s[s]`` / ``backward_s[s]``: stage ``s``'s measured time per microbatch. The
    transfers and the gradient sync are the cost model's, as in the plan.
    """
    from coordinator.planning.simulator import StageCosts, simulate

    def transfer(nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else resources.latency_s + nbytes / resources.bandwidth_bps

    cuts = [st.outgoing for st in plan.stages[:-1]]
    costs = StageCosts(tuple(forward_s), tuple(backward_s), tuple(transfer(c.forward_bytes) for c in cuts),
                       tuple(transfer(c.backward_bytes) for c in cuts),
                       start_s=tuple(st.optimizer_s for st in plan.stages))
    return float(simulate(plan.schedule(), costs).step_time_s + plan.sync_time_s + plan.overhead_s)


def run_cellmesh(job: Any, harness: Any, steps: int, warmup: int) -> dict[str, Any]:
    # A step's request commits the previous step, so the first step after the warm-up (whose
    # last step was committed on its own) is left out of the timing: each timed step then
    # carries one commit, and the job trains warmup + steps steps as torch's do. cpu: the
    # coordinator thread's CPU time after each step.
    cpu: list[float] = []
    with job.attach(harness):
        job.fit(max(0, warmup - 1))
        result = job.fit(steps + 1, callback=lambda _: cpu.append(time.thread_time()))
    recs = result.steps[1:]
    wall = recs[-1].end - recs[0].start
    stages = job.plan().num_stages
    durations = {kind: [[e.end - e.start for r in recs for e in r.events if e.replica == 0 and e.stage == s
                         and e.action is not None and e.action.kind == kind] for s in range(stages)]
                 for kind in "FBIW"}
    # a split backward (zb-h1): a microbatch's backward is its I and its W
    backward = [b or [i + w for i, w in zip(durations["I"][s], durations["W"][s], strict=True)]
                for s, b in enumerate(durations["B"])]
    return {"step_s": wall / steps, "loss": recs[-1].loss,
            "coordinator_s": sum(r.coordinator_s for r in recs) / steps,
            "coordinator_frac": sum(r.coordinator_s for r in recs) / sum(r.seconds for r in recs),
            "coordinator_cpu_s": (cpu[-1] - cpu[0]) / steps,
            "forward_s": durations["F"], "backward_s": backward,
            "breakdowns": [breakdown(r, stages) for r in recs]}


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    system: str  # "torch" or "cellmesh"
    peer: str | None = None  # the configuration this one is compared with
    target: float | None = None  # the least samples/s ratio to the peer the issue asks


CONFIGS = (
    Config("single", "torch, 1 process", "torch"),
    Config("cm-1", "cellmesh, 1 worker", "cellmesh", "single"),
    Config("pair", "torch, 2 independent processes at once (2-process ceiling)", "torch", "single"),
    Config("ddp", "torch DDP, 2 processes", "torch"),
    Config("cm-dp2", "cellmesh data parallel 2", "cellmesh", "ddp", 1.05),
    Config("gpipe", "torch pipelining GPipe 2x8", "torch"),
    Config("cm-gpipe", "cellmesh GPipe 2x8", "cellmesh", "gpipe", 1.10),
    Config("1f1b", "torch pipelining 1F1B 2x8", "torch"),
    Config("cm-1f1b", "cellmesh 1F1B 2x8", "cellmesh", "1f1b", 1.10),
    Config("cm-zbh1", "cellmesh ZB-H1 2x8 (backward split in I and W)", "cellmesh", "cm-1f1b"),
    Config("cm-even", "uneven model, even split [4, 4], 1F1B 2x8", "cellmesh"),
    Config("cm-auto", "uneven model, auto-cut, 1F1B 2x8", "cellmesh", "cm-even"),
)


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

    def values(self, key: str, what: str) -> list[float]:
        return [r[key][what] for r in self.rounds if key in r]

    def ratios(self, key: str, peer: str) -> list[float]:
        return [r[peer]["step_s"] / r[key]["step_s"] for r in self.rounds if key in r and peer in r]


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


def report(results: Results, jobs: dict[str, Any], careful: dict[str, float], args: argparse.Namespace,
           elapsed: float, load: tuple[float, float]) -> str:
    out = [f"# training throughput: cellmesh against torch, {WORLD} processes on loopback", "",
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
            continue
        rate = [GLOBAL_BATCH / s for s in steps]
        vs_peer = f"{_cell(results.ratios(c.key, c.peer), '.2f', 'x')} vs {labels[c.peer]}" if c.peer else ""
        target = ""
        if c.target is not None and results.ratios(c.key, c.peer or ""):  # its peer ran (see --only)
            ok = statistics.median(results.ratios(c.key, c.peer or "")) >= c.target
            target = f">= {c.target:.2f}x: {'met' if ok else 'missed'}"
        base = _cell(results.ratios(c.key, "single"), ".2f", "x") if c.key != "single" else ""
        loss = _cell(results.values(c.key, "loss"), ".6f")
        out.append(f"| {c.label} | {_cell(rate)} | {_cell([s * 1e3 for s in steps])} | {vs_peer} | {target} "
                   f"| {base} | {loss} |")
    cellmesh = [c for c in CONFIGS if c.system == "cellmesh" and results.values(c.key, "step_s")]
    out += ["", "## cellmesh: the coordinator's time and the predicted step", "",
            "Coordinator ms/step: `StepRecord.coordinator_s`, the step's wall time less the coordinator's "
            "waits in its poller; CPU ms/step: the coordinator thread's CPU time per step (the same work "
            "without the time it waited for a core). Predicted: `Plan.step_time_s` (simulator + gradient "
            "sync + optimizer + messages) from the profile `Job.plan()` takes (8 and 32 samples, lower "
            "quartile of at least 3 runs per node and size); careful: the same plan against a profile on "
            "the plan's own microbatch size, at least 15 runs; "
            "replay: the simulator fed the forward and backward times measured in the round (median per "
            "stage and microbatch), transfers and gradient sync from the cost model.", "",
            "| configuration | plan | coordinator ms/step | % of step | coordinator CPU ms/step | % of step "
            "| measured ms | predicted ms | predicted / measured | careful / measured | replay / measured |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cellmesh:
        plan = jobs[c.key].plan()
        steps = results.values(c.key, "step_s")
        shape = (f"d={plan.data_parallel} p={plan.num_stages} {plan.schedule_name} m={plan.num_microbatches} "
                 f"cut {list(plan.bounds)}")
        wall = [v * 1e3 for v in results.values(c.key, "coordinator_s")]
        cpu = [v * 1e3 for v in results.values(c.key, "coordinator_cpu_s")]
        predicted, good = plan.step_time_s, careful[c.key]
        replays = [replay(plan, jobs[c.key].resources, [statistics.median(f) for f in r[c.key]["forward_s"]],
                          [statistics.median(b) for b in r[c.key]["backward_s"]])
                   for r in results.rounds if c.key in r]
        out.append(
            f"| {c.label} | {shape} | {_cell(wall, '.2f')} "
            f"| {_cell([v * 100 for v in results.values(c.key, 'coordinator_frac')], '.2f')}% "
            f"| {_cell(cpu, '.2f')} | {_cell([v / s / 10 for v, s in zip(cpu, steps, strict=True)], '.2f')}% "
            f"| {_cell([s * 1e3 for s in steps])} | {predicted * 1e3:.1f} "
            f"| {_cell([predicted / s for s in steps], '.2f')} | {_cell([good / s for s in steps], '.2f')} "
            f"| {_cell([p / s for p, s in zip(replays, steps, strict=True)], '.2f')} |")
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


def main() -> None:
    parser = round_parser(__doc__, "configuration")
    parser.add_argument("--only", default="", help="comma-separated configuration keys (default: all)")
    args = parse_rounds(parser)
    from comm.allocator import tune_malloc

    tune_malloc()
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness

    configs = [c for c in CONFIGS if not args.only or c.key in args.only.split(",")]
    started, load = time.monotonic(), os.getloadavg()[0]
    jobs, careful = _cellmesh_jobs(5 if args.quick else 15)  # profile and plan before anything else runs
    for key, job in jobs.items():
        print(f"[plan] {key}: {job.plan().summary()}, cut {list(job.plan().bounds)}; careful profile: "
              f"{careful[key] * 1e3:.1f} ms", file=sys.stderr)
    results = Results()
    pool = TorchPool() if any(c.system == "torch" for c in configs) else None
    factories = sorted({name for job in jobs.values() for name in job_factories(job.config)})
    harness = LocalHarness([f"local-{i}" for i in range(WORLD)], job="bench-train", threads=1,
                           python_path=[ROOT], lease_ttl=timedelta(seconds=5), factories=factories)
    try:
        if any(c.system == "cellmesh" for c in configs):
            harness.start()
        for i in range(args.rounds):
            measured: dict[str, dict[str, Any]] = {}
            for c in round_order(configs, i):
                t0 = time.monotonic()
                if c.system == "torch":
                    assert pool is not None
                    measured[c.key] = pool.run(c.key, args.steps, args.warmup)
                else:
                    measured[c.key] = run_cellmesh(jobs[c.key], harness, args.steps, args.warmup)
                print(f"[round {i + 1}/{args.rounds}] {c.key}: {measured[c.key]['step_s'] * 1e3:.1f} ms/step "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
            results.rounds.append(measured)
    finally:
        harness.close()
        if pool is not None:
            pool.close()
    print(report(results, jobs, careful, args, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
