"""ZeRO against torch: cellmesh's data parallelism and ZeRO-1/2/3 beside torch DDP and FSDP2, 2 processes.

Every configuration trains the same model from the same initial parameters on the same global
batches, float32, one torch thread per process, 2 processes:

* torch ``DistributedDataParallel`` (also with the optimizer's fused implementation, ``ddp-f``, which
  cellmesh's workers run: [Note: the fused optimizer] in ``services/compute/stage.py``) and torch
  FSDP2 (``torch.distributed.fsdp.fully_shard`` on every top-level block, then on the root), both over
  gloo;
* cellmesh data parallel 2 (``plan.zero 0``) and ZeRO-1, ZeRO-2, ZeRO-3 over 2 replicas (the
  ``zmq`` backend, the default), on a ``LocalHarness`` of 2 workers; beside them, as they ran before
  ``plan.gather_bytes``: ZeRO-1 and 2 with their all-gather in one bucket (all of it before the first
  forward, exposed) and ZeRO-3 with a unit per cell.

Models (:data:`MODELS`): the training benchmark's MLP (``bench.models:mlp``, 8 x Linear(1024, 1024)
+ GELU, global batch 64) and a GPT of 8 transformer blocks (``examples.gpt:model``, width 128, 4
heads, sequence 64, global batch 16: one step 100-300 ms on a quiet machine). Optimizers: AdamW on
both (its two state tensors per parameter are what ZeRO shards), SGD on the MLP.

[Note: how memory is measured] Two figures per rank, the same way for torch's processes and
cellmesh's workers:

* *peak RSS*: the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/PID/clear_refs`` before the configuration starts) less its resident size at that
  moment (``VmRSS`` of the idle process: torch imported, the process group or the worker up). It
  counts everything the configuration made: the model as first built, activations, communication
  buffers, the allocator's free lists. Every configuration runs in fresh processes (a new pair of
  torch ranks, a new harness), so no configuration inherits another's freed memory (cellmesh's
  processes keep freed buffers for reuse: ``comm/allocator.py``, which torch's ranks apply too).
* *state*: the bytes of the parameters, gradients and optimizer state a rank holds at the end of a
  step, before the next ``zero_grad``: cellmesh's ``StepReply.held_bytes``; for torch the same
  sum over the rank's tensors (FSDP2's: the local shards of its ``DTensor`` parameters,
  gradients and state; DDP's gradient buckets, a second copy of the gradients, not counted).

ZeRO-3's state target: at most ``1/N`` of the replicated plan's state, plus 5% of that share.

[Note: the rounds] Each configuration warms up (``--warmup``), then times ``--steps`` steps; a
round runs every configuration once, in groups next to the peer they are compared with (DDP:
cellmesh DP, ZeRO-1, ZeRO-2; FSDP2: ZeRO-3), groups rotated and swapped round by round (as
``bench/train.py``). Tables give the median over rounds and the spread (min-max); ratios are taken
within a round. A cellmesh configuration that fails is reported with its error and left out of
the later rounds. ``--predict`` adds the planner's prediction for each cellmesh plan beside the
measured figures: ``Plan.step_time_s`` and the fullest worker's memory (``Plan.fullest_memory``,
``coordinator/planning/memory.py``). Where a cellmesh step's time goes comes from its run record:
the compute actions and the phases (gradient all-reduce or reduce-scatter, optimizer, the
parameters' all-gather) of each timed step. Beside the wall time, the CPU time per step of every
process of a configuration (both torch ranks; both cellmesh workers, and apart the coordinator's
process), which a loaded machine moves less than the wall time.

    python bench/zero.py [--steps 10] [--warmup 3] [--rounds 3] [--quick] [--predict]
                         [--suites mlp-adamw,gpt-adamw,mlp-sgd]
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from torch import nn

from bench.rounds import parse_rounds, round_parser
from bench.train import Config, Results, _cell, _cpu_model, round_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
SEED = 0
ZERO3_TARGET = 1.25  # the least samples/s ratio of ZeRO-3 to FSDP2
ZERO12_TARGET = 1.0  # the least samples/s ratio of ZeRO-1 and ZeRO-2 to DDP
STATE_SLACK = 0.05  # ZeRO-3's state: at most (1 + slack) / N of the replicated plan's
MIB = 1 << 20
TIMEOUT_S = 900.0  # a whole configuration (spawn, warm-up, timed steps), per answer


@dataclass(frozen=True)
class ModelSpec:
    """A model, its data and loss (``module:function`` factories, as a cellmesh job names them)."""

    key: str
    label: str
    model: str
    data: str
    loss: str
    global_batch: int
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    data_kwargs: Mapping[str, Any] = field(default_factory=dict)


GPT = {"width": 128, "heads": 4, "blocks": 8, "seq": 64}
MODELS = {
    "mlp": ModelSpec("mlp", "8 x Linear(1024, 1024) + GELU (bench.models:mlp, 8.4 M parameters), "
                            "global batch 64",
                     "bench.models:mlp", "bench.models:regression", "torch.nn:MSELoss", 64),
    "gpt": ModelSpec("gpt", f"GPT of 8 transformer blocks (examples.gpt:model, width {GPT['width']}, "
                            f"{GPT['heads']} heads, sequence {GPT['seq']}, 1.66 M parameters), "
                            "global batch 16",
                     "examples.gpt:model", "examples.gpt:data", "examples.gpt:loss", 16, GPT,
                     {"seq": GPT["seq"]}),
}
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {"adamw": ("AdamW", {"lr": 1e-3}),
                                                       "sgd": ("SGD", {"lr": 0.01})}
SUITES = ("mlp-adamw", "gpt-adamw", "mlp-sgd")  # model-optimizer

# configuration -> (label, system, peer, target); cm-zN: cellmesh plan.zero N over 2 replicas (its
# default plan.gather_bytes); -b1: ZeRO-1/2's all-gather in one bucket, so all of it before the first
# forward, exposed (as the commit ran it before it went behind the forward); -c1: ZeRO-3's units a cell
# each (as before units spanned cells); -u2: units of up to 2 MiB
SHAPES: dict[str, tuple[str, str, str | None, float | None]] = {
    "ddp": ("torch DDP", "torch", None, None),
    "ddp-f": ("torch DDP, fused optimizer", "torch", "ddp", None),
    "cm-z0": ("cellmesh data parallel (zero 0)", "cellmesh", "ddp", None),
    "cm-z1": ("cellmesh ZeRO-1", "cellmesh", "ddp", ZERO12_TARGET),
    "cm-z1-b1": ("cellmesh ZeRO-1, gather in one bucket", "cellmesh", "ddp", None),
    "cm-z2": ("cellmesh ZeRO-2", "cellmesh", "ddp", ZERO12_TARGET),
    "cm-z2-b1": ("cellmesh ZeRO-2, gather in one bucket", "cellmesh", "ddp", None),
    "fsdp2": ("torch FSDP2", "torch", None, None),
    "cm-z3": ("cellmesh ZeRO-3", "cellmesh", "fsdp2", ZERO3_TARGET),
    "cm-z3-c1": ("cellmesh ZeRO-3, a unit per cell", "cellmesh", "fsdp2", None),
    "cm-z3-u2": ("cellmesh ZeRO-3, units of 2 MiB", "cellmesh", "fsdp2", None),
}
GATHER_BYTES = {"b1": 1 << 40, "c1": 1, "u2": 2 << 20}  # plan.gather_bytes of the variants


def configs(suite: str) -> list[Config]:
    """The suite's configurations, keyed ``suite:shape``, each after its peer (``round_order`` groups
    them)."""
    return [Config(f"{suite}:{shape}", label, system, peer and f"{suite}:{peer}", target)
            for shape, (label, system, peer, target) in SHAPES.items()]


def split(key: str) -> tuple[ModelSpec, str, str]:
    """``mlp-adamw:cm-z2`` -> (the MLP, ``adamw``, ``cm-z2``)."""
    suite, shape = key.split(":")
    model, opt = suite.split("-")
    return MODELS[model], opt, shape


# -- memory of a process ----------------------------------------------------------------------


def _status_bytes(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field_name}: this benchmark measures memory on Linux "
                       "only")


def start_peak(pid: int) -> int:
    """Resets ``pid``'s resident high-water mark to its resident size; returns that size (bytes)."""
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return _status_bytes(pid, "VmRSS")


