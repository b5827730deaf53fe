"""Choosing a plan: enumerate shapes, predict step time and memory of each, take the fastest that fits.

A plan's *shape* is (data-parallel degree ``d``, pipeline stages ``p``, gradient mode,
schedule, microbatches ``m``). For each shape the cost model, built on the profile:

1. scales the profile to the microbatch size ``global_batch / (d * m)`` (times, activation
   and crossing bytes grow linearly with it; parameters do not) and divides compute by
   the slowest worker's ``speed``;
2. cuts the chain into ``p`` stages with the cutter, each stage within the memory of the
   workers that would run it (see ``coordinator/planning/cutting.py``);
3. plays the schedule in the simulator for the pipeline time, bubble and the microbatches
   each stage holds at its peak;
4. adds gradient synchronisation between replicas (below) and computes every worker's
   peak memory: parameters + buffers + gradients + optimizer state + held activations.

[Note: gradient sync cost] With ``G`` gradient bytes per stage, ``d`` replicas and the
slowest link of the stage's group (``bw``, ``lat``), moving a ``1/d`` share of the
gradients off every worker takes ``S = (d-1)/d * G / (e * bw)``, where ``e`` is
:data:`COLLECTIVE_EFFICIENCY`, the all-reduce's bandwidth over the link's as measured
(it depends on the transport: shared memory between processes of one host beats the
loopback figure, sockets fall short of it).

- collective: a ring all-reduce, ``2 S + 2 (d-1) lat``, launched bucket by bucket during
  the last microbatch's backward. Only the backward that runs after the first bucket
  (``FIRST_BUCKET_BYTES``, filled from the last parameters) is ready can hide it, and on a CPU
  host only as far as the host has cores to spare for the collective's own work ([Note: the sync's own
  CPU]);
- parameter server: the stage's parameters and optimizer state are sharded over its
  ``d`` workers (each keeps ``1/d`` of the optimizer state and a master copy of ``1/d``
  of the parameters). Every shard is reached through a socket, the worker's own too, so
  a push moves all ``G`` bytes (``G / (e * bw) + (d-1) lat``: each worker handles its
  ``d-1`` peers' messages one after another) and the pull as much; both happen when the
  step is committed, after the backward: nothing hides them.

Collective mode is never slower; parameter-server mode needs less memory per worker.
Among equally fast plans the planner prefers fewer workers, then collective mode, then
less memory.

[Note: step overheads] Around the schedule, a step also pays: each stage's optimizer step
(the previous step's update, applied before the first action, see
``coordinator/runtime/driver.py``), modelled as the memory traffic of a fused update
(:data:`OPTIMIZER_TRAFFIC`) at :data:`OPTIMIZER_BANDWIDTH_BPS`; two control messages
(:data:`CONTROL_MESSAGE_S` each: the request to every stage, the replies back); and, before
a stage replies, one read of its gradients (the check that they are finite, which also gives
the clipping norm) at :data:`GRADIENT_CHECK_BANDWIDTH_BPS`, the largest stage's. These are
``Plan.overhead_s``. Every transfer between stages costs each endpoint
:data:`TRANSFER_OVERHEAD_S` on top of the link's latency and bandwidth (posting the send or
receive, the transport's bookkeeping, seeing it complete: 0.2-0.4 ms per 32 KB transfer
measured, against the link's 0.11 ms).

[Note: contention on a shared host] Busy CPU workers of one host (``Worker.host``) slow each other
down: they share its cores (``Resources.host_cores``: more threads busy than cores, and each waits its
turn) and its caches and memory bandwidth. The profile is taken by one process alone, so where the plan
runs more than one CPU worker on a host, the simulator plays the schedule at the pace the host allows
([Note: shared cores] in ``coordinator/planning/simulator.py``): at any moment, ``k`` threads busy on
``c`` cores each run at ``min(1, c / k)`` of their pace, and a forward or backward at ``1 /`` the
slowdown of that again while another worker of the host is busy. Replicas of a stage run the same
timeline, so a stage with two replicas on one host is always contended; a pipeline's light stage is
contended for all its compute, its heavy one only while the light one is not waiting (which is why
balancing a pipeline's stages gains less on a shared host than the profile says); and 4 stages on 2
cores take turns on them wherever more than 2 of them are busy. The backward suffers more than the
forward: on 8-sample microbatches it streams a stage's weights and its gradients (read, accumulate,
write), twice the forward's bytes, and two stages' weights and gradients do not fit the shared cache
together. Where more workers are busy than the host has cores, each forward and backward is slowed by
:data:`SHARED_HOST_TURNS_SLOWDOWN` again (a turn on a core starts with another worker's data in its
caches). :data:`SHARED_HOST_FORWARD_SLOWDOWN` and :data:`SHARED_HOST_BACKWARD_SLOWDOWN` are those
factors, measured as in-step times over the profile's on the development machine (2 cores, quiet:
small, once the backwards are priced as the workers run them). A plan's
stages keep the forward and backward they took on average in that play (``StagePlan.forward_s``).

[Note: the backward as the schedule runs it] A stage's backward costs what its list makes its worker do
(``services/compute/weight_grads.py``, ``services/compute/executor.py``), from the profile's halves
([Note: the backward's halves] in ``coordinator/planning/profile.py``). A product of held ``W`` s over
``k`` microbatches added in place costs the profile's ``W`` at ``k`` times the microbatch (timed up to
the rows such a flush has: [Note: a flush's rows]); so does the step's first, which finds no ``.grad``:
it writes its product into the tensor the last step handed over and hands it over as it is ([Note:
handing a flush's gradients over] in ``services/compute/weight_grads.py``). One through autograd into a
``.grad`` there is (a split list's last after earlier runs, which fires the hooks) costs that plus one
microbatch's ``B - I - W`` (a new weight-sized tensor and its addition into ``.grad``, whatever the rows:
measured on 4 x Linear(1024), 2.6-2.9 ms over 8-64 rows). GPipe's ``B`` s are ``I`` s, and its one
product over every microbatch runs after the last backward's ``SEND_B``. 1F1B's (interleaved's) ``B`` s
that hold their ``W`` (every one for a replica alone; with replicas all but the first and the last, which
run plain) are ``I`` s, and the held ones are computed once their rows exceed 1/``HOLD_SHARE`` of the
stage's deferred weights' bytes, and at the end: with replicas before the last ``B``, alone after its
send. A split list's (zb-h1) runs of ``W`` s each compute their microbatches (alone: every queued one,
and none while they stay within the share), the one after the last ``I`` all that are left. The simulator
takes one backward and one ``W`` per stage, so a stage's are their mean over its list, and the work after
the last send is its tail (``StageCosts.tail_s``: the stage before does not wait for it). Mixed precision
(autocast) and profiles without halves price the plain backward. ``HOLD_SHARE`` is the executor's own
constant (``services/compute/weight_grads.py``).

[Note: several stages per worker] An interleaved shape (``chunks = v >= 2``, see [Note: interleaved
shapes] in ``coordinator/planning/request.py``) places stage ``s`` of replica ``r`` on worker
``r R + s % R``. The cutter gives each stage ``1/v`` of its worker's memory; the worker's peak is
the sum of its stages' (each at its own peak of held activations: an upper bound, the peaks need
not coincide), its unhidden gradient sync the sum of its stages', and the simulator plays its
merged order (the stages one at a time), so transfers and per-action overheads count ``v`` times.

``strategy="auto"`` searches every shape the resources allow; ``"data_parallel"`` fixes
``p = 1`` and uses at least 2 replicas (a batch that splits into none is refused),
``"pipeline"`` fixes ``d = 1`` and uses at least 2 stages (where the workers and the model
allow). The request is the job config's plan section
(:class:`~coordinator.planning.config.PlanConfig`, validated there: contradictions between its
own fields never reach the planner); its other fields fix parts of the plan. Planning first
resolves the request against the model, the workers and the batch (which fixed counts are
possible, which shapes exist: ``coordinator/planning/request.py``), then evaluates each shape.
A request that nothing satisfies raises :class:`PlanningError` saying why and what fits.

[Note: choosing the memory options] Each shape is evaluated under the memory options the request
leaves open (``coordinator/planning/memory.py``: ZeRO stage, recompute, offload), within
:data:`~coordinator.planning.memory.AUTOMATIC` (what the planner picks by itself), and under those it
fixes.
The options share the shape's work: the schedule, and per recompute setting the cut that ignores
memory and its simulation. An option takes that cut when it fits its memory (each option has its
own: the cutter's limit depends on it), else the cutter's best cut within its memory; each cut is
simulated once, with the replicated optimizer steps at the start of each stage. An option that
shrinks (ZeRO: ``1/F``) or moves (offload) a stage's optimizer step starts the stage earlier: the
step is the simulation's minus the least any rank saves (its stages' steps run before its first
action), plus the option's unhidden sync (``coordinator/planning/sharding.py``) and the messages.
So ZeRO and offload cost a shape no simulation when its compute-optimal cut fits, and recompute
(which changes the stage times: each backward pays its forward again) one more cut and simulation,
only for a shape where no option without recompute fits with the compute-optimal cut (recompute
adds compute there and frees memory nobody needs). ``exhaustive=True`` evaluates recompute
everywhere: the tests check that both choose the same plan.

[Note: the fast search] ``choose_plan`` does not play every shape. It takes a replicated plan
without recompute whenever one fits, so it first looks for the best of those by branch and bound, on
bounds each tighter and dearer than the one before (``_bound_order``):

1. every shape, before any cut or placement, gets a bound over every cut (``_cut_free_bounds``, one
   numpy pass over all the shapes: [Note: the bound over every cut] in
   ``coordinator/planning/closed_form.py`` on the chain's totals at the shape's microbatch size, on the
   fastest worker and link; a shared host's slowdown where every placement has it, more replicas of a
   stage than hosts of CPU workers; the optimizer steps' mean per rank; the sync's mean per rank, its
   backward, stretched as much as a host can, hiding all it can; the overheads; and where every worker
   is a CPU worker of one host, the work of all the shape's workers over its cores, [Note: the host's
   cores bound]: without it, a shape of more workers than cores gets a first bound far below its step,
   and every such shape is cut and placed), and the shapes are sorted by it once;
2. a shape that comes up gets its placement (shared by the shape's two modes) and the bound of
   :func:`_placed_bound`: on hosts of CPU workers, the whole chain's work slowed over the ranks and
   their homes ([Note: a crowded host, before the cut]), with the least fill and drain any cut leaves a
   pipeline of one stage a rank ([Note: a pipeline's fill, before the cut]) and every stage's fill at
   the paces of the stages before it ([Note: a pipeline's fill at its stages' paces] in
   ``closed_form.py``), and waits in the heap under it;
3. a shape that comes up again gets its cut ignoring memory (computed once per stages,
   microbatch size, recompute, link and speed, and shared by the modes and schedules), first bounded
   from its stages' compute alone ([Note: a cut's chains, bounded first]), then (each time it comes up
   again) but for ZB-H1 a quicker bound with it ([Note: the cut, bounded quickly]), then the bound of
   ``closed_form.rank_bounds`` from the stage costs the simulator would be given (a shared host's
   slowdown where it is certain: replicas on one host; on a host whose workers are busy together, the
   least it costs them, [Note: a crowded host's slowdown] in ``simulator.py``; the sync as if the whole
   backward hid it), and
   waits in the heap under it; where that cut does not fit memory the bounds take the cutter's cut within
   memory, the one the play takes ([Note: a cut within memory, bounded]), and a shape whose chain fits no
   cut at all (``cutting.may_fit``), or none the cutter finds, leaves the search;
4. a shape that comes up after its bounds with the cut is played in the simulator, exactly as the
   exhaustive search plays it.

The search stops when the next bound exceeds the best step played (by more than
:data:`_BOUND_SLACK`): no shape left can win or tie, so the plan is the exhaustive search's, with its
predicted step. Ties among played shapes go as there: ``_rank``, then the enumeration order. On
1,000 nodes over 1,024 workers, 106,608 shapes get the first bound, about a hundred the second and
eight are played. Only when no replicated plan fits does the search evaluate the memory options of
the shapes, in the order of a bound that holds for all of them ([Note: a search where nothing replicated
fits]). What the shapes share is computed once per search (:class:`_Shared`): node times, the
cut bytes rescaled, node memory per option, cut problems, the links.
``exhaustive=True`` plays every shape: the reference the tests compare against.

[Note: a flat search] Where many shapes' bounds sit just under the best step played, each must be played
to be ruled out: on 1,000 uneven nodes over 1,024 workers of one host of 2 cores, every shape's step is
the host's work over its cores to within 0.1%, and the search played 2,494 shapes (44 s) to find the one
0.01% quicker than the first that fit. So after :data:`_EXACT_PLAYS` plays or :data:`_EXACT_CUTS` bounds
with a cut, the search stops at the first bound within :data:`_SEARCH_GAP` (1%) of the best step played:
every shape left is then at most that much quicker, a fifteenth of the cost model's own error (it
predicts a measured step within 15%: docs/benchmarks.md, "Training"). A search that finds its plan within
that effort is exact, as every search of the tests' grids is. The gap was 0.1%: on 1,000 nodes over 128
hosts of 8 CPU workers the finalists' bounds sit 0.1-1.6% under their steps, and the search played 10
of them (a third of its time) where it plays 4 at 1%. On every list of docs/benchmarks.md, "Planning",
the searches with no gap, with 0.1% and with 1% chose the same plans, but on one host of 2 cores, where
both gaps chose one 0.04% slower than the exact search's. A search for the runners-up (``cellmesh plan``)
runs the same events, keeps the plan the search for the best stops at as its first, and goes on to fill
its list: a runner-up may then be quicker than the first, within the gap.

[Note: the memory floor] Before a model is profiled (or even allocated), its cells' bytes
(parameters, buffers, and the gradients and optimizer state of the trainable ones) tell
the least static memory any plan puts on its fullest worker: :func:`memory_floor` takes,
over every replica count ``d`` and the most stages ``p`` the workers and cells allow, the
best contiguous split of the cells' static bytes as :func:`cut_problem` counts them
(parameter-server mode shards ``1/d`` of the optimizer state and a master copy; the ZeRO stages
the planner may use shard over all ``d`` replicas, ZeRO-3 with its gathered cells on one stage;
offload, where it may be used, takes the optimizer state out). Activations
only add to it, so a model whose floor exceeds the largest worker fits no plan:
:func:`check_memory_floor` refuses it in seconds instead of after profiling it.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast, get_args

import numpy as np

from comm.heap import frozen
from coordinator.planning import memory
from coordinator.planning.closed_form import (
    BUSIEST,
    FILL,
    FILL_AND_DRAIN,
    KINDS,
    cut_free_bound,
    paced_fill_bound,
    rank_bounds,
    stage_bounds,
)
from coordinator.planning.config import Mode, PlanConfig
from coordinator.planning.cutting import (
    MEMORY_SLACK,
    CutError,
    CutProblem,
    Cutter,
    cut_min_max,
    floor_fits,
    get_cutter,
    may_fit,
    with_slack,
)
from coordinator.planning.graph import CutInfo
from coordinator.planning.memory import (
    AUTOMATIC,
    REPLICATED,
    ZERO3_GATHERED_UNITS,
    Automatic,
    MemoryOption,
    NodeMemory,
    memory_options,
    node_memory,
    replicated_static,
)
from coordinator.planning.placement import PlacedLinks, grids, neighbour_link, place_with_links, step_traffic
from coordinator.planning.plan import Plan, StagePlan
from coordinator.planning.profile import (
    OPTIMIZER_STATE_FACTORS,
    NodeProfile,
    NodeTable,
    Profile,
    format_bytes,
)
from coordinator.planning.request import PlanningError, Shape, plan_shapes, resolve
from coordinator.planning.resources import Resources, Worker
from coordinator.planning.schedules import (
    UNSPLIT_CHUNKED,
    schedule_steps,
    stage_holds,
    stage_kind_counts,
    stage_kinds,
)
from coordinator.planning.sharding import gradient_collectives, optimizer_s, sharded_sync
from coordinator.planning.simulator import (
    DEFAULT_WEIGHT_FRACTION,
    Sharing,
    StageCosts,
    Timing,
    play,
)
from coordinator.planning.worker_table import WorkerTable
from services.compute.weight_grads import HOLD_SHARE
from services.params.grad_sync import FIRST_BUCKET_BYTES

__all__ = ["COLLECTIVE_EFFICIENCY", "CONTROL_MESSAGE_S", "GRADIENT_CHECK_BANDWIDTH_BPS",
           "OPTIMIZER_BANDWIDTH_BPS", "OPTIMIZER_TRAFFIC", "SHARED_HOST_BACKWARD_SLOWDOWN",
           "SHARED_HOST_FORWARD_SLOWDOWN", "SHARED_HOST_TURNS_SLOWDOWN", "SYNC_CPU_BPS",
           "TRANSFER_OVERHEAD_S", "Candidate", "CellBytes",
           "balance_bounds", "candidate_plans", "check_memory_floor", "choose_plan", "cut_problem",
           "format_candidates", "memory_floor", "repriced", "shared_cores"]

T = TypeVar("T")
_SEARCH_ALL = PlanConfig()  # nothing fixed
# how the search runs and what every plan computes in, not a shape it is asked to fix
_SEARCH_FIELDS = {"cutter", "max_microbatches", "precision"}


@dataclass(frozen=True)
class Candidate:
    """One evaluated shape: its plan (None if no cut exists) and why it does not fit ("" if it does)."""

    data_parallel: int
    num_stages: int
    mode: Mode
    schedule_name: str
    num_microbatches: int
    plan: Plan | None
    reason: str
    chunks: int = 1  # stages per worker (interleaved-1f1b)
    option: MemoryOption = REPLICATED  # how its workers save memory

    @property
    def fits(self) -> bool:
        return self.plan is not None and not self.reason

    @property
    def step_time_s(self) -> float:
        return self.plan.step_time_s if self.plan is not None else math.inf


def _transfer(nbytes: float, bandwidth: float, latency: float) -> float:
    """What moving ``nbytes`` between two stages costs each endpoint (see [Note: step overheads])."""
    return 0.0 if nbytes <= 0 else TRANSFER_OVERHEAD_S + latency + nbytes / bandwidth


# The all-reduce's bandwidth over the link bandwidth of the resource list: a process sends and
# receives at once. Measured on the development machine (2 vCPUs, docs/benchmarks.md): 34 MB
# all-reduce in about 11 ms inside a data-parallel step (~3 GB/s) over the shared-memory
# transport, whose link figure is LOCAL_BANDWIDTH_BPS (coordinator/planning/resources.py).
COLLECTIVE_EFFICIENCY = 0.85
# A control message from the coordinator to a stage's step thread, or a reply back: 0.5-0.9 ms
# measured (bench/train.py "dispatch" and "tail"): more than the link latency, as each end
# validates and dispatches it. Within a window of steps ([Note: a window of steps] in
# services/protocol/compute.py) the stages' own exchange takes its place: timed on each worker of data
# parallel 2 and 1F1B 2x8 (bench/train.py, 2026-11-30), the reply's making 0.74-0.91 ms, the turn to
# the verdict 0.36-0.45 ms, the verdict 0.64-1.35 ms and the next step's start 0.15 ms: 1.9-2.8 ms a
# step, two of these.
CONTROL_MESSAGE_S = 1.1e-3
# A fused optimizer step reads and writes this many bytes per parameter byte, by the
# optimizer kinds of coordinator/planning/profile.py (parameter, gradient and state each read, the
# parameter and state written); at 25 GB/s it matched the 1.7-4.1 ms of SGD over 17-34 MB timed
# alone. Inside bench/train.py's steps (2026-11-30, the update's "optimizer" phase, its gradients
# cold since the backward) SGD took 6.4 ms over 34 MB on one worker and 6.9 ms on each of data
# parallel's two, 3.1-3.5 ms over 17 MB and 1.5-2.1 ms over 8.5 MB on each pipeline stage: ~16 GB/s.
# Left at 25 GB/s: at 16 the planner moved pipelines with replicas under Adam to the parameter server
# (its update split over the replicas), which nothing measured yet says is faster.
OPTIMIZER_TRAFFIC: dict[str, float] = {"sgd": 3.0, "momentum": 5.0, "adam": 7.0, "adamw": 7.0}
OPTIMIZER_BANDWIDTH_BPS = 25e9
# Compute while another CPU worker of the host computes, against the profile taken by one
# process alone (see [Note: contention on a shared host]). Once each schedule's backwards were
# priced as its workers run them ([Note: the backward's halves] in profile.py), the quiet run of
# bench/train.py on the development machine (2 cores, docs/benchmarks.md) put every 2-process plan's
# in-step forwards and backwards within 5-15% of the profile's: 1.05 and 1.15 keep all its 11 plans
# within 0.87-1.14 of their measured steps (the 1.15 and 1.6 measured before, at a load average of
# 4-5, were the other engineers' load as much as this host's second worker).
SHARED_HOST_FORWARD_SLOWDOWN = 1.05
SHARED_HOST_BACKWARD_SLOWDOWN = 1.15
SHARED_HOST_TURNS_SLOWDOWN = 1.2
"""A forward's or backward's pace divided by this again, throughout, on a host whose placed workers want more
cores than it has: they take turns on the cores, and a turn finds the caches holding another worker's
weights (throughout, not only while more are busy than the cores: a slower pace of the rank, which every
bound of the search keeps, where a pace that depends on the moment left them 20% under). Fitted on
bench/train.py's 4-stage pipelines on 2 cores: their measured steps, against the same run's 2-stage ones,
were 14-15% longer than the model without it predicted (three runs), while the simulator at the pace of
shared cores fed each worker's own CPU seconds matched the 4-stage steps as closely as the 2-stage ones
(1.03-1.12 against 1.19-1.21): the work per action grew, not the schedule's waits."""
# Each endpoint's own cost of one transfer between stages, beyond the link's latency and
# bandwidth (see [Note: step overheads]): the executor posts it, the transport tracks it and
# the next action boundary sees it complete; 0.2-0.4 ms per 32 KB transfer measured on the
# development machine against the 0.11 ms the link figures give.
TRANSFER_OVERHEAD_S = 2e-4
# [Note: the sync's own CPU] A CPU worker's gradient collectives are work for its cores, not only time
# on the link: the ring copies each chunk into and out of the transport and adds the received ones (with
# the shared-memory transport of one host, nothing but that work). A backward hides them only where the
# host has a core to spare for the communication thread; where the workers' compute threads already want
# every core of the host (the default: a local job's workers together have the machine's cores), the
# collectives take turns with the backward, and a step is as long as the two together. So a stage's
# collectives during its last backward leave at least their CPU time, the bytes each rank moves over
# SYNC_CPU_BPS, unhidden, times the share of its host's sync threads that find no spare core (cores less
# the shape's workers' threads, over its workers). Measured on the development machine (2 cores, quiet,
# bench/train.py): data parallel over 2 workers of bench.models:mlp (34 MB of gradients, one all-reduce
# moving 34 MB per rank) spent 15.5-16 ms of its communication thread's CPU per step, and its 32-sample
# forward and backward took 32.7 ms instead of the profile's 24-27 ms, with 10.4 ms of all-reduce left
# after the backward: the model that hid the all-reduce behind the backward predicted 0.83 of the step.
# A pipeline's stages sync only at the step's end, so counting every worker of the host as busy then
# overstates the contention of a pipeline with replicas (one stage's replicas may sync while another's
# idle in its bubble); GPU workers sync with NCCL and are never counted, nor are workers whose host's
# cores are not given (``Worker.host_cpus``; ``Resources.local`` gives them), as elsewhere in the model.
# A parameter server's pushes and pulls, which no backward hides anyway, are as much CPU work per byte:
# they cost at least the 2 G bytes each worker moves at SYNC_CPU_BPS, as much of it as the same share of
# starved threads, so collective mode, which moves 2 (d-1)/d G, stays the faster of the two.
SYNC_CPU_BPS = 2.1e9
# The read of a stage's gradients before it replies (finite? and their squared norm), in bytes
# per second: 1.2-1.4 ms for 17 MB measured when it came (the step's tail grew by that much); timed on
# each worker inside bench/train.py's steps (2026-11-30, another worker busy beside it), 1.9-2.3 ms for
# 17 MB (1F1B 2x8) and 4.1-4.2 ms for 34 MB (data parallel 2): ~8 GB/s.
GRADIENT_CHECK_BANDWIDTH_BPS = 8e9


