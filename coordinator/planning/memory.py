"""What a worker holds under each way of saving memory: the planner's memory model, as data.

A stage's worker holds, per node of the stage (bytes from the profile, activations scaled to the
microbatch size):

=====================  ==========================  =============================================
part                   replicated (ZeRO-0)         saved by
=====================  ==========================  =============================================
parameters             ``P`` (+ buffers)           ZeRO-3: ``P / F``, plus the units gathered at
                                                   once (below: ``2 U + max(U_prev, U_next)``
                                                   of the stage's largest, while it runs)
gradients              ``G``                       ZeRO-2/3: ``G / F`` -- but not while a step of
                                                   several microbatches accumulates them (below)
optimizer state        ``S``                       ZeRO-1/2/3: ``S / F``; offload (CUDA): 0 (CPU:
                                                   ``+ P / F``, the master copy); parameter server:
                                                   ``(S + P) / d``
step temporaries       ``T`` (largest parameter)   ZeRO-1/2/3: ``T / F``; offload (CUDA) and
                                                   the parameter server: 0 (they step elsewhere)
activations            ``A x in flight``           recompute: the node's inputs ``I x in flight``,
                                                   plus one cell's ``A`` during its backward
deferred weight grads  ``max(A, D) x in flight``   (a stage that defers: see ``cutting.py``)
held weight grads      ``min(h D, W / 8 + D)``     (a 1F1B stage in fp32, ``h`` B's holding, ``W`` the
                                                   deferred weights: ``planner.hold_bytes``)
=====================  ==========================  =============================================

The gradient path's buffers (``MemoryUse.comm``), with ``d > 1`` collective replicas; ``L`` the node's
largest trainable parameter, ``B`` its gradient bucket ``max(L, min(G, bucket_bytes))`` (25 MiB
buckets, ``services/params/grad_sync.py``):

=====================  ==============================================================================
buffer                 bytes (``P``, ``G`` of the node)
=====================  ==============================================================================
transport frames       ``1.5 B``, every option, the stage's largest (with its transients): see
                       [Note: the transport's frames]
ZeRO-1/2 gather        transient: ``(1 + 1 / F) (B + max(B_prev, B_next))``, the all-gather of the
                       updated rows behind the next forward, bucket by bucket
                       (``services/params/commit_gather.py``): a packed segment and the whole bucket,
                       the node's and a neighbour's at most (two in flight); ``B`` the node's bucket,
                       ``max(L, min(U, gather_bytes))`` (``U`` below). The optimizer step's
                       temporaries are the other transient of the node (the step is over when the
                       forward gathers)
ZeRO-2 backward        ``G``, summed: the packed reduce-scatter inputs, held until their reduce-scatter
                       is seen finished (nothing bounds the buckets in flight); plus, transient, ``L``
                       (the gradient autograd makes before it is packed) or the gather less the node's
                       ``G``, the larger (the packed gradients are gone when the forward gathers: an
                       upper bound on the larger of the two phases)
ZeRO-3 units           transient: ``2 U + max(U_prev, U_next)`` gathered (the packed all-gather
                       buffer and the storages it is copied into, the neighbour prefetched), or, in
                       the backward, ``U + max(U_prev, U_next) + 2 G_U + G_next`` (the unit's whole
                       gradient, its packed reduce-scatter input, the later unit's reduce-scatter
                       still in flight): the larger ([Note: ZeRO-3's two phases])
=====================  ==============================================================================

[Note: ZeRO-3's two phases] A unit's forward holds ``2 U + max(U_prev, U_next)`` gathered; its backward
holds the unit and its prefetched neighbour gathered (``U + max(U_prev, U_next)``: the packed all-gather
buffer is gone once copied), its whole gradient and the packed reduce-scatter input (``2 G_U``) and the
later unit's reduce-scatter (``G_next``). The two phases take turns, so a node's ZeRO-3 transient is the
larger of the two, not their sum: ``flight`` is what the backward holds beyond the forward's gathered
bytes, ``max(0, 2 G_U + G_next - U)``.
Measured (``tests/multiproc/coordinator/test_memory.py``, one 64 MiB layer, F = 2, Adam): 422-486 MiB
against 454 predicted; the sum predicted 519.

``U`` is the node's *unit*: consecutive nodes of parameters grouped up to ``plan.gather_bytes``
(a node larger than that alone), as ZeRO-3 groups cells ([Note: units of several cells] in
``services/params/fully_sharded.py``) and as ZeRO-1/2's buckets follow the forward; grouped over the
model's nodes, so a unit across a stage's edge counts whole (an upper bound).

=====================  ==============================================================================
=====================  ==============================================================================

The runtime (``MemoryUse.runtime``, ``Profile.runtime_bytes``): what a worker maps after its
assignment besides tensors (its step thread's arena, autograd's engine, the optimizer's modules
loaded on the first step), measured once per coordinator process in a fresh interpreter
(:func:`coordinator.planning.profile.runtime_bytes`); the planner adds it to each stage's peak and
gives the cutter a worker's memory less it.

``F`` is the shard factor (replicas per sharding group, ``Plan.shard_factor``), ``d`` the replicas.
Padding of the dim-0 chunks a sharded tensor splits into is ignored (at most ``F - 1`` elements per
tensor). The per-node parts add up over a stage, except the *transient* ones (the gathered cells of
ZeRO-3, the recomputed cell's activations), of which a stage holds one node's at a time: its peak
takes their largest (``CutProblem.transient_bytes``).

[Note: the optimizer's step] torch's per-parameter optimizers allocate temporaries while they step
a parameter (Adam: ``exp_avg_sq.sqrt()`` and its quotient, twice the parameter; the profile's
``step_temporary_bytes`` of the node's largest). They count as a node's transient, as ZeRO-3's
gathered cells, the recomputed cell's activations and the transport's frames (the step runs after the
backward's collectives, in the heap their frames left free: measured, the replicated worker of
``tests/multiproc/coordinator/test_memory.py`` peaked at 0.78 x the sum once its gradient stopped being
copied into a bucket, and at 0.98-1.00 x the larger): a stage's peak takes the largest of them
(under ``optimizer`` where the step's are the largest), on top of the activations in flight -- an
upper bound, since the step runs once the activations are freed, that keeps the cutter's sum
(``CutProblem.transient_bytes``) and the plan's breakdown one formula. Measured (``bench/largest.py``, an MLP
of 4 x ``w x w`` float32 layers with Adam on 2 workers): without this term the workers' peaks
were 1.20-1.24 x the prediction at 130-185 M parameters.

[Note: the transport's frames] The zmq transport receives a collective's chunks as frames of up to
4 MiB, which ``comm/allocator.py`` keeps in the heap (below its 32 MiB mmap threshold) for reuse: the
frames of the bucket in flight stay with the process. Measured (2 workers, one 64 MiB float32
bucket): the all-reduce and the reduce-scatter each left 95-96 MiB more resident, 1.5 x the bucket
(:data:`TRANSPORT_FRAMES_PER_BUCKET`); four 64 MiB buckets launched during the backward left 44 MiB.
The reduce-scatter's figure held the communicator's working copy of its input (1 x the bucket, kept
for the next call); ZeRO-2 and 3 now let it reduce in their packed input (``reuse_input``), and the
same test's ZeRO-2 worker peaked 96 MiB lower (the copy, and the last step's gradient shard no longer
held beside the new one), ZeRO-3's 64 MiB lower: 0.5 x the bucket for a reduce-scatter's frames
(:data:`TRANSPORT_FRAMES_PER_SCATTERED_BUCKET`).

[Note: what the model does not see] Freed tensors below the 32 MiB mmap threshold stay in the heap
too, and a thread's freed memory serves its own arena only: on 64 MiB of parameters in four 16 MiB
layers the workers peaked at 1.3-1.6 x this model (replicated, ZeRO-1/2) and 2.0 x (ZeRO-3), as
the transients of every phase (the first backward's gradients before they land in their buckets, the
frames, ZeRO-3's gathered units) add up instead of taking turns. Above it (the test's 64 MiB layer,
the benchmark's 64-100 MiB layers) a freed tensor goes back to the kernel and the model holds within
20% (``docs/benchmarks.md``).

[Note: sharded gradients while accumulating] A sharded gradient exists only after its
reduce-scatter, which runs once a step, in the last microbatch's backward: a step of several
microbatches (a pipeline, or accumulation on one stage) accumulates each parameter's gradient whole
until then, so its peak keeps the gradients whole under ZeRO-2 and ZeRO-3 alike.
:data:`SHARDED_GRADIENTS_WHOLE_WHILE_ACCUMULATING` says so; set it False if the services
reduce-scatter every microbatch's gradients instead (more traffic, ``G / F`` held).

[Note: offload] Offloading moves the optimizer state and a master copy of the parameters it steps
(this worker's rows under ZeRO; ``services/params/offload.py``) to the host and steps them there.
A worker's budget (``Worker.memory_bytes``) is its device's, so on a CUDA worker the state, the
masters and the step's temporaries leave it: 0 here (host memory is not budgeted). A CPU worker's
device *is* the host: there the state and the temporaries stay where they were and the masters come
on top (``P / F`` more under ``optimizer``; the gradients are read where they are), so offload costs
memory there. The planner never picks it for a plan with a CPU worker; a fixed ``plan.offload:
true`` on CPU workers is planned with that cost and runs, with the driver's warning.

[Note: what the automatic search may pick] :data:`AUTOMATIC` limits the options the planner picks by
itself to every ZeRO stage and recompute; not offload, whose cost in time (``sharding.py``: the
host's step and the copies over PCIe) is not checked against a GPU's measurement yet. The plan
section's fixed fields pass through whatever it says (the runtime then names what it does not run).
A job narrows it further where its model or its sections rule an option out
(``coordinator/runtime/job.py``: no sharding for an optimizer that is not elementwise, no recompute
over BatchNorm layers). Among the plans that fit, the planner takes a replicated one without recompute
whenever one fits (``choose_plan``): sharding and recompute buy memory with time on the machines measured
(``docs/benchmarks.md``), and their time model is not yet checked against measurement, so they are
what a plan reaches for when memory runs out, not what it tries first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from coordinator.planning.config import Mode, PlanConfig, ZeroStage
from coordinator.planning.plan import MemoryUse
from coordinator.planning.profile import NodeProfile

__all__ = ["AUTOMATIC", "BUCKET_BYTES", "COMMIT_GATHER_IN_FLIGHT", "GATHER_BYTES", "REPLICATED",
           "SHARDED_GRADIENTS_WHOLE_WHILE_ACCUMULATING", "TRANSPORT_FRAMES_PER_BUCKET",
           "TRANSPORT_FRAMES_PER_SCATTERED_BUCKET",
           "ZERO3_GATHERED_UNITS", "Automatic", "MemoryOption", "NodeMemory", "memory_options", "node_memory",
           "replicated_static", "units"]

# ZeRO-3 gathers a cell's parameters whole before it runs (forward, and again for its backward) and
# frees them after; with prefetch the next cell's gather is in flight meanwhile: two cells at once.
ZERO3_GATHERED_UNITS = 2
# See [Note: sharded gradients while accumulating].
SHARDED_GRADIENTS_WHOLE_WHILE_ACCUMULATING = True
# The gradient path's bucket (``ComputeOptions.bucket_bytes``' default, services/params/grad_sync.py).
BUCKET_BYTES = 25 << 20
# plan.gather_bytes' default: ZeRO-1/2's all-gather buckets, ZeRO-3's units (ComputeOptions.gather_bytes).
GATHER_BYTES = 4 << 20
# ZeRO-1/2's all-gather buckets held at once (services/params/commit_gather.py's IN_FLIGHT).
COMMIT_GATHER_IN_FLIGHT = 2
# Resident bytes the transport's frames leave per byte of the bucket in flight (see [Note: the
# transport's frames]): an all-reduce's, and a reduce-scatter's (ZeRO-2/3: it reduces in its input)
TRANSPORT_FRAMES_PER_BUCKET = 1.5
TRANSPORT_FRAMES_PER_SCATTERED_BUCKET = 0.5


@dataclass(frozen=True)
class Automatic:
    """The options the planner may choose by itself (see [Note: what the automatic search may pick])."""

    zero: tuple[ZeroStage, ...] = (0,)
    recompute: bool = False
    offload: bool = False


# What the planner picks by itself: every ZeRO stage and recompute (offload only when asked for).
AUTOMATIC = Automatic(zero=(0, 1, 2, 3), recompute=True)


@dataclass(frozen=True)
class MemoryOption:
    """One way a plan spends memory: ZeRO stage and shard factor, recompute, offload (and the bytes of
    ZeRO's all-gather buckets and units, ``plan.gather_bytes``)."""

    zero: ZeroStage = 0
    shard_factor: int = 1
    recompute: bool = False
    offload: bool = False
    gather_bytes: int = GATHER_BYTES

    def label(self) -> str:
        """``Z2/4 rc off``: short, for the candidates table (``-`` for nothing)."""
        parts = [f"Z{self.zero}/{self.shard_factor}"] if self.zero else []
        parts += ["rc"] * self.recompute + ["off"] * self.offload
        return " ".join(parts) or "-"


REPLICATED = MemoryOption()  # every worker of a stage holds all of its state and activations


def memory_options(request: PlanConfig, data_parallel: int, mode: Mode, on_cuda: bool,
                   automatic: Automatic = AUTOMATIC) -> list[MemoryOption]:
    """The options to evaluate for a shape of ``data_parallel`` replicas in ``mode``, replicated first.

    A fixed field is the only value of its option; an open one runs over what ``automatic`` allows
    (ZeRO only for 2 or more collective replicas, offload only on CUDA workers in collective mode:
    parameter servers step their shards themselves).
    """
    factor = request.shard_factor or data_parallel
    shards = mode == "collective" and data_parallel > 1 and factor >= 2 and data_parallel % factor == 0
    if request.zero is not None:
        zeros: tuple[ZeroStage, ...] = (request.zero if shards else 0,)
    else:
        zeros = tuple(z for z in automatic.zero if shards or z == 0) or (0,)
    recompute = ([request.recompute] if request.recompute is not None
                 else [False, True][:1 + automatic.recompute])
    offload = ([request.offload] if request.offload is not None
               else [False, True][:1 + (automatic.offload and on_cuda and mode == "collective")])
    return [MemoryOption(z, factor if z else 1, r, o, request.gather_bytes)
            for r in recompute for z in zeros for o in offload]


@dataclass(frozen=True)
class NodeMemory:
    """Per node, the bytes one worker of a stage holds under an option (see the module docstring).

    ``params``, ``grads``, ``optimizer`` and ``buffers`` (the sharded paths', summed over a stage) do
    not depend on the microbatches; ``held`` is what one microbatch in flight holds (activations, or
    with recompute the node's inputs); ``gathered``, ``flight`` (ZeRO-3's gradient buffers) and
    ``recomputed`` are transient (a stage holds its largest node's sum of the three), and so is
    ``stepped``, the optimizer step's temporaries (a node's transient is the larger of the two), on
    top of which a node holds its ``frames`` (see [Note: the transport's frames]).
    """

    params: tuple[float, ...]
    grads: tuple[float, ...]
    optimizer: tuple[float, ...]
    held: tuple[float, ...]
    gathered: tuple[float, ...]
    recomputed: tuple[float, ...]
    stepped: tuple[float, ...] = ()
    buffers: tuple[float, ...] = ()
    flight: tuple[float, ...] = ()
    frames: tuple[float, ...] = ()

    def _or_zeros(self, part: tuple[float, ...]) -> tuple[float, ...]:
        return part or (0.0,) * len(self.params)

    @cached_property  # read per stage the cutter prices: made once per node list
    def static(self) -> tuple[float, ...]:
        return tuple(p + g + o + b for p, g, o, b in zip(self.params, self.grads, self.optimizer,
                                                         self._or_zeros(self.buffers), strict=True))

    @cached_property  # read per stage the cutter prices: made once per node list
    def transient(self) -> tuple[float, ...]:
        return tuple(max(g + f + r + fr, t) for g, f, r, t, fr in zip(
            self.gathered, self._or_zeros(self.flight), self.recomputed, self._or_zeros(self.stepped),
            self._or_zeros(self.frames), strict=True))

    def with_activations(self, recompute: bool, activation_bytes: Sequence[float],
                         input_bytes: Sequence[float]) -> NodeMemory:
        """These bytes with the microbatch's part given: what a node holds per microbatch in flight (its
        saved activations, or under recompute its input) and what recompute rebuilds in the backward.
        Nothing else :func:`node_memory` gives depends on the microbatch size, so the planner makes the
        rest once for every size."""
        held = tuple(input_bytes) if recompute else tuple(activation_bytes)
        recomputed = tuple(activation_bytes) if recompute else (0.0,) * len(self.params)
        return replace(self, held=held, recomputed=recomputed)

    def stage(self, start: int, stop: int, held: Sequence[float], in_flight: int) -> MemoryUse:
        """A stage's peak over nodes ``[start, stop)``, ``held`` per node per microbatch (the cutter's
        ``CutProblem.held_bytes``: deferred weight gradients included), ``in_flight`` microbatches."""
        transient = self.transient[start:stop]
        peak = max(range(len(transient)), key=transient.__getitem__, default=None)
        node = start + peak if peak is not None else None
        gathered = self.gathered[node] if node is not None else 0.0
        recomputed = self.recomputed[node] if node is not None else 0.0
        flight = self._or_zeros(self.flight)[node] if node is not None else 0.0
        frames = self._or_zeros(self.frames)[node] if node is not None else 0.0
        # the step's temporaries where they exceed the node's other transients ([Note: the optimizer's step])
        others = frames + gathered + flight + recomputed
        stepping = max(0.0, transient[peak] - others) if peak is not None else 0.0
        return MemoryUse(
            params=int(sum(self.params[start:stop]) + gathered), grads=int(sum(self.grads[start:stop])),
            optimizer=int(sum(self.optimizer[start:stop]) + stepping),
            activations=int(sum(held[start:stop]) * in_flight + recomputed),
            comm=int(sum(self._or_zeros(self.buffers)[start:stop]) + flight + frames))


def replicated_static(nodes: Sequence[NodeProfile], mode: Mode, data_parallel: int) -> tuple[float, float]:
    """Every node's static bytes under :data:`REPLICATED` together, as ``(fixed, shared)``: the sum is
    ``fixed + shared / data_parallel`` (parameters, buffers and gradients whole; the optimizer state whole,
    or with a parameter server its state and a master copy ``1/d`` each, as :func:`node_memory` counts them;
    a sum of shares rounds apart from the share of the sum by a few units in the last place). The planner
    reads it for every shape it could place, before their per-node bytes are made."""
    fixed = float(sum(nd.param_bytes + nd.buffer_bytes + nd.grad_bytes for nd in nodes))
    if mode == "parameter_server" and data_parallel > 1:
        return fixed, float(sum(nd.optimizer_state_bytes + nd.param_bytes for nd in nodes))
    return fixed + float(sum(nd.optimizer_state_bytes for nd in nodes)), 0.0


def node_memory(nodes: Sequence[NodeProfile], option: MemoryOption, *, mode: Mode, data_parallel: int,
                num_microbatches: int, activation_bytes: Sequence[float], input_bytes: Sequence[float],
                on_cuda: bool) -> NodeMemory:
    """Every node's bytes on one worker under ``option``.

    Args:
        nodes: The profile's nodes.
        option: ZeRO stage and factor, recompute, offload.
        mode: The gradient path (parameter server shards the optimizer state and a master copy ``1/d``).
        data_parallel: Replicas ``d``.
        num_microbatches: Per step (more than one accumulates gradients: [Note: sharded gradients
            while accumulating]).
        activation_bytes: Saved activations per node at the plan's microbatch size.
        input_bytes: The bytes crossing each node's input cut at that size (what recompute keeps).
        on_cuda: Whether the stage's workers run on CUDA (offload saves their device memory; on the CPU
            it adds the master copy: [Note: offload]).
    """
    f = option.shard_factor if option.zero else 1
    whole_grads = num_microbatches > 1 and SHARDED_GRADIENTS_WHOLE_WHILE_ACCUMULATING
    grad_share = 1.0 / f if option.zero >= 2 and not whole_grads else 1.0
    param_share = 1.0 / f if option.zero >= 3 else 1.0
    offloaded = option.offload and on_cuda
    masters = option.offload and not on_cuda  # the host copy, in the same memory ([Note: offload])
    ps = mode == "parameter_server" and data_parallel > 1

    def state(nd: NodeProfile) -> float:
        if offloaded:
            return 0.0
        if ps:
            return (nd.optimizer_state_bytes + nd.param_bytes) / data_parallel
        return (nd.optimizer_state_bytes + nd.param_bytes * masters) / f

    collective = mode == "collective" and data_parallel > 1
    zero = option.zero if collective else 0

    of = units(nodes, option.gather_bytes)
    count = max(of, default=-1) + 1
    unit_params, unit_grads = [0.0] * count, [0.0] * count  # one pass: units x nodes was quadratic
    for nd, u in zip(nodes, of, strict=True):
        if u >= 0:
            unit_params[u] += nd.param_bytes
            unit_grads[u] += nd.grad_bytes

    def unit_of(i: int, shift: int = 0, grads: bool = False) -> float:  # node i's unit, or a neighbour's
        k = of[i] + shift if of[i] >= 0 else -1
        return (unit_grads if grads else unit_params)[k] if 0 <= k < count and of[i] >= 0 else 0.0

    def bucket(i: int, shift: int = 0) -> float:  # ZeRO-1/2: node i's all-gather bucket (or a neighbour's)
        return min(unit_of(i, shift), float(option.gather_bytes))

    def gather(i: int) -> float:  # ZeRO-1/2's all-gather behind the forward (see the module docstring)
        if zero not in (1, 2) or of[i] < 0:
            return 0.0
        mine = max(float(nodes[i].largest_param_bytes), bucket(i))
        return (1 + 1 / f) * (mine + max(bucket(i, -1), bucket(i, 1)))

    def buffers(nd: NodeProfile) -> float:  # ZeRO-2's packed gradients
        return float(nd.grad_bytes) if zero == 2 else 0.0

    def step(nd: NodeProfile) -> float:  # the step's temporaries, on this worker's rows (ZeRO)
        return 0.0 if offloaded or ps else nd.step_temporary_bytes / f

    def frames(nd: NodeProfile) -> float:  # [Note: the transport's frames]
        if not collective or not nd.grad_bytes:
            return 0.0
        per = TRANSPORT_FRAMES_PER_SCATTERED_BUCKET if zero >= 2 else TRANSPORT_FRAMES_PER_BUCKET
        return per * max(nd.largest_param_bytes, min(nd.grad_bytes, BUCKET_BYTES))

    def around(i: int) -> float:  # ZeRO-3: the neighbouring unit prefetched while node i's computes
        if of[i] < 0:  # no unit of its own: its neighbours' units
            return float(max((unit_of(j) for j in (i - 1, i + 1) if 0 <= j < len(nodes)), default=0.0))
        return max(unit_of(i, -1), unit_of(i, 1))

    three = zero >= 3
    none = (0.0,) * len(nodes)
    return NodeMemory(
        params=tuple(nd.param_bytes * param_share + nd.buffer_bytes for nd in nodes),
        grads=tuple(nd.grad_bytes * grad_share for nd in nodes),
        optimizer=tuple(state(nd) for nd in nodes),
        held=none,
        gathered=tuple(2.0 * unit_of(i) + around(i) if three else 0.0 for i in range(len(nodes))),
        recomputed=none,
        stepped=tuple(step(nd) for nd in nodes),
        buffers=tuple(buffers(nd) for nd in nodes),
        flight=tuple(max(0.0, 2.0 * unit_of(i, grads=True) + unit_of(i, 1, grads=True) - unit_of(i))
                     if three  # [Note: ZeRO-3's two phases]
                     else max(float(nd.largest_param_bytes), gather(i) - nd.grad_bytes) if zero == 2
                     else gather(i)
                     for i, nd in enumerate(nodes)),
        frames=tuple(frames(nd) for nd in nodes)).with_activations(option.recompute, activation_bytes,
                                                                   input_bytes)


def units(nodes: Sequence[NodeProfile], gather_bytes: int) -> list[int]:
    """Each node's unit (-1: a node without parameters, in none): consecutive nodes with parameters grouped
    up to ``gather_bytes``, a larger node alone, the nodes without parameters between them skipped (as
    ``services/params/fully_sharded.py`` groups cells)."""
    out: list[int] = []
    used, count = 0.0, 0
    for nd in nodes:
        if not nd.param_bytes:
            out.append(-1)
            continue
        if count and used + nd.param_bytes <= gather_bytes:
            used += nd.param_bytes
        else:
            count += 1
            used = nd.param_bytes
        out.append(count - 1)
    return out