def cpu_seconds(pid: int) -> float:
    """``pid``'s CPU time so far (user + system, every thread), seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_since(pid: int, base: int) -> int:
    """``pid``'s resident high-water mark less ``base`` (bytes)."""
    return _status_bytes(pid, "VmHWM") - base


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors (a ``DTensor``'s local shard), ``None`` and non-tensors skipped."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state on this rank."""
    params = list(model.parameters())
    state = (v for s in opt.state.values() for v in s.values())
    return tensor_bytes([*params, *(p.grad for p in params), *state])


# -- torch's configurations, in a fresh pair of processes each ---------------------------------


def _optimizer(name: str, params: Iterable[nn.Parameter], fused: bool = False) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    extra = {"fused": True} if fused else {}
    opt: torch.optim.Optimizer = getattr(torch.optim, cls)(params, **kwargs, **extra)
    return opt


def _torch_config(rank: int, key: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from coordinator.planning.data import BatchSampler
    from coordinator.runtime.factories import build_data, build_loss, build_model, unwrapped

    spec, opt_name, shape = split(key)
    base = start_peak(os.getpid())
    model = unwrapped(build_model(spec.model, spec.model_kwargs, SEED))
    source = build_data(spec.data, spec.data_kwargs, SEED)
    assert source.num_samples is not None
    x, y = source.load(list(range(source.num_samples)))
    sampler = BatchSampler(source.num_samples, spec.global_batch, shuffle=True, seed=SEED)
    loss_fn = build_loss(spec.loss, {})
    if shape in ("ddp", "ddp-f"):
        from torch.nn.parallel import DistributedDataParallel

        net: nn.Module = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.children():
            fully_shard(block)
        fully_shard(model)
        net = model
    opt = _optimizer(opt_name, net.parameters(), fused=shape == "ddp-f")
    share = spec.global_batch // WORLD

    def step(k: int) -> float:
        idx = torch.tensor(sampler.indices(k)[rank * share:(rank + 1) * share])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x[idx]), y[idx])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return float(loss.item())

    for k in range(warmup):
        step(k)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    last = 0.0
    for k in range(warmup, warmup + steps):
        last = step(k)
    cpu = time.process_time() - cpu
    dist.barrier()
    step_s = (time.perf_counter() - start) / steps
    held = state_bytes(net, opt)
    peak = peak_since(os.getpid(), base)
    loss = torch.tensor([last / WORLD])
    dist.all_reduce(loss)  # the mean over the global batch, as cellmesh reports it
    return {"step_s": step_s, "loss": float(loss), "peak": [peak], "held": [held], "cpu_s": cpu / steps}