def _sync(mode: Mode, grad_bytes: float, d: int, hidden: float, bw: float, lat: float) -> float:
    """Gradient sync time not hidden (``hidden``: the backward after the first bucket is ready)."""
    if d == 1 or grad_bytes == 0:
        return 0.0
    bandwidth = COLLECTIVE_EFFICIENCY * bw  # see [Note: gradient sync cost]
    if mode == "collective":
        return max(0.0, 2 * ((d - 1) / d * grad_bytes / bandwidth + (d - 1) * lat) - hidden)
    return 2 * (grad_bytes / bandwidth + (d - 1) * lat)


def _after_first_bucket(grads: Sequence[float], backward: Sequence[float]) -> float:
    """The backward time left once the first bucket is ready (nodes' gradients fill it from the last): the
    first bucket of ``services/params/grad_sync.py`` is small (``FIRST_BUCKET_BYTES``), and a parameter of
    that size goes alone, so the collectives start with the backward's first large gradient."""
    need = min(float(FIRST_BUCKET_BYTES), sum(grads))
    filled = 0.0
    for i in reversed(range(len(grads))):
        filled += grads[i]
        if filled >= need:
            return sum(backward[:i])
    return 0.0


@dataclass(frozen=True)
class _CutTensors:
    """Every cut's tensors as integer columns, for :func:`_scaled_bytes` at any size in one numpy pass."""

    cut: np.ndarray  # each tensor's cut
    nbytes: np.ndarray
    rows: np.ndarray  # along its batch dimension (0: none)
    grad: np.ndarray  # whether it needs a gradient
    num_cuts: int

    @classmethod
    def of(cls, profile: Profile) -> _CutTensors:
        tensors = [(c, t) for c, cut in enumerate(profile.cuts) for t in cut.tensors]
        return cls(np.array([c for c, _ in tensors], dtype=np.int64),
                   np.array([t.nbytes for _, t in tensors], dtype=np.int64),
                   np.array([0 if t.batch_dim is None else t.shape[t.batch_dim] for _, t in tensors],
                            dtype=np.int64),
                   np.array([t.requires_grad for _, t in tensors], dtype=bool), len(profile.cuts))


def _scaled_bytes(profile: Profile, size: int, table: _CutTensors | None = None
                  ) -> tuple[list[int], list[int]]:
    """Per cut at microbatch ``size``: its tensors' bytes and those of the ones needing gradients (what
    ``TensorMeta.at_batch`` gives them, without building the rescaled tensors), the same integers."""
    t = table if table is not None else _CutTensors.of(profile)
    base = profile.microbatch_size
    nbytes = t.nbytes
    if size != base:
        batched = t.rows > 0
        scaled = nbytes // np.maximum(1, t.rows) * (t.rows * size // base)
        nbytes = np.where(batched, scaled, nbytes)
    fwd = np.zeros(t.num_cuts, dtype=np.int64)
    bwd = np.zeros(t.num_cuts, dtype=np.int64)
    np.add.at(fwd, t.cut, nbytes)
    np.add.at(bwd, t.cut[t.grad], nbytes[t.grad])
    return fwd.tolist(), bwd.tolist()


def cut_problem(profile: Profile, num_stages: int, *, microbatch_size: int | None = None,
                bandwidth_bps: float, latency_s: float, speed: float = 1.0, data_parallel: int = 1,
                mode: Mode = "collective", in_flight: Sequence[int] | None = None,
                memory_limit: Sequence[float] | None = None, defers: Sequence[bool] | None = None,
                option: MemoryOption = REPLICATED, num_microbatches: int = 1, on_cuda: bool = False
                ) -> CutProblem:
    """The cutter's view of a profile (see [Note: transfer cost] in ``coordinator/planning/cutting.py``).

    Args:
        profile: The model's profile.
        num_stages: Stages to cut into.
        microbatch_size: Scales times (affine, ``Profile.node_times``) and activation bytes
            (linearly); default: the profiled size.
        bandwidth_bps: Link bandwidth between consecutive stages.
        latency_s: Link latency between consecutive stages.
        speed: Worker speed relative to the profiling machine.
        data_parallel: Replicas per stage (shards parameter-server state).
        mode: Gradient path; parameter-server mode shards optimizer state ``1/d``.
        in_flight: Microbatches each stage holds at its peak (with ``memory_limit``).
        memory_limit: Bytes each stage's worker may use; None ignores memory.
        defers: Per stage, whether it defers its linear layers' weight gradients (its schedule's list:
            ``services.compute.weight_grads.defers``); None: no stage does.
        option: How the workers save memory (``coordinator/planning/memory.py``); recompute makes
            each backward pay its forward again.
        num_microbatches: Per step (sharded gradients accumulate whole over several).
        on_cuda: Whether the workers run on CUDA (offload saves only there).
    """
    return _Shared(profile).problem(
        num_stages, microbatch_size or profile.microbatch_size, bandwidth_bps=bandwidth_bps,
        latency_s=latency_s, speed=speed, data_parallel=data_parallel, mode=mode, in_flight=in_flight,
        memory_limit=memory_limit, defers=defers, option=option, num_microbatches=num_microbatches,
        on_cuda=on_cuda)


