"""What a worker holds under each way of saving memory: the planner's memory model, as data.

A stage's worker holds, per node of the stage (bytes from the profile, activations scaled to the
microbatch size):

=====================  ==========================  =============================================
part                   replicated (ZeRO-0)         saved by
=====================  ==========================  =============================================
parameters             ``P`` (+ buffers)           ZeRO-3: ``P / F``, plus the cells gathered at
                                                   once (:data:`ZERO3_GATHERED_UNITS` x the
                                                   stage's largest cell, while it runs)
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
=====================  ==========================  =============================================

``F`` is the shard factor (replicas per sharding group, ``Plan.shard_factor``), ``d`` the replicas.
Padding of the dim-0 chunks a sharded tensor splits into is ignored (at most ``F - 1`` elements per
tensor). The per-node parts add up over a stage, except the *transient* ones (the gathered cells of
ZeRO-3, the recomputed cell's activations), of which a stage holds one node's at a time: its peak
takes their largest (``CutProblem.transient_bytes``).

[Note: the optimizer's step] torch's per-parameter optimizers allocate temporaries while they step
a parameter (Adam: ``exp_avg_sq.sqrt()`` and its quotient, twice the parameter; the profile's
``step_temporary_bytes`` of the node's largest). They count as a node's transient, as ZeRO-3's
gathered cells and the recomputed cell's activations: a stage's peak takes the largest of them
(under ``optimizer`` where the step's are the largest), on top of the activations in flight -- an
upper bound, since the step runs once the activations are freed, that keeps the cutter's sum
(``CutProblem.transient_bytes``) and the plan's breakdown one formula. Measured (``bench/largest.py``, an MLP
of 4 x ``w x w`` float32 layers with Adam on 2 workers): without this term the workers' peaks
were 1.20-1.24 x the prediction at 130-185 M parameters.

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
(``coordinator/runtime/job.py``: no ZeRO-3 with an evaluation section, no recompute over BatchNorm
layers). Among the plans that fit, the planner takes a replicated one without recompute whenever
one fits (``choose_plan``): sharding and recompute buy memory with time on the machines measured
(``docs/benchmarks.md``), and their time model is not yet checked against measurement, so they are
what a plan reaches for when memory runs out, not what it tries first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.planning.config import Mode, PlanConfig, ZeroStage
from coordinator.planning.plan import MemoryUse
from coordinator.planning.profile import NodeProfile

__all__ = ["AUTOMATIC", "REPLICATED", "SHARDED_GRADIENTS_WHOLE_WHILE_ACCUMULATING", "ZERO3_GATHERED_UNITS",
           "Automatic", "MemoryOption", "NodeMemory", "memory_options", "node_memory"]

# ZeRO-3 gathers a cell's parameters whole before it runs (forward, and again for its backward) and
# frees them after; with prefetch the next cell's gather is in flight meanwhile: two cells at once.
ZERO3_GATHERED_UNITS = 2
# See [Note: sharded gradients while accumulating].
SHARDED_GRADIENTS_WHOLE_WHILE_ACCUMULATING = True


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
    """One way a plan spends memory: ZeRO stage and shard factor, recompute, offload."""

    zero: ZeroStage = 0
    shard_factor: int = 1
    recompute: bool = False
    offload: bool = False

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
    return [MemoryOption(z, factor if z else 1, r, o) for r in recompute for z in zeros for o in offload]


@dataclass(frozen=True)
class NodeMemory:
    """Per node, the bytes one worker of a stage holds under an option (see the module docstring).

    ``params``, ``grads``, ``optimizer`` do not depend on the microbatches; ``held`` is what one
    microbatch in flight holds (activations, or with recompute the node's inputs); ``gathered`` and
    ``recomputed`` are transient (a stage holds its largest node's sum of the two), and so is
    ``stepped``, the optimizer step's temporaries (a node's transient is the larger of the two).
    """

    params: tuple[float, ...]
    grads: tuple[float, ...]
    optimizer: tuple[float, ...]
    held: tuple[float, ...]
    gathered: tuple[float, ...]
    recomputed: tuple[float, ...]
    stepped: tuple[float, ...] = ()

    @property
    def static(self) -> tuple[float, ...]:
        return tuple(p + g + o for p, g, o in zip(self.params, self.grads, self.optimizer, strict=True))

    @property
    def transient(self) -> tuple[float, ...]:
        steps = self.stepped or (0.0,) * len(self.gathered)
        return tuple(max(g + r, t) for g, r, t in zip(self.gathered, self.recomputed, steps, strict=True))

    def stage(self, start: int, stop: int, held: Sequence[float], in_flight: int) -> MemoryUse:
        """A stage's peak over nodes ``[start, stop)``, ``held`` per node per microbatch (the cutter's
        ``CutProblem.held_bytes``: deferred weight gradients included), ``in_flight`` microbatches."""
        transient = self.transient[start:stop]
        peak = max(range(len(transient)), key=transient.__getitem__, default=None)
        node = start + peak if peak is not None else None
        gathered = self.gathered[node] if node is not None else 0.0
        recomputed = self.recomputed[node] if node is not None else 0.0
        # the step's temporaries where they exceed the node's other transients ([Note: the optimizer's step])
        stepping = transient[peak] - gathered - recomputed if peak is not None else 0.0
        return MemoryUse(
            params=int(sum(self.params[start:stop]) + gathered), grads=int(sum(self.grads[start:stop])),
            optimizer=int(sum(self.optimizer[start:stop]) + stepping),
            activations=int(sum(held[start:stop]) * in_flight + recomputed))


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

    def step(nd: NodeProfile) -> float:  # the step's temporaries, on this worker's rows (ZeRO)
        return 0.0 if offloaded or ps else nd.step_temporary_bytes / f

    return NodeMemory(
        params=tuple(nd.param_bytes * param_share + nd.buffer_bytes for nd in nodes),
        grads=tuple(nd.grad_bytes * grad_share for nd in nodes),
        optimizer=tuple(state(nd) for nd in nodes),
        held=tuple(input_bytes) if option.recompute else tuple(activation_bytes),
        gathered=tuple(float(ZERO3_GATHERED_UNITS * nd.param_bytes) if option.zero >= 3 else 0.0
                       for nd in nodes),
        recomputed=tuple(activation_bytes) if option.recompute else (0.0,) * len(nodes),
        stepped=tuple(step(nd) for nd in nodes))