def _torch_rank(rank: int, port: int, key: str, steps: int, warmup: int, results: Any) -> None:
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        results.put(("ok", rank, _torch_config(rank, key, steps, warmup)))
    except Exception as exc:  # reported by the driver, naming the rank
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_torch(key: str, steps: int, warmup: int) -> dict[str, Any]:
    """``key`` on 2 fresh spawned ranks: rank 0's step and loss, every rank's peak and state.

    Raises:
        RuntimeError: A rank failed or did not answer within :data:`TIMEOUT_S` (naming it).
    """
    import queue

    from comm.sockets import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, port, key, steps, warmup, results), daemon=True,
                         name=f"torch-rank{r}") for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        answers: dict[int, tuple[str, Any]] = {}
        for _ in range(WORLD):
            try:
                tag, rank, out = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                missing = sorted(set(range(WORLD)) - set(answers))
                raise RuntimeError(f"{key}: torch rank(s) {missing} did not answer within {TIMEOUT_S:.0f} "
                                   "s (a rank died or hangs: run the configuration alone, --only, to see "
                                   "its error)") from None
            answers[rank] = (tag, out)
        if errors := [f"rank {r}: {out}" for r, (tag, out) in sorted(answers.items()) if tag == "error"]:
            raise RuntimeError("; ".join(errors))
        first = dict(answers[0][1])
        first["peak"] = [answers[r][1]["peak"][0] for r in range(WORLD)]
        first["held"] = [answers[r][1]["held"][0] for r in range(WORLD)]
        first["cpu_s"] = sum(answers[r][1]["cpu_s"] for r in range(WORLD))
        return first
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# -- cellmesh's configurations, each on a fresh harness of 2 workers ----------------------------