class _Shared:
    """What the shapes of one search share, computed once ([Note: the fast search]): per microbatch size
    the node times, the cut tensors rescaled, every node's memory per option; the links of a group of
    workers; the cut that ignores memory per (stages, microbatch size, recompute, link, speed)."""

    def __init__(self, profile: Profile, resources: Resources | None = None) -> None:
        self.profile = profile
        self.resources = resources
        self.by_name = {w.name: w for w in resources.workers} if resources is not None else {}
        self._memo: dict[tuple[object, ...], object] = {}
        self.table = NodeTable(profile.nodes)  # every node priced at a size in one pass
        self.free_cuts: dict[tuple[object, ...], tuple[int, ...] | str] = {}
        # the cutter's cut within memory per problem (the problems live in ``_memo``: their ids stay theirs)
        self.memory_cuts: dict[tuple[object, ...], tuple[int, ...] | None] = {}
        # how often the cut ignoring memory was checked against a shape's limits, and did not fit them
        # ([Note: memory binding, cut within it at once])
        self.checked = self.bound = 0

    @functools.cached_property
    def fastest(self) -> float:
        """The fastest worker's speed (the bounds' optimizer steps run at it)."""
        return max(w.speed for w in self.by_name.values())

    @functools.cached_property
    def grad_bytes(self) -> float:
        """Every node's gradient bytes together."""
        return float(sum(nd.grad_bytes for nd in self.profile.nodes))

    def _get(self, key: tuple[object, ...], make: Callable[[], T]) -> T:
        if key not in self._memo:
            self._memo[key] = make()
        return cast(T, self._memo[key])

    def times(self, mb: int) -> list[tuple[float, float]]:
        """Every node's forward (warm: [Note: a warm forward] in profile.py) and backward at ``mb``."""
        def make() -> list[tuple[float, float]]:
            scale = mb / self.profile.microbatch_size
            warm, backward = self.table.warm_at(scale).tolist(), self.table.times_at(scale)[1].tolist()
            return list(zip(warm, backward, strict=True))
        return self._get(("times", mb), make)

    def cold(self, mb: int) -> list[float]:
        """Every node's forward at ``mb`` with its weights cold, less the warm one: once per step."""
        def make() -> list[float]:
            scale = mb / self.profile.microbatch_size
            extra = np.maximum(0.0, self.table.times_at(scale)[0] - self.table.warm_at(scale))
            return [float(x) for x in extra]
        return self._get(("cold", mb), make)

    def halves(self, mb: int) -> list[tuple[float, float]]:
        """Every node's ``I`` and ``W`` at microbatch ``mb`` ([Note: the backward's halves] in profile.py)."""
        def make() -> list[tuple[float, float]]:
            i, w = self.table.halves_at(mb / self.profile.microbatch_size)
            return list(zip(i.tolist(), w.tolist(), strict=True))
        return self._get(("halves", mb), make)

    def columns(self, mb: int) -> tuple[list[float], list[float], list[float]]:
        """Every node's forward, backward and ``I`` at ``mb`` as lists of their own (:meth:`times`,
        :meth:`halves`): a stage's sum is ``sum(column[a:b])``, the same floats in the same order as summing
        the pairs, without a generator per stage."""
        def make() -> tuple[list[float], list[float], list[float]]:
            times, halves = self.times(mb), self.halves(mb)
            return [f for f, _ in times], [b for _, b in times], [i for i, _ in halves]
        return self._get(("columns", mb), make)

    def weight_sum(self, mb: int, start: int, stop: int) -> float:
        """The ``W`` s of nodes ``[start, stop)`` at microbatch ``mb``, summed in node order (as a stage's
        held products are priced for each count of microbatches: asked again by every shape with that cut)."""
        key = ("weight sum", mb, start, stop)
        got = self._memo.get(key)
        if got is None:
            if ("halves", mb) in self._memo:
                got = sum(x for _, x in self.halves(mb)[start:stop])
            else:  # a product's rows: every node's W at once, kept as an array (a size asked of few spans)
                scale = mb / self.profile.microbatch_size
                weights = self._get(("W at", mb), lambda: self.table.halves_at(scale)[1])
                got = sum(weights[start:stop].tolist())
            self._memo[key] = got
        return cast(float, got)

    def holding(self) -> tuple[list[int], list[int]]:
        """Per node, its part of :func:`held_limit`'s weight bytes and the rows it holds for a deferred ``W``
        at the profiled microbatch."""
        nodes = self.profile.nodes
        return self._get(("holding",), lambda: ([_holding_bytes(nd) for nd in nodes],
                                                [nd.deferred_bytes for nd in nodes]))

    def autograd_extra(self, mb: int, start: int, stop: int) -> float:
        """What a product of held ``W`` s costs nodes ``[start, stop)`` more through autograd than in place:
        one microbatch's plain backward less its ``I`` and ``W`` (a new weight-sized gradient tensor and
        the pass adding it into ``.grad``, whatever the rows; at least 0). See [Note: the backward as the
        schedule runs it]."""
        extra = self._get(("autograd extra", mb), lambda: [
            max(0.0, b - i - w) if nd.split else 0.0
            for nd, (_, b), (i, w) in zip(self.profile.nodes, self.times(mb), self.halves(mb), strict=True)])
        return sum(extra[start:stop])

    def backward_range(self, mb: int) -> list[tuple[float, float]]:
        """Per node, the least and the most one microbatch's backward costs it in any list (see
        :func:`_backwards`): a plain ``B``, ``I`` and ``W``, or ``I`` and a ``k``-th of a product over ``k``
        microbatches (at least nothing; at most one microbatch's ``W`` with :meth:`autograd_extra`, or
        ``B - I`` 's fixed part and its part that grows with the microbatch, each where positive)."""
        def make() -> list[tuple[float, float]]:
            t = self.table
            b = np.array([x for _, x in self.times(mb)], dtype=np.float64)
            i, w = (np.array(x, dtype=np.float64) for x in zip(*self.halves(mb), strict=True))
            b0, i0 = t.b0, np.where(t.split, t.i0, t.b0)
            shared_w = i + np.maximum(0.0, b0 - i0) + np.maximum(0.0, (b - b0) - (i - i0))
            most = np.maximum(np.maximum(b, i + w + np.maximum(0.0, b - i - w) * t.split), shared_w)
            return list(zip(np.minimum(b, i).tolist(), most.tolist(), strict=True))
        return self._get(("backward range", mb), make)

    def scaled(self, mb: int) -> tuple[list[int], list[int]]:
        """Per cut at microbatch ``mb``: its bytes, the bytes of the tensors needing gradients."""
        table = self._get(("cut tensors",), lambda: _CutTensors.of(self.profile))
        return self._get(("scaled", mb), lambda: _scaled_bytes(self.profile, mb, table))

    def cut_at(self, index: int, mb: int) -> CutInfo:
        """Cut ``index`` with its tensors at microbatch ``mb``."""
        return self._get(("cut", index, mb), lambda: self.profile.cuts[index].model_copy(
            update={"tensors": tuple(t.at_batch(mb, self.profile.microbatch_size)
                                     for t in self.profile.cuts[index].tensors)}))

    def sums(self, mb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Prefix sums over the nodes at microbatch ``mb``: forward and the least backward seconds
        (:meth:`backward_range`), gradient and parameter bytes (a stage's is a difference: the bounds'
        rounding, not the plan's)."""
        def make() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            times = self.times(mb)
            nodes = self.profile.nodes
            def prefix(x: Sequence[float]) -> np.ndarray:
                return np.concatenate([[0.0], np.cumsum(np.asarray(x, dtype=np.float64))])
            least = [lo for lo, _ in self.backward_range(mb)]  # the bounds': the least any list pays
            return (prefix([f for f, _ in times]), prefix(least),
                    prefix([nd.grad_bytes for nd in nodes]), prefix([nd.param_bytes for nd in nodes]))
        return self._get(("sums", mb), make)

    def kinds(self, name: str, num_stages: int, num_microbatches: int, chunks: int
              ) -> tuple[tuple[str, ...], ...]:
        """:func:`stage_kinds` of a schedule, once per search (its modes and replica counts ask again; a
        ZB-H1 list of 128 stages and 64 microbatches holds 57,000 kinds, so they go with the search)."""
        return self._get(("kinds", name, num_stages, num_microbatches, chunks),
                         lambda: stage_kinds(name, num_stages, num_microbatches, chunks))

    def kind_counts(self, name: str, num_stages: int, num_microbatches: int, chunks: int
                    ) -> tuple[tuple[int, int, int], ...]:
        """Per stage of :meth:`kinds`, how many ``B``, ``I`` and ``W`` its list runs (once per search)."""
        def make() -> tuple[tuple[int, int, int], ...]:
            known = stage_kind_counts(name, num_stages, num_microbatches, chunks)
            return known if known is not None else tuple(
                (kinds.count("B"), kinds.count("I"), kinds.count("W"))
                for kinds in self.kinds(name, num_stages, num_microbatches, chunks))
        return self._get(("kind counts", name, num_stages, num_microbatches, chunks), make)

    def spreads(self, replicas: int, ranks: int) -> list[tuple[tuple[float, float, float], float]] | None:
        """:func:`_spread_of` of every grid the placement may give ``replicas`` x ``ranks``
        (``placement.grids``); None where one of them has none, or the list has no host of CPU workers
        holding two ([Note: the homes' cores, before the placement])."""
        resources = self.resources
        assert resources is not None

        def make() -> list[tuple[tuple[float, float, float], float]] | None:
            table = resources.worker_table
            spreads = []
            for grid in grids(resources, replicas, ranks):
                rows = table.indices([name for row in grid for name in row]).reshape(replicas, ranks).T
                spread = _spread_of(resources, rows)
                if spread is None:
                    return None
                spreads.append(spread)
            return spreads
        if not self.crowds:
            return None
        return self._get(("spreads", replicas, ranks), make)

    @functools.cached_property
    def crowds(self) -> bool:
        """Whether some host holds two CPU workers (else no placement shares a host's cores)."""
        assert self.resources is not None
        table = self.resources.worker_table
        hosts = table.host[table.cpu & (table.host >= 0)]
        return bool(len(hosts)) and int(np.bincount(hosts).max()) > 1

    def placed(self, placement: tuple[tuple[str, ...], ...], num_stages: int,
               links: PlacedLinks | None = None) -> _Placed:
        """The workers of ``placement`` (one per placement: many shapes share it); ``links``: its links as
        the placement found them, if it did."""
        return self._get(("placed", placement), lambda: _Placed(self, placement, num_stages, links))

    def link(self, names: Sequence[str]) -> tuple[float, float]:
        """The slowest link among ``names`` (it depends on the set only)."""
        assert self.resources is not None
        resources = self.resources
        return self._get(("link", frozenset(names)), lambda: resources.slowest_link(list(names)))

    def memory(self, option: MemoryOption, mode: Mode, data_parallel: int, num_microbatches: int, mb: int,
               on_cuda: bool) -> NodeMemory:
        scale = mb / self.profile.microbatch_size
        nodes = self.profile.nodes
        # the node memory reads the mode and the replicas for parameter servers only, the count for > 1
        key = ("memory", option, mode if data_parallel > 1 else "collective", data_parallel,
               num_microbatches > 1, on_cuda)
        # the microbatch's part apart: the rest is the same at every size (NodeMemory.with_activations)
        whole = self._get(key, lambda: node_memory(
            nodes, option, mode=mode, data_parallel=data_parallel, num_microbatches=num_microbatches,
            activation_bytes=[0.0] * len(nodes), input_bytes=[0.0] * len(nodes), on_cuda=on_cuda))
        return self._get((*key, mb), lambda: whole.with_activations(
            option.recompute, [nd.activation_bytes * scale for nd in nodes], self.scaled(mb)[0][:-1]))

    def static_sum(self, mode: Mode, data_parallel: int) -> float:
        """Every node's replicated static bytes together (``memory.replicated_static``)."""
        fixed, shared = self._get(("static sums", mode == "parameter_server" and data_parallel > 1),
                                  lambda: replicated_static(self.profile.nodes, mode, data_parallel))
        return fixed + shared / data_parallel

    def compute(self, mb: int, recompute: bool, speed: float, bandwidth_bps: float,
                latency_s: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The cutter's per-node compute and per-cut transfer times."""
        def make() -> tuple[tuple[float, ...], tuple[float, ...]]:
            fwd_bytes, bwd_bytes = self.scaled(mb)
            cut_s = tuple(_transfer(f, bandwidth_bps, latency_s) + _transfer(b, bandwidth_bps, latency_s)
                          for f, b in zip(fwd_bytes, bwd_bytes, strict=True))
            twice = 2 if recompute else 1  # the backward pays the forward again
            return tuple((twice * f + b) / speed for f, b in self.times(mb)), cut_s
        return self._get(("compute", mb, recompute, speed, bandwidth_bps, latency_s), make)

    def problem(self, num_stages: int, mb: int, *, bandwidth_bps: float, latency_s: float, speed: float,
                data_parallel: int, mode: Mode, in_flight: Sequence[int] | None,
                memory_limit: Sequence[float] | None, defers: Sequence[bool] | None, option: MemoryOption,
                num_microbatches: int, on_cuda: bool, holds: Sequence[bool] | None = None,
                pace: tuple[float, ...] | None = None) -> CutProblem:
        """:func:`cut_problem` from the shared parts (one per its arguments: modes and schedules share it);
        ``holds``: per stage, whether it holds its backwards' weight gradients (1F1B in fp32: see
        :func:`hold_bytes`); ``pace``: per stage, its compute's pace against ``speed`` (:func:`_pace`)."""
        # parameter servers' memory reads the replicas; collective replicas only whether there are several
        # (the transport's frames: [Note: the transport's frames] in memory.py)
        replicas = data_parallel if mode != "collective" else int(data_parallel > 1)
        key = ("problem", num_stages, mb, bandwidth_bps, latency_s, speed, replicas, mode,
               None if in_flight is None else tuple(in_flight),
               None if memory_limit is None else tuple(memory_limit),
               None if defers is None else tuple(defers), option, num_microbatches > 1, on_cuda,
               None if holds is None or not any(holds)
               else (tuple(holds), data_parallel > 1, num_microbatches), pace)
        return self._get(key, lambda: self._problem(
            num_stages, mb, bandwidth_bps=bandwidth_bps, latency_s=latency_s, speed=speed,
            data_parallel=data_parallel, mode=mode, in_flight=in_flight, memory_limit=memory_limit,
            defers=defers, option=option, num_microbatches=num_microbatches, on_cuda=on_cuda, holds=holds,
            pace=pace))

    def _problem(self, num_stages: int, mb: int, *, bandwidth_bps: float, latency_s: float, speed: float,
                 data_parallel: int, mode: Mode, in_flight: Sequence[int] | None,
                 memory_limit: Sequence[float] | None, defers: Sequence[bool] | None, option: MemoryOption,
                 num_microbatches: int, on_cuda: bool, holds: Sequence[bool] | None,
                 pace: tuple[float, ...] | None) -> CutProblem:
        profile = self.profile
        scale = mb / profile.microbatch_size
        memory = self.memory(option, mode, data_parallel, num_microbatches, mb, on_cuda)
        compute_s, cut_s = self.compute(mb, option.recompute, speed, bandwidth_bps, latency_s)
        cuttable = self._get(("cuttable",), lambda: tuple(c.cuttable for c in profile.cuts))
        static = self._get(("static", id(memory)), lambda: memory.static)
        transient = self._get(("transient", id(memory)), lambda: memory.transient)
        deferred = None if defers is None else self._get(
            ("deferred", mb), lambda: tuple(nd.deferred_bytes * scale for nd in profile.nodes))
        hold = None
        if holds is not None and any(holds):
            limits = self._get(("hold limits",), lambda: [held_limit([nd]) for nd in profile.nodes])
            hold = self._get(("hold", mb, num_microbatches, data_parallel == 1), lambda: hold_bytes(
                profile.nodes, scale, num_microbatches, data_parallel == 1, limits))
        return CutProblem(compute_s, cut_s, num_stages, cuttable, static, memory.held,
                          tuple(in_flight) if in_flight is not None else (1,) * num_stages,
                          tuple(memory_limit) if memory_limit is not None else None, deferred,
                          None if defers is None else tuple(defers), transient if any(transient) else None,
                          hold, None if hold is None or holds is None else tuple(holds), pace)


class _Placed:
    """A shape's workers as its placement puts them: per stage its replicas' workers and slowest speed,
    the devices, whether CPU workers share a host, the slowest link between neighbouring stages. Read
    from the workers' columns (:class:`~coordinator.planning.worker_table.WorkerTable`): a few numpy passes
    per placement, the worker objects made only for the shapes played."""

    def __init__(self, shared: _Shared, placement: tuple[tuple[str, ...], ...], num_stages: int,
                 links: PlacedLinks | None = None) -> None:
        assert shared.resources is not None
        table = shared.resources.worker_table
        grid = table.indices([name for row in placement for name in row]).reshape(len(placement), -1)
        period = _period(grid, num_stages)  # stage s is placed as stage s % period (interleaved chunks)
        rows = grid[:, :period].T  # per rank, its replicas' workers
        self._rows = rows
        self._period = period
        placed = np.unique(rows)  # each once (it may hold several stages)
        on_cpu = table.cpu[placed]
        self.on_cuda = not on_cpu.any()
        hosts = table.host[placed]
        hosts = hosts[hosts >= 0]
        # two CPU workers on one host: [Note: contention on a shared host]
        self.shared_host = bool(on_cpu.all()) and len(hosts) > len(np.unique(hosts))
        twins = _twins(table, rows) if not self.on_cuda else [False] * period
        speed = table.speed[rows].min(axis=1).tolist()
        least = table.memory[rows].min(axis=1).tolist()
        self.twins = [twins[s % period] for s in range(num_stages)]
        self.speed = [speed[s % period] for s in range(num_stages)]
        self.memory = [least[s % period] for s in range(num_stages)]  # per stage, its least
        # what the pipeline's transfers cross
        self.link = links.neighbour if links is not None else neighbour_link(shared.resources, placement)
        self._rank_links = links.ranks if links is not None else ()
        self._shared = shared
        self._stage_links: dict[int, tuple[float, float]] = {}
        self._sharing: dict[int, Sharing | None] = {}
        self._starved: list[float] | None = None
        self.num_stages = num_stages

    @functools.cached_property
    def workers(self) -> list[list[Worker]]:
        """Per stage, its replicas' workers."""
        assert self._shared.resources is not None
        every = self._shared.resources.workers
        ranks = [[every[i] for i in row] for row in self._rows.tolist()]
        return [ranks[s % self._period] for s in range(self.num_stages)]

    @property
    def starved(self) -> list[float]:
        """Per stage, :func:`_sync_starved` of these workers (one pass over them per placement)."""
        if self._starved is None:
            assert self._shared.resources is not None
            starved = _sync_starved(self._shared.resources, self._rows)
            self._starved = [starved[s % self._period] for s in range(self.num_stages)]
        return self._starved

    def stage_link(self, stage: int) -> tuple[float, float]:
        """The slowest link among the stage's replicas."""
        if stage not in self._stage_links:
            self._stage_links[stage] = (self._rank_links[stage % len(self._rank_links)] if self._rank_links
                                        else self._shared.link([w.name for w in self.workers[stage]]))
        return self._stage_links[stage]

    def sharing(self, ranks: int) -> Sharing | None:
        """How the ``ranks`` ranks of a replica share their hosts' cores, all replicas' workers counted
        (None: no CPU host holds two of the shape's workers). See [Note: contention on a shared host]."""
        if ranks not in self._sharing:
            rows = self._rows[np.arange(ranks) % self._period]
            self._sharing[ranks] = _rows_sharing(self._shared.resources, rows) if self.shared_host else None
        return self._sharing[ranks]

    def rank_stages(self, ranks: int) -> list[tuple[int, ...]]:
        """The stages each of ``ranks`` workers of a replica holds (stage ``s`` on ``s % ranks``)."""
        return [tuple(range(r, self.num_stages, ranks)) for r in range(ranks)]


def _period(grid: np.ndarray, num_stages: int) -> int:
    """The least ``k`` dividing ``num_stages`` with every replica's stage ``s`` (``grid[r, s]``: its worker)
    on the worker of its stage ``s % k`` (the ranks of an interleaved placement; ``num_stages`` when none
    shorter holds)."""
    for k in range(1, num_stages):
        if num_stages % k == 0 and np.array_equal(grid, np.tile(grid[:, :k], (1, num_stages // k))):
            return k
    return num_stages


def _twins(table: WorkerTable, rows: np.ndarray) -> list[bool]:
    """Per rank (``rows[k]``: its replicas' workers), whether two of its replicas are CPU workers of one host
    (contended throughout)."""
    host = table.host[rows]
    on_host = table.cpu[rows] & (host >= 0)
    ordered = np.sort(np.where(on_host, host, -1), axis=1)
    distinct = (ordered[:, :1] >= 0).sum(axis=1) + ((ordered[:, 1:] != ordered[:, :-1])
                                                     & (ordered[:, 1:] >= 0)).sum(axis=1)
    twins: list[bool] = (on_host.sum(axis=1) > distinct).tolist()
    return twins


def _sync_cpu(mode: Mode, option: MemoryOption, d: int, grad_bytes: float, speed: float) -> float:
    """The CPU seconds a stage's gradient sync costs each of its ``d`` workers of ``speed``: the bytes it
    moves per rank (the collectives of the last backward; a parameter server's push and pull, ``2 G``)
    at :data:`SYNC_CPU_BPS` ([Note: the sync's own CPU])."""
    if d <= 1:
        return 0.0
    if mode == "collective":
        return gradient_collectives(option, d, grad_bytes, bandwidth=SYNC_CPU_BPS * speed, latency=0.0)
    return 2 * grad_bytes / (SYNC_CPU_BPS * speed)


def _update_s(optimizer: str, grad_bytes: float, share: float, speed: float) -> float:
    """A stage's replicated optimizer step, the simulation's start: ``share`` of its gradients' bytes (1
    collective; a parameter server's shard, ``1 / d``) times the optimizer's memory traffic at
    :data:`OPTIMIZER_BANDWIDTH_BPS` on a worker of ``speed``. The plays, the bounds and the bound over every
    cut take it from here, so they round alike."""
    traffic = OPTIMIZER_TRAFFIC.get(optimizer, OPTIMIZER_TRAFFIC["adam"])
    return grad_bytes * share * traffic / OPTIMIZER_BANDWIDTH_BPS / speed


def _sync_starved(resources: Resources, rows: np.ndarray) -> list[float]:
    """Per rank (``rows[k]``: its replicas' workers), the share of its replicas' gradient-sync threads that
    find no core to spare on their host while the shape's workers (all of ``rows``, each once) compute
    (the most over its hosts): see [Note: the sync's own CPU]. 0 for GPU workers, and for CPU workers whose
    host's cores are not given (``Worker.host_cpus``: its workers' ``cpus`` together then, none waiting
    for a core)."""
    if not resources.host_cores_given or rows.size == 0:  # no host of CPU workers with its cores given
        return [0.0] * len(rows)
    table = resources.worker_table
    placed = np.unique(rows)
    host = table.host[placed]
    counted = table.cpu[placed] & (host >= 0) & table.cores_given[placed]
    if not counted.any():  # GPU workers, or hosts whose cores are not given: no sync waits for a core
        return [0.0] * len(rows)
    hosts = len(table.host_cores)
    threads = np.bincount(host[counted], weights=table.cpus[placed[counted]], minlength=hosts)
    workers = np.bincount(host[counted], minlength=hosts)
    spare = np.maximum(0.0, table.host_cores - threads) / np.maximum(workers, 1)
    starved = np.where(workers > 0, 1.0 - np.minimum(1.0, spare), 0.0)  # per host whose cores are given
    home = table.host[rows]
    share = np.where(home >= 0, starved[np.maximum(home, 0)], 0.0)  # per worker: its host's
    out: list[float] = share.max(axis=1, initial=0.0).tolist()
    return out


def shared_cores(resources: Resources | None, rank_workers: Sequence[Sequence[Worker]]) -> Sharing:
    """The :class:`Sharing` of ranks whose workers (all replicas') are ``rank_workers[r]``: per rank and
    CPU host, the threads its workers there run (their ``cpus``) and how many workers that is."""
    assert resources is not None
    table = resources.worker_table
    flat = table.indices([w.name for ws in rank_workers for w in ws])
    rank_of = np.repeat(np.arange(len(rank_workers)), [len(ws) for ws in rank_workers])
    return _sharing(resources, flat, rank_of, len(rank_workers))


def _rows_sharing(resources: Resources | None, rows: np.ndarray) -> Sharing:
    """:func:`shared_cores` of ranks whose replicas' workers are ``rows[k]``."""
    assert resources is not None
    return _sharing(resources, rows.ravel(), np.repeat(np.arange(len(rows)), rows.shape[1]), len(rows))


def _sharing(resources: Resources, flat: np.ndarray, rank_of: np.ndarray, num_ranks: int) -> Sharing:
    """:func:`shared_cores` of the workers ``flat`` (rank by rank), ``rank_of`` each one's rank: hosts
    numbered in the order their first CPU worker comes, each rank's hosts in the order its first worker
    there comes, the threads summed in the workers' order (the floats of one pass over them)."""
    table = resources.worker_table
    host = table.host[flat]
    on_host = table.cpu[flat] & (host >= 0)
    flat, host, rank_of = flat[on_host], host[on_host], rank_of[on_host]
    wants: list[tuple[tuple[int, float, int], ...]] = [() for _ in range(num_ranks)]
    cores: list[float] = []
    if len(flat):
        hosts, first = np.unique(host, return_index=True)
        order = np.argsort(first, kind="stable")  # hosts numbered by their first worker
        number = np.empty(len(hosts), dtype=np.int64)
        number[order] = np.arange(len(hosts))
        cores = table.host_cores[hosts[order]].astype(np.float64).tolist()
        key = rank_of * len(hosts) + number[np.searchsorted(hosts, host)]
        keys, seen, which = np.unique(key, return_index=True, return_inverse=True)
        threads = np.bincount(which, weights=table.cpus[flat])  # in the workers' order, from 0.0
        count = np.bincount(which)
        came = np.argsort(seen, kind="stable")  # rank by rank, each rank's hosts as they come
        ordered = keys[came]
        edges = np.searchsorted(ordered // len(hosts), np.arange(num_ranks + 1)).tolist()
        h, c, n = (ordered % len(hosts)).tolist(), threads[came].tolist(), count[came].tolist()
        wants = [tuple(zip(h[a:b], c[a:b], n[a:b], strict=True)) for a, b in itertools.pairwise(edges)]
    return Sharing(tuple(cores), tuple(wants), SHARED_HOST_FORWARD_SLOWDOWN, SHARED_HOST_BACKWARD_SLOWDOWN,
                   SHARED_HOST_TURNS_SLOWDOWN)


def _spread_of(resources: Resources, rows: np.ndarray) -> tuple[tuple[float, float, float], float] | None:
    """``Sharing.spread_time``'s weights and rate for the ranks whose replicas' workers are ``rows[k]``
    (worker numbers, each once), as :meth:`_Placed.sharing` would build the sharing, without building it: None
    where it has none (a GPU among them, or no host holding two of them) or a rank has no home. A few numpy
    passes: the search asks it of every replicas x ranks before placing a shape ([Note: the homes' cores,
    before the placement])."""
    table = resources.worker_table
    host = table.host[rows]
    if not table.cpu[rows].all() or rows.size == 0:
        return None
    on = host >= 0
    if not on.any(axis=1).all():
        return None  # a rank without a shared host runs at its own pace: no home
    ranks, cores = rows.shape[0], table.host_cores.astype(np.float64)
    rank = np.broadcast_to(np.arange(ranks)[:, None], rows.shape)[on]
    h, threads = host[on], table.cpus[rows][on]
    workers = np.bincount(h, minlength=len(cores))
    if workers.max() < 2:
        return None
    wanted = np.bincount(h, weights=threads, minlength=len(cores))
    turns = np.where((wanted > cores) & (workers > 1), SHARED_HOST_TURNS_SLOWDOWN, 1.0)
    # per rank and host, the threads its workers there want, their count and where the rank's first is
    keys, first, which = np.unique(rank * len(cores) + h, return_index=True, return_inverse=True)
    k, n = np.bincount(which, weights=threads), np.bincount(which)
    # the home: where the rank wants the most, the first of its hosts to come among equals (Sharing.homes)
    order = np.lexsort((first, -k, keys // len(cores)))
    heads = order[np.r_[True, np.diff(keys[order] // len(cores)) != 0]]
    home, k_home, n_home = keys[heads] % len(cores), k[heads], n[heads]
    crowded = workers[home] > 1
    fs, bs = SHARED_HOST_FORWARD_SLOWDOWN, SHARED_HOST_BACKWARD_SLOWDOWN
    forward = float((k_home * turns[home] * np.where(crowded, fs, 1.0)).min())
    backward = float((k_home * turns[home] * np.where(crowded, bs, 1.0)).min())
    one = np.where(crowded & (n_home <= 1), max(fs, bs), 1.0) * np.minimum(k_home, cores[home])
    alone = np.ones(len(cores))
    np.maximum.at(alone, home, one / cores[home])
    homes = np.unique(home)
    return (forward, backward, float(k_home.min())), float((cores[homes] * alone[homes]).sum())


# [Note: action overhead] Every forward or backward action costs a fixed time on top of its
# compute, whatever the microbatch size: the step executor's dispatch, autograd's graph
# bookkeeping and the boundary handling, measured at 0.1-0.5 ms per action on the development
# machines. Without it the model would see microbatching as free and pick microbatches of one
# sample for a single stage (4-16x more actions for the same work).
ACTION_OVERHEAD_S = 3e-4

def _shards_as_asked(request: PlanConfig, shape: Shape) -> bool:
    """Whether a shape can shard as the request fixes it (``plan.zero``, ``plan.shard_factor``)."""
    d, mode = shape[0], shape[2]
    if not request.zero:
        return True
    factor = request.shard_factor or d
    return mode == "collective" and d >= 2 and factor >= 2 and d % factor == 0


def _backwards(shared: _Shared, mb: int, spans: Sequence[tuple[int, int]],
               schedule: tuple[str, int, int, int], defer: Sequence[bool], precision: str, recompute: bool,
               speed: Sequence[float], alone: bool) -> tuple[list[float], list[float], list[float]]:
    """Per stage, one microbatch's backward as its list runs it, on average, its ``W`` (0 where the list
    does not split its backwards) and the weight gradients it computes after its last backward's send
    (its tail). ``schedule``: its name, stages, microbatches and chunks (the lists are ``shared.kinds`` of
    it); ``alone``: one replica (no data parallel). See [Note: the backward as the schedule runs it]. Once
    per search for each set of arguments: the shapes of a cut, a schedule and a microbatch count ask for
    the same (half of them, a free search on 128 CPU hosts). The key names the schedule, not its lists: a
    ZB-H1 list of 128 stages is 57,000 kinds to hash on every call."""
    key = ("backwards", mb, tuple(spans), schedule, tuple(defer), precision, recompute, tuple(speed), alone)
    got = shared._get(key, lambda: _stage_backwards(shared, mb, spans, schedule, defer, precision, recompute,
                                                     speed, alone))
    return list(got[0]), list(got[1]), list(got[2])


def _stage_backwards(shared: _Shared, mb: int, spans: Sequence[tuple[int, int]],
                     schedule: tuple[str, int, int, int], defer: Sequence[bool], precision: str,
                     recompute: bool, speed: Sequence[float], alone: bool
                     ) -> tuple[list[float], list[float], list[float]]:
    """:func:`_backwards`, computed."""
    name, _, num_microbatches, _ = schedule
    counts = shared.kind_counts(*schedule)  # the lists themselves only where a split one is not ZB-H1
    forwards, backs, inputs_at = shared.columns(mb)
    holding, deferred = shared.holding()
    scale = mb / shared.profile.microbatch_size
    backward, weight, tail = [], [], []
    for s, (a, b) in enumerate(spans):
        count, inputs, weights = counts[s]  # its list's B's, I's and W's
        redo = sum(forwards[a:b]) if recompute else 0.0  # the backward pays the forward again
        plain = sum(backs[a:b]) + redo
        inp = sum(inputs_at[a:b]) + redo
        rows = sum(deferred[a:b]) * scale  # one microbatch's held rows
        limit = int(sum(holding[a:b])) // HOLD_SHARE  # held_limit

        def in_place(k: int, a: int = a, b: int = b) -> float:  # W of k microbatches, one product, addmm_
            return shared.weight_sum(k * mb, a, b)

        w, after = 0.0, 0.0
        if precision != "fp32" or (not count and not inputs):  # autocast: plain autograd throughout
            back = plain
        elif inputs:  # split: I, and the W's as the executor groups them
            spent = 0.0
            crossing = _crossing(rows, limit, inputs)
            priced: dict[tuple[int, bool], float] = {}  # a list's products are a few sizes, many times over
            products = (_zb_h1_products(s, num_microbatches, alone, crossing) if name == "zb-h1"
                        else _split_products(shared.kinds(*schedule)[s], alone, crossing))
            for product in products:
                if (price := priced.get(product)) is None:
                    n, through_autograd = product
                    price = priced[product] = in_place(n) + (shared.autograd_extra(mb, a, b)
                                                             if through_autograd else 0.0)
                spent += price
            w = spent / max(1, weights)
            back = inp + w
        elif defer[s]:  # GPipe: every B an I; after the last one's send, W over all, from no .grad
            back, after = inp, in_place(count)
        else:  # 1F1B, interleaved: I and the W's held, in groups
            within, last = _held_products(count, alone, _crossing(rows, limit, count))
            spent = 0.0
            for n in within:
                spent += in_place(n)
            after = in_place(last) if last else 0.0
            back = (spent + (count - _plain_count(count, alone)) * inp
                    + _plain_count(count, alone) * plain) / count
        backward.append(back / speed[s])
        weight.append(w / speed[s])
        tail.append(after / speed[s])
    return backward, weight, tail


def held_limit(nodes: Sequence[NodeProfile]) -> int:
    """The held rows' bytes past which a stage's executor computes its held ``W`` s: 1/``HOLD_SHARE`` of
    its deferred layers' weight bytes (``WeightGradStore.weight_bytes``; a profile without them: the
    parameters of the nodes with layers to defer)."""
    return int(sum(map(_holding_bytes, nodes))) // HOLD_SHARE


def _holding_bytes(nd: NodeProfile) -> int:
    """A node's part of :func:`held_limit`'s weight bytes."""
    return nd.deferred_weight_bytes or (nd.param_bytes if nd.split or nd.deferred_bytes else 0)


def hold_bytes(nodes: Sequence[NodeProfile], scale: float, count: int, alone: bool,
               limits: Sequence[int] | None = None) -> tuple[float, ...]:
    """Per node, the most a 1F1B stage of ``count`` backwards holds for its held ``W`` s (see
    :func:`_held_weights`): the rows of the microbatches that hold, at most until they exceed the node's
    share of the limit (:func:`held_limit`; the microbatch that crosses it included), at ``scale`` times
    the profiled microbatch. Per node: a stage of nodes alike holds their sum. ``limits``: each node's
    :func:`held_limit`, if known (a search asks for many sizes and counts)."""
    held = count if alone and count >= 2 else max(0, count - 2)
    if limits is None:
        limits = [held_limit([nd]) for nd in nodes]
    return tuple(min(held * rows, limit + rows)
                 for rows, limit in zip((nd.deferred_bytes * scale for nd in nodes), limits, strict=True))


def _plain_count(count: int, alone: bool) -> int:
    """The plain ``B`` s of a 1F1B list of ``count`` (its first and its last with replicas; none alone)."""
    if count < 2:
        return count
    return 0 if alone else min(count, 2)


def _crossing(rows: float, limit: int, most: int) -> int:
    """The fewest held microbatches of ``rows`` bytes each, at most ``most``, whose rows exceed ``limit``
    (``k * rows > limit``, as the executor compares them); 0 when no count up to ``most`` does. A list
    never holds more than its backwards, so counts past them need no answer (and the lists' products
    depend on this count alone: :func:`_held_products`)."""
    if most < 1 or not most * rows > limit:
        return 0
    lo, hi = 0, most  # the comparison is false at lo, true at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid * rows > limit:
            hi = mid
        else:
            lo = mid
    return hi


@functools.lru_cache(maxsize=4096)
def _held_products(count: int, alone: bool, crossing: int) -> tuple[tuple[int, ...], int]:
    """A 1F1B list's held ``W`` s (``services/compute/executor.py``) as the products it computes: how many
    microbatches each product within its backwards covers, in order, and the one after its last one's send
    (0: none). Each ``B`` that holds adds its rows; once ``crossing`` of them exceed the limit
    (:func:`_crossing`; 0: never) the held ones are computed in one product (the first of the step, which
    finds no ``.grad``, as one in place: it writes into the gradient tensor the last step's handed over);
    before the last ``B`` (replicas: it then runs plain) or after its send (alone: it holds too). It depends
    on the counts alone: the stages of every shape with these ask for the same."""
    if count < 2:
        return (), 0
    held = 0
    within: list[int] = []
    for j in range(count) if alone else range(1, count - 1):
        held += 1
        if j == count - 1:
            return tuple(within), held  # alone: after the send
        if crossing and held >= crossing:
            within.append(held)
            held = 0
    if held:
        within.append(held)
    return tuple(within), 0


@functools.lru_cache(maxsize=4096)
def _split_products(kinds: tuple[str, ...], alone: bool, crossing: int) -> tuple[tuple[int, bool], ...]:
    """A split list's ``W`` s (zb-h1) as the executor runs them: per product, how many microbatches it covers
    and whether it goes through autograd, in order. A run of consecutive ``W`` s is one product over its
    microbatches (alone: over every queued one, and none until ``crossing`` of them exceed the held limit,
    :func:`_crossing`; 0: never); the one after the last ``I`` through autograd into the ``.grad`` earlier
    runs made (the first of the step, which finds none, as one in place)."""
    last_i = max(k for k, kind in enumerate(kinds) if kind == "I")
    queued, graded = 0, False  # I's whose rows wait, whether a product made .grad
    out: list[tuple[int, bool]] = []
    runs = [0] * (len(kinds) + 1)  # the W's from each position on, in a row
    for k in range(len(kinds) - 1, -1, -1):
        runs[k] = runs[k + 1] + 1 if kinds[k] == "W" else 0
    for k, kind in enumerate(kinds):
        if kind == "I":
            queued += 1
            continue
        if kind != "W" or (k > 0 and kinds[k - 1] == "W"):
            continue
        run = runs[k]
        if k > last_i:
            n = queued
        elif alone:
            n = queued if crossing and queued >= crossing else 0
        else:
            n = run
        if n:
            out.append((n, graded and k > last_i))
            queued, graded = queued - n, True
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _zb_h1_products(stage: int, num_microbatches: int, alone: bool, crossing: int
                    ) -> tuple[tuple[int, bool], ...]:
    """:func:`_split_products` of ZB-H1's list of stage ``stage`` (``schedules._zb_h1``), without the list:
    its ``i``-th ``I`` is followed by its ``W`` once ``i >= stage``, and the ``W`` s left run after the last
    ``I``. So a ``W`` before the last ``I`` is a run of one, after ``stage + 1`` ``I`` s or more; with
    replicas each is a product of one, alone a product of every queued one once ``crossing`` of them are
    queued; the run after the last ``I`` takes every one still queued. A stage's products depend on its
    number and the microbatches alone (the tests hold this against the lists)."""
    queued, graded = 0, False
    out: list[tuple[int, bool]] = []
    for i in range(num_microbatches - 1):  # the W's between the I's
        queued += 1
        if i >= stage:
            n = (queued if crossing and queued >= crossing else 0) if alone else 1
            if n:
                out.append((n, False))
                queued, graded = queued - n, True
    out.append((queued + 1, graded))  # after the last I: every one queued
    return tuple(out)


def _weights(backward: Sequence[float], weight: Sequence[float]) -> tuple[float, ...]:
    """``StageCosts.weight_backward_s`` for stage backwards (``ACTION_OVERHEAD_S`` in) and their measured
    ``W`` s: () where none was measured (the simulator's default share), else each ``W`` with its action's
    overhead (at most the backward), the default share where a stage's was not measured."""
    if not any(weight):
        return ()
    return tuple(min(b, w) + ACTION_OVERHEAD_S if w > 0 else (b + ACTION_OVERHEAD_S) * DEFAULT_WEIGHT_FRACTION
                 for b, w in zip(backward, weight, strict=True))


@dataclass(frozen=True)
class _Played:
    """A cut of a shape played in the simulator (shared by the memory options with that cut)."""

    costs: StageCosts
    sim: Timing
    slow_b: tuple[float, ...]  # each stage's backward as played over its own (a shared host stretches it)


@dataclass(frozen=True)
class _Setup:
    """A shape before any cut: where it runs, its schedule's lists, what each stage holds and may use."""

    shape: Shape
    mb: int  # samples per microbatch
    ranks: int  # workers per replica
    placement: tuple[tuple[str, ...], ...]
    at: _Placed
    in_flight: tuple[int, ...]
    defer: list[bool]
    limit: list[float]
    options: list[MemoryOption]
    runtime: int  # a worker's runtime bytes, counted against its memory once (0 on a GPU)
    precision: str = "fp32"
    holds: tuple[bool, ...] = ()  # per stage: its B's hold their W's (1F1B in fp32, see hold_bytes)
    room: float = math.inf  # the stages' limits together, each with_slack (what _may_fit compares)


def _setup(shared: _Shared, shape: Shape, global_batch: int, request: PlanConfig,
           automatic: Automatic) -> _Setup:
    """A shape's setup (see [Note: several stages per worker] for the placement)."""
    resources = shared.resources
    assert resources is not None
    d, p, mode, sched_name, m, v = shape
    ranks = p // v  # workers per replica: stage s on rank s % ranks (see [Note: chunks] in schedules.py)
    mb = global_batch // (d * m)
    profile = shared.profile

    def make() -> _Setup:  # all but the memory options: the modes share it
        placement, links = place_with_links(resources, d, p, ranks,
                                            traffic=lambda: step_traffic(profile, p, m, mb))
        at = shared.placed(placement, p, links)
        in_flight, defers = stage_holds(sched_name, p, m, v)
        defer = [deferring and request.precision == "fp32" for deferring in defers]
        # a worker's stages share its memory less its runtime's (host memory: not a GPU's): the cutter gives
        # each its 1/v share, the fit is checked per worker
        runtime = 0 if at.on_cuda else profile.runtime_bytes
        limit = [float(least - runtime) / v for least in at.memory]
        holds = tuple(not deferring and request.precision == "fp32" for deferring in defers)
        return _Setup(shape, mb, ranks, placement, at, in_flight, defer, limit, [], runtime,
                      request.precision, holds, sum(with_slack(each) for each in limit))

    common = shared._get(("setup", d, p, sched_name, m, v, global_batch, request.precision), make)
    return dataclasses.replace(common, shape=shape,
                               options=memory_options(request, d, mode, common.at.on_cuda, automatic))


def _pace(speed: Sequence[float]) -> tuple[float, ...] | None:
    """Per stage, its compute's pace against the slowest stage's speed, which the cut problem's compute is
    priced at ([Note: a stage's pace] in ``coordinator/planning/cutting.py``); None where all run alike."""
    slowest = min(speed)
    if all(s == slowest for s in speed):
        return None
    return tuple(slowest / s for s in speed)


def _free_cut(shared: _Shared, problem: CutProblem, key: tuple[object, ...], cutter: Cutter,
              balance: Sequence[int] | None) -> tuple[int, ...] | str:
    """The cut ignoring memory (it reads the compute and transfers only: one per ``key`` for every shape),
    or why none exists."""
    if key not in shared.free_cuts:
        free = dataclasses.replace(problem, memory_limit=None)
        try:
            shared.free_cuts[key] = free.check(balance_bounds(balance) if balance is not None
                                               else cutter(free))
        except CutError as exc:
            shared.free_cuts[key] = str(exc)
    return shared.free_cuts[key]


def _cut_within(shared: _Shared, problem: CutProblem, free: tuple[int, ...], cutter: Cutter,
                balance: Sequence[int] | None) -> tuple[tuple[int, ...], str]:
    """The compute-optimal cut when it fits (shared by the options), else the cutter's within memory
    (:func:`_memory_cut`); and why no cut fits memory ("" if one does)."""
    try:
        return problem.check(free), ""
    except CutError as exc:
        within = _memory_cut(shared, problem, cutter, balance)
        return (within, "") if within is not None else (free, str(exc))


def _memory_cut(shared: _Shared, problem: CutProblem, cutter: Cutter, balance: Sequence[int] | None
                ) -> tuple[int, ...] | None:
    """The cut played where the cut that ignores memory does not fit: the cutter's within memory (None where
    it finds none, or a fixed ``balance`` does not fit: the candidate cannot fit); one per problem in a
    search, for its bound and its play.

    [Note: a cut within memory, bounded] Where the compute-optimal cut exceeds a stage's memory, the
    candidate plays the cutter's cut within memory; the bound with the cut takes that cut too, so memory-bound
    shapes (large parameters on few workers) are bounded as tightly as the others. It was the bound over
    every cut before: on 1,000 uneven nodes over 1,024 local workers of 80 GiB each the search played 3,466
    shapes (65 s) whose bounds all sat within 0.02% of each other."""
    if balance is not None:
        return None
    key = ("within", id(problem))
    if key not in shared.memory_cuts:
        try:
            shared.memory_cuts[key] = problem.check(cutter(problem))
        except CutError:
            shared.memory_cuts[key] = None
    return shared.memory_cuts[key]


def _evaluate(profile: Profile, resources: Resources, shape: Shape, global_batch: int,
              cutter: Cutter, cutter_name: str, balance: Sequence[int] | None,
              request: PlanConfig = _SEARCH_ALL, automatic: Automatic = AUTOMATIC,
              exhaustive: bool = False, shared: _Shared | None = None,
              only: MemoryOption | None = None, fitting_only: bool = False) -> list[Candidate]:
    """The candidates of one shape: one per memory option evaluated (see [Note: choosing the memory
    options]), the replicated option first; ``only``: that option alone (if the shape has it);
    ``fitting_only``: an option whose cut cannot meet memory without its play (no plan, the reason)."""
    d, p, mode, sched_name, m, v = shape
    shared = shared or _Shared(profile, resources)
    precision = request.precision
    setup = _setup(shared, shape, global_batch, request, automatic)
    mb, ranks, placement, at = setup.mb, setup.ranks, setup.placement, setup.at
    order = schedule_steps(sched_name, p, m, v)[0]  # per rank
    in_flight, defer, limit = setup.in_flight, setup.defer, setup.limit
    workers, speed, on_cuda = at.workers, at.speed, at.on_cuda
    runtime = setup.runtime
    bw, lat = at.link
    fwd_bytes, bwd_bytes = shared.scaled(mb)
    nodes = profile.nodes
    traffic = OPTIMIZER_TRAFFIC.get(profile.optimizer, OPTIMIZER_TRAFFIC["adam"])
    fields = {"staleness": request.staleness if mode == "parameter_server" else 0}
    played: dict[tuple[tuple[int, ...], bool], _Played] = {}

    def problem_of(option: MemoryOption) -> CutProblem:
        return shared.problem(p, mb, bandwidth_bps=bw, latency_s=lat, speed=min(speed), data_parallel=d,
                              mode=mode, in_flight=in_flight, memory_limit=limit, defers=defer, option=option,
                              num_microbatches=m, on_cuda=on_cuda, holds=setup.holds, pace=_pace(speed))

    def free_cut(problem: CutProblem, recompute: bool) -> tuple[int, ...] | str:
        key = (p, mb, recompute, min(speed), _pace(speed), bw, lat, id(cutter), tuple(balance or ()))
        return _free_cut(shared, problem, key, cutter, balance)

    def reference_optimizer(a: int, b: int, s: int) -> float:
        """The stage's replicated optimizer step (the simulation's start; ZeRO shrinks it, see
        [Note: choosing the memory options])."""
        share = 1.0 if mode == "collective" else 1.0 / d  # a parameter shard updates 1/d of the stage
        return _update_s(profile.optimizer, sum(nd.grad_bytes for nd in nodes[a:b]), share, speed[s])

    def play_cut(bounds: tuple[int, ...], recompute: bool, problem: CutProblem) -> _Played:
        if (bounds, recompute) in played:
            return played[bounds, recompute]
        spans = list(itertools.pairwise(bounds))
        times, cold = shared.times(mb), shared.cold(mb)
        # a stage's first microbatch finds its weights cold, the later ones warm ([Note: a warm forward])
        alone_f = [(sum(f for f, _ in times[a:b]) + sum(cold[a:b]) / m) / speed[s]
                   for s, (a, b) in enumerate(spans)]
        alone_b, alone_w, tails = _backwards(shared, mb, spans, (sched_name, p, m, v), defer, precision,
                                             recompute, speed, d == 1)
        start = tuple(reference_optimizer(a, b, s) for s, (a, b) in enumerate(spans))
        inner = bounds[1:-1]
        held = tuple(sum((problem.held_bytes(s) or ())[a:b]) for s, (a, b) in enumerate(spans))

        costs = StageCosts(tuple(t + ACTION_OVERHEAD_S for t in alone_f),
                           tuple(t + ACTION_OVERHEAD_S for t in alone_b),
                           tuple(_transfer(fwd_bytes[c], bw, lat) for c in inner),
                           tuple(_transfer(bwd_bytes[c], bw, lat) for c in inner),
                           held, start_s=start, weight_backward_s=_weights(alone_b, alone_w),
                           tail_s=tuple(tails) if any(tails) else ())
        # at the pace a shared host allows (see [Note: contention on a shared host]); the plan keeps the
        # stages' forwards and backwards as they were played
        sim = play(sched_name, order, at.rank_stages(ranks), costs, at.sharing(ranks))
        alone = costs
        if at.shared_host:
            costs = sim.played_costs(alone)
        # per stage, the played backward over the nodes' plain ones (the sync's hiding reads it per node)
        plain = [sum(b_ + f * recompute for f, b_ in times[a:b]) / speed[s] + ACTION_OVERHEAD_S
                 for s, (a, b) in enumerate(spans)]
        slow_b = [b / a for a, b in zip(plain, costs.backward_s, strict=True)]
        played[bounds, recompute] = _Played(costs, sim, tuple(slow_b))
        return played[bounds, recompute]

    def evaluate(option: MemoryOption) -> tuple[Candidate, bool]:
        """The option's candidate, and whether it fits with the cut that ignores memory."""
        problem = problem_of(option)
        free = free_cut(problem, option.recompute)
        if isinstance(free, str):
            return Candidate(d, p, mode, sched_name, m, None, free, v, option), False
        bounds, cut_error = _cut_within(shared, problem, free, cutter, balance)
        if cut_error and fitting_only:  # it cannot fit: what it would play is not asked for
            return Candidate(d, p, mode, sched_name, m, None, cut_error, v, option), False
        game = play_cut(bounds, option.recompute, problem)
        return _candidate(option, bounds, problem, game, cut_error), bounds == free

    def _candidate(option: MemoryOption, bounds: tuple[int, ...], problem: CutProblem, game: _Played,
                   cut_error: str) -> Candidate:
        spans = list(itertools.pairwise(bounds))
        memory = shared.memory(option, mode, d, m, mb, on_cuda)
        starved = at.starved if d > 1 else [0.0] * p
        times = shared.times(mb)
        fwd, bwd = game.costs.forward_s, game.costs.backward_s
        stages = []
        saved = []  # per stage: the optimizer time the option saves against the simulation's start
        for s, (a, b) in enumerate(spans):
            names = [w.name for w in workers[s]]
            grad = sum(nd.grad_bytes for nd in nodes[a:b])
            params = sum(nd.param_bytes for nd in nodes[a:b])
            hidden = _after_first_bucket([nd.grad_bytes for nd in nodes[a:b]],
                                         [(b_ + f * option.recompute) * game.slow_b[s] / speed[s]
                                          for f, b_ in times[a:b]])
            link_bw, link_lat = shared.link(names)
            if mode == "collective":
                # what no backward hides: the collectives' CPU work where the host has no core for it
                unhideable = starved[s] * _sync_cpu(mode, option, d, grad, speed[s])
                # the forwards a recomputing backward runs again, as its played backward has them
                redo = (m * sum(f for f, _ in times[a:b]) * game.slow_b[s] / speed[s] if option.recompute
                        else 0.0)
                sync = sharded_sync(option, d, grad, params, hidden=hidden, compute_s=m * (fwd[s] + bwd[s]),
                                    num_microbatches=m, bandwidth=COLLECTIVE_EFFICIENCY * link_bw,
                                    latency=link_lat, unhideable=unhideable, recomputed_s=redo)
                step = optimizer_s(option, grad, params, traffic=traffic,
                                   device_bandwidth=OPTIMIZER_BANDWIDTH_BPS * speed[s], on_cuda=on_cuda)
            else:
                # its pushes and pulls are CPU work too ([Note: the sync's own CPU])
                sync = max(_sync(mode, grad, d, hidden, link_bw, link_lat),
                           starved[s] * _sync_cpu(mode, option, d, grad, speed[s]))
                step = game.costs.start_s[s]
            saved.append(game.costs.start_s[s] - step)
            held = problem.held_bytes(s) or ()
            use = memory.stage(a, b, held, in_flight[s])
            use = use.model_copy(update={"runtime": runtime,  # the held W's rows count as activations
                                         "activations": use.activations + int(problem.stage_hold(s, a, b))})
            xfer = (problem.cut_s[a] if s > 0 else 0.0) + (problem.cut_s[b] if s < p - 1 else 0.0)
            stages.append(StagePlan(
                index=s, start=a, stop=b, nodes=tuple(nd.name for nd in nodes[a:b]),
                workers=tuple(names), forward_s=fwd[s], backward_s=bwd[s], transfer_s=xfer, sync_s=sync,
                weight_s=game.costs.weight_backward_s[s] if game.costs.weight_backward_s else 0.0,
                tail_s=game.costs.tail_s[s] if game.costs.tail_s else 0.0,
                param_bytes=params, optimizer_s=step, in_flight=in_flight[s],
                peak_memory_bytes=int(problem.stage_memory(s, a, b)) + runtime, memory=use,
                incoming=shared.cut_at(a, mb), outgoing=shared.cut_at(b, mb)))
        # per worker: its stages' memory (each at its own peak: an upper bound) and their unhidden syncs
        held_by = [range(k, p, ranks) for k in range(ranks)]
        rank_memory = [sum(stages[s].peak_memory_bytes for s in ss) - (len(ss) - 1) * runtime  # one runtime
                       for ss in held_by]
        reason = ""
        for k, ss in enumerate(held_by):
            over = [w for w in workers[k] if rank_memory[k] > w.memory_bytes]
            if over and not reason:
                what = f"stage {k}" if v == 1 else f"stages {', '.join(map(str, ss))}"
                reason = (f"{what} need{'s' if v == 1 else ''} {format_bytes(rank_memory[k])} per worker, "
                          f"{over[0].name} has {format_bytes(over[0].memory_bytes)}")
        reason = reason or cut_error
        if not reason and option.zero >= 2 and profile.tied_across(bounds):
            reason = (f"ZeRO-{option.zero} keeps a shard of each gradient, and this cut puts the holders "
                      "of a tied parameter on different stages, which sum its whole gradient (plan.zero=1 "
                      "runs it)")
        sync_time = max(sum(stages[s].sync_s for s in ss) for ss in held_by)
        # a rank starts after its stages' optimizer steps: the step moves by the least a rank saves
        pipeline = game.sim.step_time_s - min(sum(saved[s] for s in ss) for ss in held_by)
        check = max(sum(nd.grad_bytes for nd in nodes[a:b]) / speed[s]
                    for s, (a, b) in enumerate(spans)) / GRADIENT_CHECK_BANDWIDTH_BPS
        overhead = 2 * CONTROL_MESSAGE_S + check  # see [Note: step overheads]
        plan = Plan(data_parallel=d, num_stages=p, mode=mode, schedule_name=sched_name, num_microbatches=m,
                    microbatch_size=mb, global_batch=global_batch, cutter=cutter_name, bounds=bounds,
                    stages=tuple(stages), placement=placement,
                    step_time_s=pipeline + sync_time + overhead,
                    pipeline_time_s=pipeline, sync_time_s=sync_time, overhead_s=overhead,
                    bubble_fraction=game.sim.bubble_fraction,
                    peak_memory_bytes=max(rank_memory), precision=precision, chunks=v,
                    zero_stage=option.zero, shard_factor=option.shard_factor, recompute=option.recompute,
                    offload=option.offload, **fields)
        return Candidate(d, p, mode, sched_name, m, plan, reason, v, option)

    cands: list[Candidate] = []
    fits_free = False  # an option without recompute fits with the cut that ignores memory
    for option in setup.options:
        if only is not None and option != only:
            continue
        if option.recompute and fits_free and not exhaustive:
            continue  # recompute only adds compute (see [Note: choosing the memory options])
        cand, free = evaluate(option)
        fits_free |= cand.fits and free and not option.recompute
        cands.append(cand)
    return cands


def _turns(sharing: Sharing | None, num_stages: int, ranks: int) -> list[float]:
    """Per stage, what its rank's home host's turns divide its forwards' and backwards' pace by throughout
    (:meth:`Sharing.turns`; 1 on no shared host)."""
    if sharing is None:
        return [1.0] * num_stages
    homes = sharing.homes()
    return [1.0 if (h := homes[s % ranks]) is None else sharing.turns(h) for s in range(num_stages)]


def _placed_bound(shared: _Shared, setup: _Setup, rest: float) -> float:
    """A lower bound on the step of the shape's replicated candidate with its placement, before its cut
    (0 where it knows nothing the bound over every cut does not): [Note: a crowded host, before the cut].
    ``rest``: the bound over every cut's part that is not the pipeline's (:func:`_cut_free_parts`).

    [Note: a crowded host, before the cut] On hosts of CPU workers the bound with the cut takes, for the
    ranks of each home (the host whose pace a rank runs at), ``T >= sum (e_r + (s_f - 1) F_r + (s_b - 1)
    B_r) / (k + s - 1)`` ([Note: a crowded host's slowdown] in ``simulator.py``): ``e_r`` rank ``r``'s end
    at its own pace, at least its start and its actions' time; ``F_r`` and ``B_r`` its forwards and
    backwards not slowed for certain (a stage whose replicas share a host is slowed throughout, inside
    ``e_r``). Every stage is on some rank, so over all ranks those sums hold at least every microbatch's
    forward and backward of the whole chain, slowed (``_chain_totals``' slowed sum, at the fastest speed),
    its actions' overheads and the stages' starts, whatever the cut; and where every rank has a home,
    adding the inequalities of the ``H`` homes gives ``T >= that / (R + (s - 1) H)`` for ``R`` ranks. A
    placement whose stages all share hosts with their replicas is slowed throughout: ``T >= that / R``,
    the busiest rank at least the mean. A host whose ranks take turns (:meth:`Sharing.turns`) slows them
    throughout, so the least of the homes' turns multiplies the chain's forwards and backwards in every
    ``e_r``. Those ends hold each rank's fill and drain too, which the cut decides; what every cut leaves
    of them is added in :func:`_with_fill`. The search places a shape before it cuts it, and cuts only the
    shapes this bound leaves under the best step played: on 1,000 nodes over 128 CPU hosts of 8 workers,
    87 of 344 cuts were saved without the fill, 105 with it (the 239 cut: 184 interleaved, whose fill
    before the cut is not bounded here: a cut may leave its first chunk, the one its fill runs through,
    nearly empty).
    """
    at = setup.at
    ranks = setup.ranks
    d, p, mode, _, m, _ = setup.shape
    totals = _chain_totals(shared, setup.mb)[0]
    # what share of one microbatch through every stage the ranks' fill and drain hold at least ([Note: a
    # pipeline's fill, before the cut]): GPipe and 1F1B all of it, ZB-H1 its forwards (phi: the least share
    # of a stage's compute they are); an interleaved pipeline, none known
    name = setup.shape[3]
    fill = 0.0 if p != ranks else 1.0 if name in ("gpipe", "1f1b") else totals[3] if name == "zb-h1" else 0.0
    # the work over the ranks' speeds as placed ([Note: the speed a shape's ranks can have])
    updates = _update_s(shared.profile.optimizer, shared.grad_bytes, 1.0 if mode == "collective" else 1.0 / d,
                        1.0)
    # the chain's totals are on the fastest worker of the list; no rank here is quicker than its fastest
    fastest = max(at.speed)
    scale = shared.fastest / fastest
    through = totals[0] * scale + 2 * p * ACTION_OVERHEAD_S  # one microbatch through every stage
    sharing = at.sharing(ranks)
    # each rank's pace at most its speed, over its home's share of the cores where it wants more than that
    # whenever busy (its update too): weighted by it, the rank's work still adds up to the work at speed 1
    stretch = sharing.least_stretch() if sharing is not None else (1.0,) * ranks
    paces = [at.speed[r] / stretch[r] for r in range(ranks)]
    work = m * (totals[0] * shared.fastest + 2 * p * ACTION_OVERHEAD_S * min(at.speed)) + updates
    least = min(paces)
    paced = _with_fill(work / least, sum(paces) / least, fill * through, through, m) + rest  # _paced's
    if name == "zb-h1" and p > 1:  # its last rank's chain (closed_form.cut_free_bound), at the placed pace
        chain = (totals[5] * scale + p * ACTION_OVERHEAD_S + (m - 1) * (totals[6] * scale + ACTION_OVERHEAD_S)
                 + (p - 1) * _cut_costs(shared, setup.mb)[0])
        paced = max(paced, chain + rest)
    # every stage's fill at the paces of the stages before it ([Note: a pipeline's fill at its stages'
    # paces] in closed_form.py): GPipe and 1F1B, and an interleaved schedule over its chunks, all of it;
    # ZB-H1 its forwards
    held = 1.0 if name in ("gpipe", "1f1b", *UNSPLIT_CHUNKED) else totals[3] if name == "zb-h1" else 0.0
    if held > 0 and p > 1:
        stage_paces = [at.speed[s] / stretch[s % ranks] for s in range(p)]
        paced = max(paced, paced_fill_bound(stage_paces, totals[0] * shared.fastest, held, m,
                                            2 * ACTION_OVERHEAD_S) + rest)
    if name in UNSPLIT_CHUNKED and p > ranks:  # [Note: an interleaved chain, before the cut]
        lightest = totals[2] * shared.fastest  # the lightest node at speed 1
        surplus = sum(lightest * (1.0 / s - 1.0 / fastest) for s in at.speed)
        crossings = _cut_costs(shared, setup.mb)[1]
        paced = max(paced, through + surplus + 2 * crossings[min(p - 1, len(crossings) - 1)] + rest)
    if sharing is None:
        return paced
    # a host's cores, whatever the cut ([Note: the homes' cores, before the cut])
    starts = _update_s(shared.profile.optimizer, shared.grad_bytes, 1.0 if mode == "collective" else 1.0 / d,
                       fastest)
    paced = max(paced, sharing.spread_time(m * (totals[7] * scale + p * ACTION_OVERHEAD_S),
                                           m * (totals[8] * scale + p * ACTION_OVERHEAD_S), starts) + rest)
    homes = sharing.homes()
    if any(home is None for home in homes):  # a rank at its own pace: its share of the work is the cut's
        return paced
    slowed = _chain_totals(shared, setup.mb)[1][0] * scale  # every node's forward and least backward, slowed
    turns = min(sharing.turns(h) for h in homes if h is not None)  # the least any rank is slowed throughout
    work = m * (slowed + 2 * p * ACTION_OVERHEAD_S) * turns + starts
    extra = max(SHARED_HOST_FORWARD_SLOWDOWN, SHARED_HOST_BACKWARD_SLOWDOWN) - 1.0
    chain = (totals[0] * scale + 2 * p * ACTION_OVERHEAD_S) * turns  # one microbatch through every stage
    pipeline = _with_fill(work, ranks + extra * len(set(homes)), fill * chain, chain, m)
    if at.shared_host and all(at.twins):
        pipeline = max(pipeline, _with_fill(work, ranks, fill * chain, chain, m))
    return max(paced, pipeline + rest)


# [Note: an interleaved chain, before the cut] An interleaved step is at least microbatch 0's forward down
# every stage and its backward back up them (``closed_form.stage_bounds``' last stage), each stage at its
# slowest replica's speed, every cut crossed twice each way (both endpoints pay). Whatever the cut, every
# stage holds a node, the lightest at least, so that chain is at least every node at the placement's
# fastest speed, plus the lightest node's difference at each stage's own, plus the ``p - 1`` cheapest cuts
# twice. On two CPU generations (1,024 workers, half of them half as fast) the interleaved pipelines over
# both (8 replicas x 125 ranks x 4 chunks) played 38 s where this bound was 16 s; with the chain, 30 s,
# above the best step played (28.4 s), so they leave before their cut.


# [Note: the homes' cores, before the cut] The bound with the cut holds each home host's cores
# (``Sharing.least_time``): the work of the ranks that run at its pace, each weighted by the cores it wants
# there (its replicas on that host, times their threads), over the cores. Before the cut the work per rank is
# unknown, but together the ranks hold every microbatch's forward and least backward of the whole chain and
# their actions (``m`` times one microbatch through every stage at the placement's fastest speed) and every
# stage's update, so the busiest home does at least the homes' mean: that work over the homes' cores
# together, each kind at the least weight any rank gives it (``Sharing.spread_time``): the forwards slowed
# by a crowd's forward slowdown, the backwards by the backward's, the updates by neither. Before it, the
# bound with the placement counted each replica's work over its ranks alone: on hosts whose 8 workers want 8
# of 32 cores each (twice what a host has), the bounds with the cut sat 1.2-3.4x over it, and 2,738 shapes
# were cut. With forwards and backwards at the lighter slowdown and no updates, on 128 hosts whose 8
# workers of 8 threads share 16 cores (``random-13`` of bench/planning.py) the bounds with the placement sat
# 7% under the bounds with the cut (0.925 of the best step): 1,752 shapes were cut; 1,358 with the kinds
# apart (0.984 of it).


# [Note: the homes' cores, before the placement] A shape's placement is one of at most two grids of its
# replicas and ranks, whatever its stage count and traffic (``placement.grids``: the list's order, or the
# pipelines-inside-hosts and replica-groups-inside-hosts layouts, of which the traffic picks one), and the
# homes' weights and rate of [Note: the homes' cores, before the cut] depend on the grid alone. So a shape
# is first bounded by the least over those grids of that bound, the chain priced on the list's fastest
# worker and the updates at its speed (no placement is quicker): one pass per replicas x ranks a search
# meets, in numpy (``_spread_of``, what the sharing gives), before anything is placed. On ``random-13``
# every shape whose bound over every cut was under the best step (10,626 of 106,481) had been placed and
# bounded before the first cut (5.1 s); 1,648 are now (0.3 s).


def _homes_bound(shared: _Shared, shape: Shape, global_batch: int, rest: float) -> float:
    """A lower bound on the step of the shape's replicated candidate before it is placed, from the homes'
    cores of every grid it may be placed on (``rest`` where one of them shares no host): [Note: the homes'
    cores, before the placement]. ``rest``: as :func:`_placed_bound`'s."""
    d, p, mode, _, m, v = shape
    spreads = shared.spreads(d, p // v)
    if spreads is None:
        return rest
    totals = _chain_totals(shared, global_batch // (d * m))[0]
    forward = m * (totals[7] + p * ACTION_OVERHEAD_S)
    backward = m * (totals[8] + p * ACTION_OVERHEAD_S)
    starts = _update_s(shared.profile.optimizer, shared.grad_bytes, 1.0 if mode == "collective" else 1.0 / d,
                       shared.fastest)
    return min((f * forward + b * backward + o * starts) / rate for (f, b, o), rate in spreads) + rest


def _with_fill(work: float, ranks: float, held: float, chain: float, m: int) -> float:
    """The least ``T`` with ``ranks T >= work + held (k - 1) / 2``, ``k = m chain / T``, and at least
    ``work / ranks``: [Note: a pipeline's fill, before the cut].

    [Note: a pipeline's fill, before the cut] :func:`_placed_bound` adds up, over every rank ``r`` of a
    pipeline of ``p`` stages one a rank, the inequalities of a crowded host's bound with the cut, whose
    terms are each rank's end at its own pace, ``e_r = h_r + W_r + t_r`` (``closed_form.rank_bounds``):
    before the cut it took ``sum W_r`` only. Its fill and drain ``h_r + t_r`` hold at least the forwards
    and backwards of one microbatch through stages ``0..r-1`` (GPipe, 1F1B; ZB-H1 has no drain, and its
    forwards are at least ``phi`` of each stage's compute), so the ranks together hold ``sum_j (p - 1 -
    j) c_j``, ``c_j`` stage ``j``'s compute of one microbatch at the least pace. Whatever the cut, no
    stage has more than ``T / m`` (its rank does ``m`` of it within the step ``T``), and the ``c_j`` add up
    to the chain's ``C``: the sum is least with the last ``k = C m / T`` stages full and the others
    empty, at least ``C (k - 1) / 2`` (ZB-H1: ``phi`` of it, ``held``). So ``ranks T >= work + C (C m / T
    - 1) / 2``, a quadratic in ``T`` whose larger root is the bound. It is the bubble of a pipeline, ``(p -
    1) / (m + p - 1)`` of an even GPipe's step, which the bound over the work alone left out (on 1,000
    nodes over 128 CPU hosts of 8 workers the bounds with the cut sat a median 23% over it).
    """
    if held <= 0.0 or chain <= 0.0:
        return work / ranks
    lean = work - held / 2
    return max(work / ranks, (lean + math.sqrt(lean * lean + 2 * ranks * held * chain * m)) / (2 * ranks))


def _may_fit_anywhere(shared: _Shared, shape: Shape, global_batch: int) -> bool:
    """:func:`_may_fit` before the shape is placed, each stage's room at the most any worker of the list has
    (False only where no placement can fit the shape's replicated cut; always True on a list that mixes CPU
    and GPU workers, where the placement decides the device and so the bytes)."""
    resources = shared.resources
    assert resources is not None
    table = resources.worker_table
    if table.cpu.any() and not table.cpu.all():
        return True
    p, v = shape[1], shape[5]
    on_cuda = not bool(table.cpu.any())
    runtime = 0 if on_cuda else shared.profile.runtime_bytes
    most = shared._get(("most memory",), lambda: float(table.memory.max()))
    return floor_fits(_least_bytes(shared, shape, global_batch), p * with_slack(float(most - runtime) / v))


def _may_fit(shared: _Shared, setup: _Setup, global_batch: int) -> bool:
    """``cutting.may_fit`` of the shape's replicated cut problem, from its memory alone (before its links,
    speeds and cut): most shapes of a search over workers of little memory fit no cut, and leave it here."""
    return floor_fits(_least_bytes(shared, setup.shape, global_batch), setup.room)


def _least_bytes(shared: _Shared, shape: Shape, global_batch: int) -> float:
    """The least bytes any replicated cut of the shape holds over its stages (``cutting.may_fit``'s): every
    node's static bytes, one microbatch's activations per microbatch the emptiest stage holds. The
    activations are summed before they are scaled, a rounding apart from the problem's sum, so the result is
    taken a hair low: a shape left here fits for certain no cut."""
    d, p, mode, sched_name, m, v = shape
    profile = shared.profile
    held = shared._get(("activation sum",), lambda: float(sum(nd.activation_bytes for nd in profile.nodes)))
    scale = global_batch // (d * m) / profile.microbatch_size
    least = shared.static_sum(mode, d) + held * scale * min(stage_holds(sched_name, p, m, v)[0])
    return least * (1 - 1e-12)


# [Note: memory binding, cut within it at once] The min-max programme within memory is the programme
# ignoring it with the cells over memory left out; where the cut ignoring memory fits, its path keeps
# every value along it and no earlier start reaches a value as low, so the cut within memory is that very
# cut (tests/unit/coordinator/planning/test_cut_band.py holds them equal). So the cut ignoring memory only
# saves work where it is shared (one per stages, size, speed and link, where the cut within memory is one
# per problem: schedule, microbatches, limits) and fits. On workers of little memory it mostly does not:
# on GPUs of 8 GiB (1,000 heavy nodes over 1,024 of them) 288 of 306 shapes cut did not fit theirs, and
# the 126 cuts ignoring memory made for them were a quarter of the search. Once half the shapes checked
# (after _BINDING_AFTER) have not fitted, a shape not yet cut ignoring memory is cut within it at once.
_BINDING_AFTER = 8


def _bound_cut(shared: _Shared, setup: _Setup, cutter: Cutter, balance: Sequence[int] | None
               ) -> tuple[int, ...] | None:
    """The cut the shape's replicated candidate is played with: the cutter's ignoring memory where it fits,
    else the cutter's within memory ([Note: a cut within memory, bounded]); None where no cut fits (the
    candidate cannot)."""
    d, p, mode, _, m, _ = setup.shape
    at = setup.at
    bw, lat = at.link
    speed = at.speed
    pace = _pace(speed)
    problem = shared.problem(p, setup.mb, bandwidth_bps=bw, latency_s=lat, speed=min(speed), data_parallel=d,
                             mode=mode, in_flight=setup.in_flight, memory_limit=setup.limit,
                             defers=setup.defer, option=REPLICATED, num_microbatches=m, on_cuda=at.on_cuda,
                             holds=setup.holds, pace=pace)
    key = (p, setup.mb, False, min(speed), pace, bw, lat, id(cutter), tuple(balance or ()))
    if (balance is None and cutter is cut_min_max and key not in shared.free_cuts
            and shared.checked >= _BINDING_AFTER and 2 * shared.bound >= shared.checked):
        # [Note: memory binding, cut within it at once]
        return _memory_cut(shared, problem, cutter, balance) if may_fit(problem) else None
    free = _free_cut(shared, problem, key, cutter, balance)
    if isinstance(free, str):
        return None
    try:
        shared.checked += 1
        return problem.check(free)
    except CutError:  # the play's cut is the cutter's within memory ([Note: a cut within memory, bounded])
        shared.bound += 1
        if not may_fit(problem):
            return None  # no cut fits: the candidate cannot
        return _memory_cut(shared, problem, cutter, balance)  # None: the cutter finds none within memory


def _chain_bound(shared: _Shared, setup: _Setup, bounds: Sequence[int], rest: float) -> float:
    """A lower bound on the step of the shape's replicated candidate with its cut ``bounds``, from its
    stages' compute alone ([Note: a cut's chains, bounded first])."""
    _, p, _, name, m, _ = setup.shape
    at, ranks = setup.at, setup.ranks
    forwards, backwards = shared.sums(setup.mb)[:2]
    cut = np.asarray(bounds)
    fwd = forwards[cut[1:]] - forwards[cut[:-1]]
    sharing = at.sharing(ranks)
    stretch = np.asarray(sharing.least_stretch() if sharing is not None else (1.0,) * ranks)
    pace = np.asarray(at.speed, dtype=np.float64) / stretch[np.arange(p) % ranks]
    each = (fwd + backwards[cut[1:]] - backwards[cut[:-1]]) / pace + 2 * ACTION_OVERHEAD_S
    fill = fwd / pace + ACTION_OVERHEAD_S if name == "zb-h1" else each
    before = np.concatenate([[0.0], np.cumsum(fill)[:-1]])
    work = np.bincount(np.arange(p) % ranks, weights=each, minlength=ranks)
    return float(max((before + m * each).max(), m * work.max())) + rest


# [Note: a cut's chains, bounded first] Once a shape is cut, the cheapest bound with its cut is the
# chains of [Note: the bound] in closed_form.py on its stages' compute alone: stage ``s`` runs its ``m``
# forwards and backwards after microbatch 0's forward came down the stages before it, and (but for ZB-H1,
# which keeps only that forward fill) before microbatch ``m - 1``'s gradients go back up them; and each
# rank runs its stages' ``m`` forwards and backwards. Each stage at the pace of its slowest replica's
# worker over the least stretch its home gives it, its backward the least any list pays, its actions'
# overheads; without the transfers, the stages' starts, a shared host's slowdowns and cores (which only
# add) and the sync (``rest``, as over every cut). It costs a few numpy operations on the cut, where the
# quick bound with the cut ([Note: the cut, bounded quickly]) prices every stage's transfers, starts and
# hosts. On 1,000 nodes over 1,024 workers, of the shapes cut, 269 of 393 leave on it on two GPU
# generations, 292 of 532 on two CPU generations, 100 of 223 on 128 CPU hosts, 118 of 1,208 on hosts
# whose workers want twice their cores (where the hosts' cores, which it leaves out, decide).


def _replicated_bound(profile: Profile, shared: _Shared, setup: _Setup, cutter: Cutter,
                      balance: Sequence[int] | None, loose: float, rest: float | None = None,
                      cut_bounds: Sequence[int] | None = None) -> float:
    """A lower bound on the step of the shape's replicated candidate; inf when it cannot fit (see
    [Note: the fast search]); ``loose``: its bound over every cut.

    ``rest`` given (the bound over every cut's part that is not the pipeline's, :func:`_cut_free_parts`),
    the quicker bound with the cut ([Note: the cut, bounded quickly]); not for ZB-H1, whose bound is not
    monotone in its ``W``.

    [Note: the cut, bounded quickly] The bound with the cut is dear where a stage's backward is priced as
    its list runs it (:func:`_backwards`: the held weight gradients, their products) and the sync stage by
    stage (the CPU floor of each placement's hosts); what lifts it over the bound with the placement is
    mostly the pipeline's fill and drain, which only the cut's stage sizes decide. So a shape is first
    bounded with its cut, each stage's backward at the least any list pays (``_Shared.sums``: at most what
    ``_backwards`` gives it) and the sync and the messages as over every cut (``rest``); the pipeline's
    terms (``closed_form.rank_bounds``, the host's cores, a crowd's slowdown) only grow with their costs, so
    this is at most the full bound's pipeline plus at most its rest. ZB-H1's chain after its last ``I``
    shrinks as its ``W`` grows, so its bound takes no lower ``W``: it goes to the full bound at once. On
    1,000 nodes over 128 CPU hosts of 8 workers, 202 shapes get the quick bound and 67 the full one, where
    239 got the full one: the bounds took a third less time (docs/benchmarks.md, "Planning at cluster
    size")."""
    d, p, mode, sched_name, m, v = setup.shape
    at, mb = setup.at, setup.mb
    bw, lat = at.link
    speed = at.speed
    bounds = _bound_cut(shared, setup, cutter, balance) if cut_bounds is None else tuple(cut_bounds)
    if bounds is None:
        return math.inf  # no cut fits, or none the cutter finds within memory: the candidate cannot
    sums = shared.sums(mb)  # prefix sums over the nodes: forward, backward, gradient and parameter bytes
    cut = np.asarray(bounds)
    fwd, least, grads, params = ((x[cut[1:]] - x[cut[:-1]]).tolist() for x in sums)
    if rest is not None:  # quick: the least backward any list pays ([Note: the cut, bounded quickly])
        assert sched_name != "zb-h1", "the quick bound passes no W"
        bwd, wgt = [least[s] / speed[s] for s in range(p)], [0.0] * p
    else:  # the backwards as the simulator is given them (the schedule's lists say how each runs)
        bwd, wgt, _ = _backwards(shared, mb, list(itertools.pairwise(bounds)), (sched_name, p, m, v),
                                 setup.defer, setup.precision, False, speed, d == 1)  # a tail only adds
    fwd_bytes, bwd_bytes = shared.scaled(mb)
    # the slowdown of a shared host where it is certain (replicas on one host), else none: a lower bound
    certain = [at.shared_host and twin for twin in at.twins]
    sharing = at.sharing(setup.ranks)
    turns = _turns(sharing, p, setup.ranks)  # a host's turns slow its ranks throughout: certain too
    forward = [(fwd[s] / speed[s] * (1 + (SHARED_HOST_FORWARD_SLOWDOWN - 1) * certain[s]) + ACTION_OVERHEAD_S)
               * turns[s] for s in range(p)]
    slowed = [1 + (SHARED_HOST_BACKWARD_SLOWDOWN - 1) * certain[s] for s in range(p)]
    backward = [(bwd[s] * slowed[s] + ACTION_OVERHEAD_S) * turns[s] for s in range(p)]
    if sharing is not None:  # a rank that wants more cores than its home has runs slower whenever busy
        stretch = sharing.least_stretch()
        forward = [t * stretch[s % setup.ranks] for s, t in enumerate(forward)]
        backward = [t * stretch[s % setup.ranks] for s, t in enumerate(backward)]
    weights = _weights(bwd, wgt)
    inner = bounds[1:-1]
    share = 1.0 if mode == "collective" else 1.0 / d
    start = [_update_s(profile.optimizer, grads[s], share, speed[s]) for s in range(p)]
    # W in the same share of each backward as the simulator is given
    shares = ([w * backward[s] / (bwd[s] + ACTION_OVERHEAD_S) for s, w in enumerate(weights)] if weights
              else [t * DEFAULT_WEIGHT_FRACTION for t in backward])
    sends = [_transfer(fwd_bytes[c], bw, lat) for c in inner]
    grads_s = [_transfer(bwd_bytes[c], bw, lat) for c in inner]
    ends, occupied = rank_bounds(sched_name, m, setup.ranks, forward, backward, sends, grads_s, start, shares)
    chains = stage_bounds(sched_name, m, setup.ranks, forward, backward, sends, grads_s, start)  # interleaved
    pipeline = max(*ends, chains)
    if sharing is not None:
        held = [range(k, p, setup.ranks) for k in range(setup.ranks)]
        starts = [sum(start[s] for s in ss) for ss in held]
        # [Note: a host's fill] rank r starts no forward or backward before its own start and microbatch 0's
        # forward through stages 0..r-1 (its first chunk's: each on its rank, at its pace at most) and their
        # sends: a host whose ranks are all deep in the pipeline computes nothing until the fill reaches them
        ready = list(itertools.accumulate(range(1, setup.ranks), lambda t, r: max(
            starts[r], t + forward[r - 1] + sends[r - 1]), initial=starts[0]))
        # a host's cores do at most their count of seconds of work per second
        pipeline = max(pipeline, sharing.least_time(
            [m * sum(fwd[s] / speed[s] + ACTION_OVERHEAD_S for s in ss) for ss in held],
            [m * sum(bwd[s] + ACTION_OVERHEAD_S for s in ss) for ss in held], starts, ready))
        # and its busy workers slow each other (the stages slowed for certain above are slowed already)
        pipeline = max(pipeline, sharing.crowded_time(
            ends, occupied, [m * sum(forward[s] for s in ss if not certain[s]) for ss in held],
            [m * sum(backward[s] for s in ss if not certain[s]) for ss in held]))
    if rest is not None:
        return max(loose, pipeline + rest)
    sync = [0.0] * p
    if d > 1:
        slow = 1.0 if sharing is None else sharing.most_stretch()  # the most a backward is stretched
        assert shared.resources is not None
        starved = at.starved  # the candidate's CPU floor, as it has it
        for s in range(p):
            hidden = (bwd[s] + ACTION_OVERHEAD_S) * slow  # at most the whole backward hides it
            link_bw, link_lat = at.stage_link(s)
            cpu = starved[s] * _sync_cpu(mode, REPLICATED, d, grads[s], speed[s])
            sync[s] = (sharded_sync(REPLICATED, d, grads[s], params[s], hidden=hidden, compute_s=0.0,
                                    num_microbatches=m, bandwidth=COLLECTIVE_EFFICIENCY * link_bw,
                                    latency=link_lat, unhideable=cpu) if mode == "collective"
                       else max(_sync(mode, grads[s], d, hidden, link_bw, link_lat), cpu))
    sync_time = max(sum(sync[s] for s in range(k, p, setup.ranks)) for k in range(setup.ranks))
    check = max(grads[s] / speed[s] for s in range(p)) / GRADIENT_CHECK_BANDWIDTH_BPS
    return max(loose, float(pipeline + sync_time + 2 * CONTROL_MESSAGE_S + check))


# Shapes whose bound is within this share of the best step played so far are played too: the bound and
# the simulator round differently, and the ranking compares steps to 9 significant digits.
_BOUND_SLACK = 1e-8
# [Note: a flat search] After this many plays or bounds with a cut, a shape whose bound is within
# _SEARCH_GAP of the best step played is not looked at: the plan is then within that share of the best.
_EXACT_PLAYS = 16
_EXACT_CUTS = 64
_SEARCH_GAP = 1e-2


def _fast_choice(profile: Profile, resources: Resources, request: PlanConfig, global_batch: int,
                 automatic: Automatic, cutter: Cutter, shapes: Sequence[Shape]) -> Plan | None:
    """The plan :func:`choose_plan` picks among the replicated candidates, by branch and bound: None when
    no replicated candidate fits (see [Note: the fast search])."""
    best = _fastest_replicated(profile, resources, request, global_batch, automatic, cutter, shapes, 1)
    return best[0].plan if best else None


def _fastest_replicated(profile: Profile, resources: Resources, request: PlanConfig, global_batch: int,
                        automatic: Automatic, cutter: Cutter, shapes: Sequence[Shape], count: int
                        ) -> list[Candidate]:
    """The ``count`` best fitting replicated candidates (``_rank``, then enumeration order), best first, by
    branch and bound against the ``count``-th best step played (fewer when fewer fit). In a flat search
    ([Note: a flat search]) the first is the one the search for the best alone stops at (the plan
    :func:`choose_plan` picks), then the others by rank: one may be quicker than it, within the gap."""
    kept: list[tuple[tuple[float, int, int, tuple[int, int, int], float], int, Candidate]] = []
    shared = _Shared(profile, resources)
    chosen: Candidate | None = None  # in a flat search: where the search for the best alone stopped

    def step(k: int) -> float:
        plan = kept[k][2].plan if kept else None
        return plan.step_time_s if plan is not None else math.inf

    def past(bound: float, flat: bool) -> bool:  # whether no shape from ``bound`` on need be played
        nonlocal chosen
        nth = step(-1) if len(kept) == count else math.inf
        if not flat:
            return bound > nth * (1 + _BOUND_SLACK)
        if chosen is None and kept and bound > step(0) * (1 - _SEARCH_GAP):
            chosen = kept[0][2]
        return bound > nth * (1 - _SEARCH_GAP)

    for index, cand in _bound_order(profile, shared, request, global_batch, automatic, cutter, shapes, past):
        if cand.fits:
            kept.append((_rank(cand), index, cand))
            kept.sort(key=lambda k: k[:2])
            del kept[count:]
    if chosen is None:
        return [c for _, _, c in kept]
    return [chosen, *(c for _, _, c in kept if c is not chosen)][:count]


def _bound_order(profile: Profile, shared: _Shared, request: PlanConfig, global_batch: int,
                 automatic: Automatic, cutter: Cutter, shapes: Sequence[Shape],
                 past: Callable[[float, bool], bool]) -> Iterator[tuple[int, Candidate]]:
    """The replicated candidates of ``shapes`` (with their indices) in the order of their bounds, until
    ``past(bound, flat)`` holds for the next bound (asked after each; ``flat``: past the exact search's
    effort, [Note: a flat search]): first every shape's bound over all cuts
    (:func:`_cut_free_bounds`, sorted once), then, when a shape comes up, its bound with its placement (a
    heap), then with its cut, then its play. Equal bounds go in enumeration order."""
    resources = shared.resources
    assert resources is not None
    bounds, rests = _cut_free_parts(shared, shapes, global_batch)
    loose, rest = bounds.tolist(), rests.tolist()
    order = iter(np.lexsort((np.arange(len(shapes)), bounds)).tolist())  # by bound, then index
    tight: list[tuple[float, int]] = []  # (bound with the placement, or with the cut too; index)
    # a shape in ``tight``: 1 bounded with the homes' cores of its placements, 2 with its placement, 3 with
    # its cut's chains, 4 with its cut quickly, 5 with its cut
    level: dict[int, int] = {}
    setups: dict[int, _Setup] = {}  # the setups of the shapes not yet bounded with their cut in full
    cut_of: dict[int, tuple[int, ...]] = {}  # their cuts, once cut
    plays = cuts = 0  # the shapes played, and bounded with their cut
    upcoming = next(order, None)
    while upcoming is not None or tight:
        if tight and (upcoming is None or tight[0] < (loose[upcoming], upcoming)):
            bound, index = heapq.heappop(tight)
            stage = level.pop(index)
        else:
            assert upcoming is not None
            bound, index, stage = loose[upcoming], upcoming, 0
            upcoming = next(order, None)
        if past(bound, plays > _EXACT_PLAYS or cuts > _EXACT_CUTS):
            return  # every shape left is slower than the limit: none of them can win, nor tie
        shape = shapes[index]
        if stage == 0:  # first up: bounded with the homes' cores of every placement it may get
            homes = _homes_bound(shared, shape, global_batch, rest[index])
            if homes > bound:
                level[index] = 1
                heapq.heappush(tight, (homes, index))
                continue
        if stage <= 1:  # up again (or at once): placed, and bounded with its placement
            if not _may_fit_anywhere(shared, shape, global_batch):
                continue  # no placement gives its chain room for any cut
            setup = _setup(shared, shape, global_batch, request, automatic)
            if REPLICATED in setup.options and _may_fit(shared, setup, global_batch):
                setups[index], level[index] = setup, 2
                heapq.heappush(tight, (max(bound, _placed_bound(shared, setup, rest[index])), index))
            continue
        if stage == 2:  # up again: cut, and bounded with its cut's chains ([Note: a cut's chains, ...])
            edges = _bound_cut(shared, setups[index], cutter, request.balance)
            if edges is None:
                del setups[index]
                continue
            cut_of[index], level[index] = edges, 3
            chained = _chain_bound(shared, setups[index], edges, rest[index])
            heapq.heappush(tight, (max(bound, chained), index))
            continue
        if stage == 3 and shape[3] != "zb-h1":  # up again: bounded with its cut quickly
            cuts += 1
            cut = _replicated_bound(profile, shared, setups[index], cutter, request.balance, loose[index],
                                    rest[index], cut_of[index])
            level[index] = 4
            heapq.heappush(tight, (max(bound, cut), index))
            continue
        if stage <= 4:  # up again: bounded with its cut
            cuts += 1
            cut = _replicated_bound(profile, shared, setups.pop(index), cutter, request.balance, loose[index],
                                    cut_bounds=cut_of.pop(index))
            level[index] = 5
            heapq.heappush(tight, (max(bound, cut), index))
            continue
        plays += 1
        yield index, _evaluate(profile, resources, shape, global_batch, cutter, request.cutter,
                               request.balance, request, automatic, shared=shared, only=REPLICATED)[0]


def _cut_free_bounds(shared: _Shared, shapes: Sequence[Shape], global_batch: int) -> np.ndarray:
    """:func:`_cut_free_parts`' bounds."""
    return _cut_free_parts(shared, shapes, global_batch)[0]


def _cut_free_parts(shared: _Shared, shapes: Sequence[Shape], global_batch: int, *, replicated: bool = True
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per shape, a lower bound on its replicated candidate's step over every cut and placement, and what of
    it is not the pipeline's (the sync, the messages, the check: what :func:`_placed_bound` adds): the
    pipeline's (``closed_form.cut_free_bound`` on the chain's totals at the shape's microbatch size, on the
    fastest worker and link, with a shared host's slowdown where any placement has it: more replicas than
    hosts of CPU workers), plus the least unhidden sync and the overheads (see [Note: the fast search]).
    ``replicated`` False: a bound on every memory option's step, without the updates and the sync
    ([Note: a search where nothing replicated fits])."""
    resources = shared.resources
    assert resources is not None
    if not shapes:
        return np.zeros(0), np.zeros(0)
    columns = [list(map(operator.itemgetter(k), shapes)) for k in range(6)]  # zip(*shapes) is 10x slower
    d, p, m, v = (np.array(columns[k], dtype=np.int64) for k in (0, 1, 4, 5))
    collective = np.array(columns[2]) == "collective"
    codes = {name: KINDS.get(name, BUSIEST) for name in set(columns[3])}
    kind = np.array([codes[name] for name in columns[3]], dtype=np.int64)
    ranks = p // v
    mb = global_batch // (d * m)
    sizes, which = np.unique(mb, return_inverse=True)
    totals = np.array([_chain_totals(shared, int(size)) for size in sizes])  # [size, slowed?, field]
    workers = resources.workers
    on_cpu = all(w.device == "cpu" for w in workers)
    spread = len({w.host for w in workers if w.host is not None}) + sum(w.host is None for w in workers)
    slowed = (on_cpu & (d > spread)).astype(np.int64)  # twins on every stage, wherever they are placed
    row = totals[which, slowed]  # the fields of _chain_totals
    cuts = [_cut_costs(shared, int(size)) for size in sizes]
    longest = max(len(c[1]) for c in cuts)
    cheapest = np.array([c[1] + [math.inf] * (longest - len(c[1])) for c in cuts])  # [size, cuts crossed]
    transfer = 2 * cheapest[which, np.minimum(p - 1, longest - 1)]
    fastest, grads = shared.fastest, shared.grad_bytes
    # every option's bound ([Note: a search where nothing replicated fits]): no update, no sync
    share = np.where(collective, 1.0, 1.0 / d) if replicated else np.zeros(len(d))
    start = share * _update_s(shared.profile.optimizer, grads, 1.0, fastest)
    least_cut = np.array([c[0] for c in cuts])[which]
    loose = cut_free_bound(kind, m, p, ranks, row[:, 0] + 2 * p * ACTION_OVERHEAD_S, transfer, start,
                           row[:, 1] + 2 * ACTION_OVERHEAD_S, row[:, 2] + 2 * ACTION_OVERHEAD_S,
                           np.where(p > 1, least_cut, 0.0), row[:, 3],
                           row[:, 5] + p * ACTION_OVERHEAD_S,  # a measured I's share of the overhead: none
                           row[:, 6] + ACTION_OVERHEAD_S)
    pipeline: np.ndarray = np.maximum(loose, _host_bound(resources, d, m, ranks, totals[which, 1, 0],
                                                p * ACTION_OVERHEAD_S, np.where(ranks > 1, transfer, 0.0),
                                                start))
    # the work over the most speed any d x ranks of the workers give a replica's ranks
    unit = totals[which, 0, 0] * fastest  # the chain's forwards and least backwards at speed 1
    updates = share * _update_s(shared.profile.optimizer, grads, 1.0, 1.0)
    fill = np.where(p != ranks, 0.0, np.where(kind == FILL_AND_DRAIN, 1.0,
                                              np.where(kind == FILL, totals[which, 0, 3], 0.0)))
    pipeline = np.maximum(pipeline, _paced(unit, updates, m, p, float(resources.worker_table.speed.min()),
                                           _speed_sums(resources, d, ranks), fill,
                                           totals[which, 0, 0] + 2 * p * ACTION_OVERHEAD_S))
    # the sync: a rank's at least the mean of the stages' (their latencies left out: a stage without
    # gradients has none); collective replicas hide at most the whole backward, slowed and waiting for
    # cores as much as a host can make it, on the slowest
    # a stage's replicas on more workers than a host holds span hosts: their slowest link joins two hosts
    bandwidth = COLLECTIVE_EFFICIENCY * np.where(d > resources.most_on_a_host,
                                                 resources.fastest_link_between_hosts[0],
                                                 resources.fastest_link[0])
    hidden = row[:, 4] * _most_stretch(resources, d * ranks) / min(w.speed for w in workers)
    sync = np.where(collective, np.maximum(0.0, 2 * (d - 1) / d * grads / bandwidth - hidden),
                    2 * grads / bandwidth)
    sync = np.where(d > 1, sync / ranks, 0.0) if replicated else np.zeros(len(d))
    check = grads / p / fastest / GRADIENT_CHECK_BANDWIDTH_BPS
    rest = sync + 2 * CONTROL_MESSAGE_S + check
    return pipeline + rest, rest


def _paced(unit: np.ndarray, updates: np.ndarray, m: np.ndarray, p: np.ndarray, slowest: float,
           speeds: np.ndarray, fill: np.ndarray, chain: np.ndarray) -> np.ndarray:
    """The least pipeline time of a replica whose ranks' speeds add up to at most ``speeds``, none under
    ``slowest``: [Note: the speed a shape's ranks can have]. ``unit``: every node's forward and least
    backward at speed 1; ``updates``: every stage's share of the optimizer step at speed 1; ``chain``: one
    microbatch's forwards and backwards through every stage at the fastest pace, ``fill`` the share of it
    the ranks' fill and drain hold at least: :func:`_with_fill`'s quadratic over arrays (that one stays in
    floats: the bound with the placement asks it of thousands of shapes one at a time)."""
    work = (m * (unit + 2 * p * ACTION_OVERHEAD_S * slowest) + updates) / slowest
    ranks = speeds / slowest
    held = fill * chain
    lean = work - held / 2
    with np.errstate(invalid="ignore"):
        filled = (lean + np.sqrt(lean * lean + 2 * ranks * held * chain * m)) / (2 * ranks)
    out: np.ndarray = np.where((held > 0) & (chain > 0), np.maximum(work / ranks, filled), work / ranks)
    return out


def _speed_sums(resources: Resources, d: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Per shape, the most the ``ranks`` ranks of a replica's pipeline can add up to in speed, each rank at
    its slowest of ``d`` replicas' workers, over every choice of ``d x ranks`` of the workers: the workers
    taken fastest first, ``d`` a rank.

    [Note: the speed a shape's ranks can have] The bounds over every cut price the chain on the fastest
    worker, which is right for a list of alike workers and loose for a mixed one: on 1,024 workers, half
    of them half as fast (two generations of GPUs, or of hosts), a shape that needs more than the fast half
    runs some stages at half the pace, and 1,622 shapes came up to be cut where 66 do now. A play runs
    each stage at its slowest replica's speed ``s_r`` (:class:`_Placed`), so rank ``r`` is busy at least
    ``(its stages' work at speed 1) / s_r`` plus its actions' overheads and its start (the optimizer step,
    also over ``s_r``). The step is at least each rank's busy time, hence at least their mean weighted by
    ``s_r``: every node's forward and least backward, every stage's update at speed 1 and the overheads
    times at least the slowest speed, over ``sum_r s_r``; before the placement ``sum_r s_r`` is at most
    what the fastest ``d x ranks`` workers give, ``d`` to a rank, and after it the placement's own
    (:func:`_placed_bound`). A pipeline's fill and drain add as in [Note: a pipeline's fill, before the
    cut], its chain priced on the fastest worker and weighted by the slowest speed (:func:`_paced`). On
    alike workers this is the work over the ranks, which the other bounds hold already."""
    fastest_first = np.sort(resources.worker_table.speed)[::-1]
    out = np.zeros(len(d))
    for each in np.unique(d).tolist():
        slowest_of = np.cumsum(fastest_first[each - 1::each])  # rank r's slowest: the (r + 1) d-th fastest
        at = d == each
        out[at] = slowest_of[ranks[at] - 1]
    return out


def _host_bound(resources: Resources, d: np.ndarray, m: np.ndarray, ranks: np.ndarray, weighted_s: np.ndarray,
                actions_s: np.ndarray, transfer_s: np.ndarray, start_s: np.ndarray) -> np.ndarray:
    """Per shape, the least time one host's cores need for the work of every worker of the shape, where
    every worker is a CPU worker of one host (0 elsewhere, and for one worker: the pipeline's bound has it).

    [Note: the host's cores bound] Per replica and microbatch, the shape's ranks compute the chain's
    forwards and backwards (``weighted_s``: on the fastest worker, each weighted by its shared-host
    slowdown), run ``p`` forward and ``p`` backward actions (``actions_s`` of overhead for each kind, slowed
    as its kind) and pay the transfers at both ends of at least the ``p - 1`` cheapest cuts (``transfer_s``,
    at their own pace; none when a replica is one worker); and each replica applies its update first
    (``start_s``). In the simulator ([Note: shared cores] in ``coordinator/planning/simulator.py``) a busy
    worker of ``k`` threads at pace ``x`` uses ``k x`` of the host's ``c`` cores and does ``x / slowdown``
    of its forward or backward while another worker is busy: the ``n = d R`` workers together do at most
    ``min(c, n k_max)`` seconds of that weighted work, times their threads, per second. One worker alone
    (only when ``d = 1``: replicas of a rank are busy together) does at most ``slowdown min(k_max, c)``.
    So the step is at least ``k_min d (m (weighted + actions + transfers) + start)`` over the larger of the
    two, whatever the cut and the placement (on one host every placement shares it). Where the shape's
    workers want more cores than the host has, they take turns throughout
    (:data:`SHARED_HOST_TURNS_SLOWDOWN`): their forwards and backwards weigh that much more.
    """
    workers = resources.workers
    hosts = {w.host for w in workers}
    if len(workers) < 2 or any(w.device != "cpu" for w in workers) or len(hosts) != 1 or None in hosts:
        return np.zeros(len(d))
    cores = float(resources.host_cores(workers[0].name))
    k_min, k_max = min(w.cpus for w in workers), max(w.cpus for w in workers)
    fs, bs = SHARED_HOST_FORWARD_SLOWDOWN, SHARED_HOST_BACKWARD_SLOWDOWN
    turns = np.where(d * ranks * k_min > cores, SHARED_HOST_TURNS_SLOWDOWN, 1.0)  # they take turns throughout
    work = k_min * d * (m * (turns * (weighted_s + (fs + bs) * actions_s) + transfer_s) + start_s)
    alone = np.where(d == 1, max(fs, bs) * min(k_max, cores), 0.0)
    capacity = np.maximum(np.minimum(cores, d * ranks * k_max), alone)
    out: np.ndarray = np.where(d * ranks > 1, work / capacity, 0.0)
    return out


def _most_stretch(resources: Resources, workers: np.ndarray) -> np.ndarray:
    """Per shape of ``workers`` workers, the most a backward can be stretched on a shared host, whatever
    the placement: the backward's slowdown times the threads at most busy on a host over its cores."""
    groups: set[tuple[int, int, int]] = set()  # per host: its cores, its workers' threads, the most a worker
    for names in resources.host_groups:
        each = [resources.worker(n).cpus for n in names]
        groups.add((resources.host_cores(names[0]), sum(each), max(each)))
    share = np.ones(len(workers))
    for cores, threads, most in groups:
        share = np.maximum(share, np.minimum(workers * most, threads) / cores)
    turns = np.where(share > 1.0, SHARED_HOST_TURNS_SLOWDOWN, 1.0)  # more threads than cores take turns
    out: np.ndarray = SHARED_HOST_BACKWARD_SLOWDOWN * share * turns
    return out


def _chain_totals(shared: _Shared, mb: int) -> list[list[float]]:
    """At microbatch ``mb`` on the fastest worker, unslowed and slowed as on a shared host: every node's
    forward and least backward together, the heaviest node's and the lightest's, the least share of a
    stage's compute it spends forward (with its dearest backward; an action's overhead is half: 0.5 at
    most), the dearest backward alone (raw), and every node's forward and least input gradient (``I``: at
    least ``1 - DEFAULT_WEIGHT_FRACTION`` of its least backward) together and the lightest node's; then every
    node's forward together, and every node's least backward (``Sharing.spread_time`` weighs them apart)."""
    def make() -> list[list[float]]:
        fastest = shared.fastest
        f = np.array([t for t, _ in shared.times(mb)], dtype=np.float64)
        # a node's backward as the cheapest list runs it, and as the dearest (see _backwards)
        b, most = (np.array(x, dtype=np.float64) for x in zip(*shared.backward_range(mb), strict=True))
        both = f + most
        # the least forward share whatever the slowdown (forward unslowed, backward slowed most)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(both > 0, f / (f + most * SHARED_HOST_BACKWARD_SLOWDOWN), 0.5)
        phi = float(min(0.5, share.min()))
        out = []
        for sf, sb in ((1.0, 1.0), (SHARED_HOST_FORWARD_SLOWDOWN, SHARED_HOST_BACKWARD_SLOWDOWN)):
            node = (f * sf + b * sb) / fastest
            inputs = (f * sf + (1.0 - DEFAULT_WEIGHT_FRACTION) * b * sb) / fastest  # F and I at least
            out.append([float(node.sum()), float(node.max()), float(node.min()), phi, float(most.sum()),
                        float(inputs.sum()), float(inputs.min()), float((f * sf / fastest).sum()),
                        float((b * sb / fastest).sum())])
        return out
    return shared._get(("chain totals", mb), make)


def _cut_costs(shared: _Shared, mb: int) -> tuple[float, list[float]]:
    """What a stage boundary costs one endpoint per microbatch on the fastest link: the cheapest cut's,
    and the sums of the ``k`` cheapest cuttable cuts' for every ``k`` (``p`` stages cross ``p - 1``)."""
    def make() -> tuple[float, list[float]]:
        resources = shared.resources
        assert resources is not None
        bw, lat = resources.fastest_link
        fwd_bytes, bwd_bytes = (np.array(x, dtype=np.float64)[1:-1] for x in shared.scaled(mb))
        cuttable = np.array([c.cuttable for c in shared.profile.cuts[1:-1]], dtype=bool)

        def transfer(nbytes: np.ndarray) -> np.ndarray:  # _transfer's arithmetic, element by element
            return np.where(nbytes <= 0, 0.0, TRANSFER_OVERHEAD_S + lat + nbytes / bw)

        costs = np.sort((transfer(fwd_bytes) + transfer(bwd_bytes))[cuttable])
        return (float(costs[0]) if len(costs) else 0.0), [0.0, *np.cumsum(costs).tolist()]
    return shared._get(("cut costs", mb), make)


@dataclass(frozen=True)
class CellBytes:
    """What one cell holds whatever the batch: the input of :func:`memory_floor`."""

    name: str
    num_params: int  # parameter elements
    param_bytes: int
    buffer_bytes: int
    trainable_bytes: int  # of parameters that take a gradient (and optimizer state)


def _min_max_split(sizes: Sequence[float], parts: int) -> float:
    """The least possible largest part of ``sizes`` split into at most ``parts`` contiguous parts."""
    def split(limit: float) -> tuple[int, float]:  # greedy parts under ``limit``: their count and largest
        used, total, largest = 1, 0.0, 0.0
        for size in sizes:
            if total + size > limit:
                used, total = used + 1, size
            else:
                total += size
            largest = max(largest, total)
        return used, largest

    low, high = max(sizes, default=0.0), float(sum(sizes))
    while high - low > 1.0:  # bisection to a byte, then the split's own largest part: exact
        mid = (low + high) / 2
        low, high = (low, mid) if split(mid)[0] <= parts else (mid, high)
    return split(high)[1]


def memory_floor(cells: Sequence[CellBytes], num_workers: int, optimizer: str,
                 zero: Sequence[int] = (0,), offload: bool = False) -> tuple[float, str]:
    """The least static bytes any plan puts on one worker, and the shape that reaches it.

    See [Note: the memory floor]; ``optimizer`` is a key of ``OPTIMIZER_STATE_FACTORS``; ``zero``: the
    ZeRO stages plans may use (sharded over all of a stage's replicas); ``offload``: whether the
    optimizer state may leave the workers' memory (CUDA workers).
    """
    factor = OPTIMIZER_STATE_FACTORS.get(optimizer, OPTIMIZER_STATE_FACTORS["adam"])
    best, shape = math.inf, ""
    for d in range(1, num_workers + 1):
        p = max(1, min(num_workers // d, len(cells)))
        options = [(m, z) for m in get_args(Mode) for z in sorted(set(zero) | {0})
                   if (m == "collective" or z == 0) and (d > 1 or (m == "collective" and z == 0))]
        for mode, z in options:
            f = d if z else 1
            share = 1.0 / d if mode == "parameter_server" else None
            state = [0.0 if offload else int(c.trainable_bytes * factor) / f if share is None
                     else (int(c.trainable_bytes * factor) + c.param_bytes) * share for c in cells]
            params = [c.param_bytes / (f if z >= 3 else 1) + c.buffer_bytes for c in cells]
            static = [pb + c.trainable_bytes / (f if z >= 2 else 1) + st
                      for pb, c, st in zip(params, cells, state, strict=True)]
            # one stage holds every cell: ZeRO-3 gathers its largest (a floor of more stages leaves it out)
            gathered = ZERO3_GATHERED_UNITS * max((c.param_bytes for c in cells), default=0)
            need = _min_max_split(static, p) + (gathered if z >= 3 and p == 1 else 0)
            if need < best:
                sharded = f", ZeRO-{z}" if z else ""
                best, shape = need, f"{d} replica(s) x {p} stage(s), {mode}{sharded}"
    return best, shape


def _count(n: int) -> str:
    """``805_306_368`` -> ``"805M"``: three significant digits and a K, M or B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def check_memory_floor(cells: Sequence[CellBytes], resources: Resources, optimizer: str,
                       request: PlanConfig | None = None) -> None:
    """Refuse a model no plan over ``resources`` holds (see [Note: the memory floor]).

    The plan section ``request`` (None: nothing fixed) says which ZeRO stages and whether offload
    count: those it fixes, else those the planner may choose (``memory.AUTOMATIC``).

    Raises:
        PlanningError: Naming the model's bytes, the least per worker, the largest worker and the fixes.
    """
    request = request or _SEARCH_ALL
    zero = (request.zero,) if request.zero is not None else memory.AUTOMATIC.zero
    offload = (request.offload if request.offload is not None else memory.AUTOMATIC.offload) and any(
        w.device == "cuda" for w in resources.workers)
    need, shape = memory_floor(cells, resources.num_workers, optimizer, zero, offload)
    budget = max(w.memory_bytes for w in resources.workers)
    if need <= budget + MEMORY_SLACK * max(1.0, budget):
        return
    count = sum(c.num_params for c in cells)
    params, grads = sum(c.param_bytes for c in cells), sum(c.trainable_bytes for c in cells)
    state = int(grads * OPTIMIZER_STATE_FACTORS.get(optimizer, OPTIMIZER_STATE_FACTORS["adam"]))
    raise PlanningError(
        f"the model is too big for these workers: its {_count(count)} parameters "
        f"({format_bytes(params)}), their gradients ({format_bytes(grads)}) and {optimizer} optimizer state "
        f"({format_bytes(state)}) need at least {format_bytes(need)} on one worker even spread over "
        f"{resources.num_workers} workers ({shape}), and the largest worker has {format_bytes(budget)}; "
        "give the workers more memory, add workers, or train a smaller model or with an optimizer that "
        f"keeps less state (SGD){_sharded_floor(cells, resources, optimizer, zero, budget)}")


def _sharded_floor(cells: Sequence[CellBytes], resources: Resources, optimizer: str, counted: Sequence[int],
                   budget: float) -> str:
    """``; ZeRO-3 would bring it to ...``: when a ZeRO stage the floor did not count would fit."""
    if 3 in counted:
        return ""
    need, shape = memory_floor(cells, resources.num_workers, optimizer, (0, 1, 2, 3))
    if need > budget + MEMORY_SLACK * max(1.0, budget):
        return ""
    return (f"; sharding its state would bring it to {format_bytes(need)} per worker ({shape}): leave "
            "plan.zero open or set it to 3")


def balance_bounds(balance: Sequence[int]) -> tuple[int, ...]:
    """Nodes per stage (torchgpipe's ``balance``) -> boundaries: ``[2, 3]`` -> ``(0, 2, 5)``."""
    bounds = [0]
    for size in balance:
        bounds.append(bounds[-1] + size)
    return tuple(bounds)


def candidate_plans(profile: Profile, resources: Resources, request: PlanConfig = _SEARCH_ALL, *,
                    global_batch: int, automatic: Automatic | None = None,
                    exhaustive: bool = False, limit: int | None = None,
                    fitting_only: bool = False) -> list[Candidate]:
    """Evaluates every plan shape the request allows (see :func:`choose_plan` for the arguments).

    Args:
        automatic: The memory options the search may choose (default: ``memory.AUTOMATIC``).
        exhaustive: Evaluate every memory option of every shape, recompute included where an option
            without it fits (see [Note: choosing the memory options]).
        limit: Only the ``limit`` best plans in the order :func:`choose_plan` picks from (``cellmesh
            plan``'s runners-up): when at least that many replicated plans without recompute fit, those,
            found by the fast search's branch and bound (see [Note: the fast search]); else, when at least
            that many candidates of any memory option fit, the fastest of them, found by the bound over
            every option ([Note: a search where nothing replicated fits]); else every candidate evaluated,
            fitting ones first, fastest first. None: every candidate.
        fitting_only: A candidate whose cut cannot meet memory is not played: it comes without a plan (its
            reason says why), as only the fitting ones are asked for.

    Returns:
        Per shape, one :class:`Candidate` per memory option evaluated, fitting or not, in enumeration
        order; with ``limit``, at most ``limit`` candidates, best first.

    Raises:
        PlanningError: If the fixed fields contradict the model or the resources, or the cutter is unknown.
    """
    cut_fn, sharded = _shapes(profile, resources, request, global_batch)
    automatic = automatic or memory.AUTOMATIC  # read when called: a merge or a test may widen it
    if limit is not None:
        if not exhaustive and MemoryOption(offload=bool(request.offload)) == REPLICATED:
            best = _fastest_replicated(profile, resources, request, global_batch, automatic, cut_fn, sharded,
                                       limit)
            if len(best) >= limit:
                return best
        if not exhaustive:  # the fastest of every option, where that many fit
            best = _fastest_of_every_option(profile, resources, request, global_batch, automatic, cut_fn,
                                            sharded, limit)
            if len(best) >= limit:
                return best
        every = candidate_plans(profile, resources, request, global_batch=global_batch, automatic=automatic,
                                exhaustive=exhaustive)
        order = {id(c): i for i, c in enumerate(every)}
        return sorted(every, key=lambda c: (not c.fits, _rank(c) if c.plan is not None else (math.inf,),
                                            order[id(c)]))[:limit]
    shared = _Shared(profile, resources)
    return [c for sh in sharded for c in _evaluate(profile, resources, sh, global_batch, cut_fn,
                                                   request.cutter, request.balance, request, automatic,
                                                   exhaustive, shared, fitting_only=fitting_only)]


def _shapes(profile: Profile, resources: Resources, request: PlanConfig,
            global_batch: int) -> tuple[Cutter, list[Shape]]:
    """The cutter and the shapes to evaluate.

    Raises:
        PlanningError: If the fixed fields contradict the model or the resources, or the cutter is unknown.
    """
    try:
        cut_fn = get_cutter(request.cutter)
    except ValueError as exc:
        raise PlanningError(str(exc)) from None
    max_stages = 1 + sum(c.cuttable for c in profile.cuts[1:-1])
    fixed = resolve(request, profile.num_nodes, max_stages, resources.num_workers)
    shapes = plan_shapes(request, fixed, global_batch)
    sharded = [sh for sh in shapes if _shards_as_asked(request, sh)] if request.zero else shapes
    if shapes and not sharded:
        factor = f" in groups of plan.shard_factor={request.shard_factor}" if request.shard_factor else ""
        raise PlanningError(f"plan.zero={request.zero} shards a stage's state across 2 or more collective "
                            f"replicas{factor}, and no plan the request allows has them (replicas: "
                            f"{sorted({sh[0] for sh in shapes})}): give more workers, fix plan.data_parallel "
                            "to a multiple of the factor, or drop plan.zero")
    return cut_fn, sharded


def _rank(c: Candidate) -> tuple[float, int, int, tuple[int, int, int], float]:
    """Fastest first (to 9 significant digits); then fewer workers, collective mode, the least sharding,
    recompute and offload, less memory."""
    assert c.plan is not None
    step = float(f"{c.plan.step_time_s:.9g}")
    option = (c.option.zero, c.option.recompute, c.option.offload)
    return step, c.plan.num_workers, c.mode != "collective", option, c.plan.peak_memory_bytes


def choose_plan(profile: Profile, resources: Resources, request: PlanConfig = _SEARCH_ALL, *,
                global_batch: int, automatic: Automatic | None = None, exhaustive: bool = False) -> Plan:
    """The fastest plan that fits every worker's memory, among those the request allows.

    Args:
        profile: The model's profile.
        resources: The workers the plan may use (it uses the first ``d * p``).
        request: The job config's plan section: the fields it fixes (strategy, replicas, stages,
            gradient mode, microbatches, schedule, balance) and how to search the rest (the cutter
            by its registered name, the largest microbatch count); its precision is every
            candidate's (the profile's cut tensors already have its dtypes); see
            :class:`~coordinator.planning.config.PlanConfig`.
        global_batch: Samples per training step over all replicas.
        automatic: The memory options the planner may choose where the request leaves them open
            (default: ``coordinator.planning.memory.AUTOMATIC``, what the runtime runs).
        exhaustive: Evaluate every memory option (the reference the pruned search must match).

    Raises:
        PlanningError: If the request is impossible or no plan fits in memory; the message
            says why and names a plan that would fit when one exists.
    """
    with frozen():  # full collections skip the process's heap during the search ([Note: a search's ...])
        return _choose_plan(profile, resources, request, global_batch, automatic, exhaustive)


def repriced(plan: Plan, profile: Profile, resources: Resources, request: PlanConfig = _SEARCH_ALL, *,
             automatic: Automatic | None = None) -> Plan:
    """``plan`` priced on ``profile`` (the same model timed again: at the plan's own microbatch size, or
    with more runs): the same shape, cut, schedule, memory options and placement, with the stage costs,
    the predicted step and the memory ``profile`` gives. ``request``: the plan section ``plan`` was chosen
    for (its precision, cutter and bucket bytes carry over).

    Raises:
        PlanningError: ``plan`` does not fit the workers' memory on ``profile`` (its activations
            measured larger), or ``profile`` is of another chain.
    """
    fixed = request.model_dump()
    fixed.update(strategy="auto", data_parallel=plan.data_parallel, num_stages=plan.num_stages,
                 mode=plan.mode, num_microbatches=plan.num_microbatches, schedule=plan.schedule_name,
                 chunks=plan.chunks, balance=[st.stop - st.start for st in plan.stages], zero=plan.zero_stage,
                 shard_factor=plan.shard_factor if plan.zero_stage else None, recompute=plan.recompute,
                 offload=plan.offload, staleness=plan.staleness)
    again = choose_plan(profile, resources, PlanConfig(**fixed), global_batch=plan.global_batch,
                        automatic=automatic)
    if again.placement != plan.placement or again.bounds != plan.bounds:  # a shape fixed whole places alike
        raise PlanningError(f"the plan priced again placed or cut its stages otherwise ({again.summary()}, "
                            f"not {plan.summary()})")
    return again


def _choose_plan(profile: Profile, resources: Resources, request: PlanConfig, global_batch: int,
                 automatic: Automatic | None, exhaustive: bool) -> Plan:
    if not exhaustive:
        cut_fn, shapes = _shapes(profile, resources, request, global_batch)
        fast = _fast_choice(profile, resources, request, global_batch, automatic or memory.AUTOMATIC, cut_fn,
                            shapes)
        if fast is not None:
            return fast
        if not request.offload:  # no replicated plan fits: the best of the others, bounded
            bounded = _fastest_of_every_option(profile, resources, request, global_batch,
                                               automatic or memory.AUTOMATIC, cut_fn, shapes)
            if bounded and bounded[0].plan is not None:
                return bounded[0].plan
    cands = candidate_plans(profile, resources, request, global_batch=global_batch, automatic=automatic,
                            exhaustive=exhaustive)
    fitting = [c for c in cands if c.fits]
    if fitting:  # a replicated plan without recompute when one fits ([Note: what the automatic search...])
        replicated = MemoryOption(offload=bool(request.offload))  # a fixed offload is asked for, not picked
        plain = [c for c in fitting if c.option == replicated]
        best = min(plain or fitting, key=_rank)
        assert best.plan is not None
        return best.plan
    raise PlanningError(_explain(profile, resources, global_batch, cands, request, automatic))


def _fastest_of_every_option(profile: Profile, resources: Resources, request: PlanConfig, global_batch: int,
                             automatic: Automatic, cutter: Cutter, shapes: Sequence[Shape], count: int = 1
                             ) -> list[Candidate]:
    """The ``count`` fastest fitting candidates of every memory option (``_rank``, then the enumeration
    order), best first; fewer where fewer fit. Every shape is evaluated in the order of its bound over every
    cut and memory option until the next bound is past the ``count``-th best fitting step: [Note: a search
    where nothing replicated fits]."""
    shared = _Shared(profile, resources)
    bounds = _cut_free_parts(shared, shapes, global_batch, replicated=False)[0]
    kept: list[tuple[tuple[float, int, int, tuple[int, int, int], float], int, int, Candidate]] = []
    for index in np.lexsort((np.arange(len(shapes)), bounds)).tolist():
        if len(kept) == count and bounds[index] > kept[-1][3].step_time_s * (1 + _BOUND_SLACK):
            break  # no shape left can win, nor tie
        cands = _evaluate(profile, resources, shapes[index], global_batch, cutter, request.cutter,
                          request.balance, request, automatic, shared=shared)
        kept.extend((_rank(cand), index, position, cand) for position, cand in enumerate(cands) if cand.fits)
        kept.sort(key=lambda k: k[:3])
        del kept[count:]
    return [cand for *_, cand in kept]


# [Note: a search where nothing replicated fits] Where no replicated plan without recompute fits (or the
# request rules it out), every shape is evaluated under its memory options ([Note: choosing the memory
# options]) and the fastest fitting candidate wins (``_rank``). An option's step is its play's pipeline
# less the least optimizer time any rank saves, plus its own unhidden sync and the messages: each term of
# the bound over every cut ([Note: the bound over every cut] in closed_form.py) bounds a rank's end past
# its start, or the work a host does after the earliest start, so taken with no start at all it bounds
# the play less its earliest start, at most that step; the sync, which ZeRO and offload change, is left
# at 0, the compute (recompute only adds to it) and the messages and the check as for a replicated plan.
# The shapes go in the order of that bound, and the search stops where the next bound exceeds the best
# fitting step by more than _BOUND_SLACK: the plan is the one evaluating every shape gives.


def _explain(profile: Profile, resources: Resources, global_batch: int, cands: list[Candidate],
             request: PlanConfig, automatic: Automatic | None = None) -> str:
    fixed = request.model_dump(exclude_defaults=True, exclude=_SEARCH_FIELDS)
    asked = ", ".join(f"{k}={v!r}" for k, v in fixed.items()) or "no fixed fields"
    planned = [c for c in cands if c.plan is not None]
    if not planned:
        return f"no plan exists for {asked}: " + "; ".join(sorted({c.reason for c in cands}))
    least = min(planned, key=lambda c: c.plan.peak_memory_bytes if c.plan else math.inf)
    assert least.plan is not None
    budget = max(w.memory_bytes for w in resources.workers)
    memory_bound = least.plan.peak_memory_bytes > min(w.memory_bytes for w in resources.workers)
    if not memory_bound:  # e.g. ZeRO-2 across a tie
        msg = f"no plan the request allows can run ({len(cands)} evaluated with {asked}): {least.reason}."
    else:
        msg = (f"no plan fits in memory ({len(cands)} evaluated with {asked}). The least memory any of them "
               f"needs is {format_bytes(least.plan.peak_memory_bytes)} per worker ({least.plan.summary()}: "
               f"{least.reason}); the largest worker has {format_bytes(budget)}.")
    if fixed:
        search_only = PlanConfig(**request.model_dump(include=_SEARCH_FIELDS))
        free = [c for c in candidate_plans(profile, resources, search_only, global_batch=global_batch,
                                           automatic=automatic, fitting_only=True) if c.fits]
        if free:
            best = min(free, key=_rank)
            assert best.plan is not None
            return f"{msg} Without fixing {', '.join(fixed)}, this plan fits: {best.plan.summary()}."
    if not memory_bound:
        return msg
    unbuilt = _unbuilt_fit(profile, resources, global_batch, request, automatic or memory.AUTOMATIC)
    return (f"{msg} Give the workers at least {format_bytes(least.plan.peak_memory_bytes)} each, add "
            "workers (more pipeline stages split the parameters), use parameter-server mode or a smaller "
            f"global batch.{unbuilt}")


_EVERY_OPTION = Automatic(zero=(0, 1, 2, 3), recompute=True, offload=True)


def _unbuilt_fit(profile: Profile, resources: Resources, global_batch: int, request: PlanConfig,
                 automatic: Automatic) -> str:
    """`` A plan with ZeRO-3 would fit ...``: when a memory option the search may not choose would fit."""
    if automatic == _EVERY_OPTION:
        return ""
    wider = [c for c in candidate_plans(profile, resources, request, global_batch=global_batch,
                                        automatic=_EVERY_OPTION, fitting_only=True) if c.fits]
    if not wider:
        return ""
    best = min(wider, key=_rank)
    assert best.plan is not None
    return (f" A plan saving memory in a way the search may not choose for this job would fit: "
            f"{best.plan.summary()} (offload is chosen only when asked for: plan.offload; a job does not "
            "get ZeRO-3 with an eval section, recompute over BatchNorm layers, or sharding with an optimizer "
            "that is not elementwise).")


def format_candidates(cands: Sequence[Candidate], limit: int = 10) -> str:
    """The ``limit`` fastest candidates as a table (fitting ones first).

    ``memory`` is how the workers save it (``Z2/4``: ZeRO-2 in groups of 4, ``rc``: recompute, ``off``:
    optimizer offloaded, ``-``: nothing); the fullest worker's peak follows by part: parameters,
    gradients, optimizer state, activations.
    """
    ordered = sorted(cands, key=lambda c: (not c.fits, c.step_time_s))[:limit]
    # the schedule, and the stages per worker of an interleaved one: interleaved-1f1b/2
    label = {id(c): c.schedule_name + (f"/{c.chunks}" if c.chunks > 1 else "") for c in ordered}
    width = max([6, *map(len, label.values())])
    options = {id(c): c.option.label() for c in ordered}
    owidth = max([6, *map(len, options.values())])
    rows = [f"{'d':>3} {'p':>3} {'mode':<16} {'sched':<{width}} {'m':>4} {'memory':<{owidth}} "
            f"{'step ms':>10} {'peak mem':>10} {'params':>10} {'grads':>10} {'opt state':>10} {'activ':>10}"
            "  fits"]
    for c in ordered:
        step = f"{c.step_time_s * 1e3:.3f}" if c.plan else "-"
        mem = format_bytes(c.plan.peak_memory_bytes) if c.plan else "-"
        use = c.plan.fullest_memory()[1] if c.plan else None
        parts = ([format_bytes(n) for n in (use.params, use.grads, use.optimizer, use.activations)] if use
                 else ["-"] * 4)
        rows.append(f"{c.data_parallel:>3} {c.num_stages:>3} {c.mode:<16} {label[id(c)]:<{width}} "
                    f"{c.num_microbatches:>4} {options[id(c)]:<{owidth}} {step:>10} {mem:>10} "
                    + " ".join(f"{x:>10}" for x in parts) + f"  {'yes' if c.fits else c.reason}")
    return "\n".join(rows)