def make_job(key: str) -> Any:
    """The cellmesh job of ``key``: data parallel 2, one stage, ``plan.zero`` from the key."""
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    spec, opt_name, shape = split(key)
    cls, kwargs = OPTIMIZERS[opt_name]
    zero, _, variant = shape.removeprefix("cm-z").partition("-")
    extra = {"gather_bytes": GATHER_BYTES[variant]} if variant else {}
    return Job(model=spec.model, data=spec.data, loss=spec.loss, model_kwargs=dict(spec.model_kwargs),
               data_kwargs=dict(spec.data_kwargs), optimizer=cls, optimizer_kwargs=dict(kwargs),
               global_batch=spec.global_batch, seed=SEED, resources=Resources.local(WORLD),
               step_timeout_s=120, data_parallel=WORLD, num_stages=1, num_microbatches=1, zero=int(zero),
               **extra)


@dataclass(frozen=True)
class Phases:
    """Where one cellmesh step went (seconds), on its critical replica: the one with the most compute and
    optimizer time (the other one's gradient sync includes waiting for it).

    ``compute``: forward + backward actions (under ZeRO-3 they include waiting for the cells'
    all-gathers); ``sync``: the gradients' all-reduce or reduce-scatter after the last backward;
    ``optimizer`` and ``gather``: the previous step's commit at the step's start (its optimizer
    step, the parameters' all-gather under ZeRO-1/2); ``other``: the rest of the step's wall time
    (the request and replies, the loss, the coordinator).
    """

    step: float
    compute: float
    sync: float
    optimizer: float
    gather: float

    @property
    def other(self) -> float:
        return self.step - self.compute - self.sync - self.optimizer - self.gather


def phases(record: Any) -> Phases:
    parts: dict[int, list[float]] = {}  # replica -> [compute, sync, optimizer, gather]
    for e in record.events:
        if e.action is not None:
            slot = 0 if e.action.kind in ("F", "B", "I", "W") else None
        else:
            slot = {"all_reduce": 1, "reduce_scatter": 1, "optimizer": 2, "all_gather": 3}.get(e.name)
        if slot is not None:
            parts.setdefault(e.replica, [0.0] * 4)[slot] += e.end - e.start
    compute, sync, optimizer, gather = max(parts.values(), key=lambda p: p[0] + p[2], default=[0.0] * 4)
    return Phases(step=record.seconds, compute=compute, sync=sync, optimizer=optimizer, gather=gather)


def run_cellmesh(job: Any, steps: int, warmup: int) -> dict[str, Any]:
    """``job`` on a fresh harness of 2 workers; the first step after the warm-up is left out of the timing
    (it commits the warm-up's last step alone), so each timed step carries one commit, as in
    ``bench/train.py``."""
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness

    with LocalHarness([f"local-{i}" for i in range(WORLD)], job="bench-zero", threads=1, python_path=[ROOT],
                      lease_ttl=timedelta(seconds=5), factories=job_factories(job.config)) as harness:
        pids = [harness.procs[f"local-{i}"].pid for i in range(WORLD)]
        bases = [start_peak(pid) for pid in pids]
        with job.attach(harness):
            job.fit(max(0, warmup - 1))
            cpu = [cpu_seconds(pid) for pid in pids] + [time.process_time()]  # the workers, the coordinator
            result = job.fit(steps + 1)
            cpu = [b - a for a, b in zip(cpu, [cpu_seconds(pid) for pid in pids] + [time.process_time()],
                                         strict=True)]
        peaks = [peak_since(pid, base) for pid, base in zip(pids, bases, strict=True)]
    recs = result.steps[1:]
    held = [body.held_bytes or 0 for _, body in sorted(recs[-1].replies, key=lambda r: r[0].replica)]
    return {"step_s": (recs[-1].end - recs[0].start) / steps, "loss": recs[-1].loss, "peak": peaks,
            "held": held, "phases": [phases(r) for r in recs], "cpu_s": sum(cpu[:-1]) / (steps + 1),
            "coordinator_cpu_s": cpu[-1] / (steps + 1)}


# -- the report --------------------------------------------------------------------------------


def _mib(values: list[float]) -> str:
    return _cell([v / MIB for v in values], ".1f") if values else "-"


def _per_rank(results: Results, key: str, what: str) -> list[float]:
    """Each round's largest per-rank figure (the fullest rank)."""
    return [max(r[key][what]) for r in results.rounds if key in r and what in r[key]]


def _suite_tables(suite: str, results: Results, jobs: Mapping[str, Any], predict: bool) -> list[str]:
    spec, opt_name, _ = split(f"{suite}:ddp")
    cs = configs(suite)
    labels = {c.key: c.label for c in cs}
    out = [f"### {spec.label}, {OPTIMIZERS[opt_name][0]} {OPTIMIZERS[opt_name][1]}", "",
           "| configuration | samples/s | ms/step | vs peer (samples/s) | target | peak RSS per rank, MiB "
           "| state per rank, MiB | state / replicated | loss after last step |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in cs:
        steps = results.values(c.key, "step_s")
        if not steps:
            why = results.failed.get(c.key, "not run")
            out.append(f"| {c.label} | not run: {why} | | | | | | | |")
            continue
        ratios = results.ratios(c.key, c.peer) if c.peer else []
        vs = f"{_cell(ratios, '.2f', 'x')} vs {labels[c.peer]}" if ratios and c.peer else ""
        target = ""
        if c.target is not None and ratios:
            target = f">= {c.target:.2f}x: {'met' if statistics.median(ratios) >= c.target else 'missed'}"
        replicated = f"{suite}:ddp" if c.system == "torch" else f"{suite}:cm-z0"
        held, full = _per_rank(results, c.key, "held"), _per_rank(results, replicated, "held")
        share = _cell([h / f for h, f in zip(held, full, strict=False)], ".3f") if full else "-"
        stopped = f" (stopped: {results.failed[c.key]})" if c.key in results.failed else ""
        out.append(f"| {c.label}{stopped} | {_cell([spec.global_batch / s for s in steps])} "
                   f"| {_cell([s * 1e3 for s in steps])} | {vs} | {target} "
                   f"| {_mib(_per_rank(results, c.key, 'peak'))} "
                   f"| {_mib(held)} | {share} | {_cell(results.values(c.key, 'loss'), '.6f')} |")
    out += ["", "| comparison | ratio | target | verdict |", "|---|---|---|---|"]
    for c in cs:
        if c.peer is None:
            continue
        ratios = results.ratios(c.key, c.peer)
        goal = f">= {c.target:.2f}x" if c.target is not None else "-"
        if not ratios:
            why = results.failed.get(c.key) or results.failed.get(c.peer) or "not run"
            out.append(f"| {c.label} / {labels[c.peer]} samples/s | - | {goal} | not measured: {why} |")
            continue
        verdict = "" if c.target is None else ("met" if statistics.median(ratios) >= c.target else "missed")
        out.append(f"| {c.label} / {labels[c.peer]} samples/s | {_cell(ratios, '.2f', 'x')} | {goal} "
                   f"| {verdict} |")
    fused = f"{suite}:ddp-f"
    for c in cs:  # against DDP with the fused optimizer cellmesh's workers run ([Note: the fused optimizer])
        if c.system == "cellmesh" and c.peer == f"{suite}:ddp" and (ratios := results.ratios(c.key, fused)):
            out.append(f"| {c.label} / {labels[fused]} samples/s | {_cell(ratios, '.2f', 'x')} | - | |")
    z3, z0 = _per_rank(results, f"{suite}:cm-z3", "held"), _per_rank(results, f"{suite}:cm-z0", "held")
    if z3 and z0:
        limit = (1 + STATE_SLACK) / WORLD
        shares = [a / b for a, b in zip(z3, z0, strict=False)]
        ok = max(shares) <= limit
        out.append(f"| cellmesh ZeRO-3 / data parallel state per worker | {_cell(shares, '.3f')} "
                   f"| <= {limit:.3f} (1/{WORLD} + 5%) | {'met' if ok else 'missed'} |")
    out += ["", "CPU per step (ms, user + system, every thread): torch, both ranks over the timed steps; "
            "cellmesh, both workers over the timed steps and the one before, and apart the coordinator's "
            "process (the job's driver and the harness). A ratio of the peer's CPU to this one above 1: less "
            "CPU per sample than the peer (a thread that polls while it waits counts too).", "",
            "| configuration | CPU ms per step | peer CPU / CPU | coordinator's process, CPU ms per step |",
            "|---|---|---|---|"]
    for c in cs:
        cpu = results.values(c.key, "cpu_s")
        if cpu:
            vs = ([r[c.peer]["cpu_s"] / r[c.key]["cpu_s"] for r in results.rounds
                   if c.key in r and c.peer in r and "cpu_s" in r[c.peer] and "cpu_s" in r[c.key]]
                  if c.peer else [])
            ratio = _cell(vs, ".2f", "x") if vs else ""
            coord = _cell([v * 1e3 for v in results.values(c.key, "coordinator_cpu_s")])
            out.append(f"| {c.label} | {_cell([v * 1e3 for v in cpu])} | {ratio} | {coord} |")
    out += ["", "Where a cellmesh step goes (ms, median over every timed step of every round, on the "
            "step's critical replica: the most compute + optimizer time): compute = forward + backward "
            "actions (ZeRO-3, and ZeRO-1/2 since their all-gather runs behind the forward: with the waits "
            "for the gathers); sync = the gradients' all-reduce (zero 0, 1) or reduce-scatter (2, 3) after "
            "the last backward; optimizer and all-gather = the previous step's commit; other = the rest "
            "(request, replies, coordinator).", "",
            "| configuration | step | compute | sync | optimizer | all-gather | other |",
            "|---|---|---|---|---|---|---|"]
    for c in cs:
        ph: list[Phases] = [p for r in results.rounds if c.key in r and "phases" in r[c.key]
                            for p in r[c.key]["phases"]]
        if not ph:
            continue

        def med(fn: Callable[[Phases], float], ph: list[Phases] = ph) -> str:
            return f"{statistics.median(fn(p) for p in ph) * 1e3:.1f}"

        out.append(f"| {c.label} | {med(lambda p: p.step)} | {med(lambda p: p.compute)} "
                   f"| {med(lambda p: p.sync)} | {med(lambda p: p.optimizer)} | {med(lambda p: p.gather)} "
                   f"| {med(lambda p: p.other)} |")
    if predict:
        out += ["", "The planner's prediction against the measured figures: `Plan.step_time_s`; the "
                "fullest worker's memory (`Plan.fullest_memory`): its state (parameters + gradients + "
                "optimizer state) against `held_bytes`, and its total (with activations) against the peak "
                "RSS.", "",
                "| configuration | predicted ms | measured ms | predicted / measured | predicted state MiB "
                "| measured state MiB | predicted activations MiB | predicted total MiB | peak RSS MiB |",
                "|---|---|---|---|---|---|---|---|---|"]
        for c in cs:
            steps = results.values(c.key, "step_s")
            if c.key not in jobs or not steps:
                continue
            plan = jobs[c.key].plan()
            _, use = plan.fullest_memory()
            state = use.params + use.grads + use.optimizer
            out.append(f"| {c.label} | {plan.step_time_s * 1e3:.1f} | {_cell([s * 1e3 for s in steps])} "
                       f"| {_cell([plan.step_time_s / s for s in steps], '.2f')} | {state / MIB:.1f} "
                       f"| {_mib(_per_rank(results, c.key, 'held'))} | {use.activations / MIB:.1f} "
                       f"| {use.total / MIB:.1f} | {_mib(_per_rank(results, c.key, 'peak'))} |")
    return [*out, ""]


def report(suites: list[str], results: Results, jobs: Mapping[str, Any], args: argparse.Namespace,
           elapsed: float, load: tuple[float, float]) -> str:
    out = ["# ZeRO: cellmesh against torch DDP and FSDP2, 2 processes on loopback", "",
           f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores ({_cpu_model()}), "
           f"torch {torch.__version__}, Python {platform.python_version()}; float32, 1 thread per process; "
           f"{len(results.rounds)} rounds x {args.steps} timed steps after {args.warmup} warm-up steps "
           f"(run took {elapsed:.0f} s); median (min-max) over rounds",
           f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (this run's own "
           "processes add up to 2)",
           "peak RSS: the process's resident high-water mark over the configuration less its idle resident "
           "size; state: parameters + gradients + optimizer state a rank holds after a step (see "
           "bench/zero.py); the fullest rank's figure", ""]
    for suite in suites:
        out += _suite_tables(suite, results, jobs, args.predict)
    return "\n".join(out)


def main() -> None:
    parser = round_parser(__doc__, "configuration")
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated model-optimizer pairs")
    parser.add_argument("--only", default="", help="comma-separated shapes (ddp,cm-z0,...; default: all)")
    parser.add_argument("--predict", action="store_true",
                        help="show the planner's predicted step and memory per worker beside the "
                             "measured ones")
    args = parse_rounds(parser)
    from comm.allocator import tune_malloc

    tune_malloc()
    suites = [s for s in args.suites.split(",") if s]
    for s in suites:
        split(f"{s}:ddp")  # an unknown model or optimizer fails here, before anything runs
    shapes = args.only.split(",") if args.only else list(SHAPES)
    todo = [c for s in suites for c in configs(s) if c.key.split(":")[1] in shapes]
    started, load = time.monotonic(), os.getloadavg()[0]
    results = Results()
    jobs: dict[str, Any] = {}
    for c in todo:  # plan before anything runs
        if c.system != "cellmesh":
            continue
        try:
            jobs[c.key] = make_job(c.key)
            print(f"[plan] {c.key}: {jobs[c.key].plan().summary()}", file=sys.stderr)
        except Exception as exc:  # reported; the configuration is not run
            results.failed[c.key] = f"no plan: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"[plan] {c.key}: {results.failed[c.key]}", file=sys.stderr)
    todo = [c for c in todo if c.key not in results.failed]
    for i in range(args.rounds):
        measured: dict[str, dict[str, Any]] = {}
        for c in round_order(todo, i):
            t0 = time.monotonic()
            try:
                if c.system == "torch":
                    measured[c.key] = run_torch(c.key, args.steps, args.warmup)
                else:
                    measured[c.key] = run_cellmesh(jobs[c.key], args.steps, args.warmup)
            except Exception as exc:  # reported; the configuration leaves the run
                results.failed[c.key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                print(f"[round {i + 1}/{args.rounds}] {c.key}: failed: {results.failed[c.key]}",
                      file=sys.stderr)
                continue
            m = measured[c.key]
            print(f"[round {i + 1}/{args.rounds}] {c.key}: {m['step_s'] * 1e3:.1f} ms/step, peak RSS "
                  f"{max(m['peak']) / MIB:.1f} MiB, state {max(m['held']) / MIB:.1f} MiB, "
                  f"loss {m['loss']:.6f} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
        results.rounds.append(measured)
        todo = [c for c in todo if c.key not in results.failed]
    print(report(suites, results, jobs, args, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
