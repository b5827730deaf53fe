"""The plan: what the planner decided and predicted, as a frozen, serialisable, printable object.

A :class:`Plan` is the seam between the planning half of the coordinator and the runtime:
it names, for every worker, its data-parallel replica and pipeline stage; for every stage,
its nodes (``graph.stage_module(start, stop)`` builds it), the tensors it receives and
sends per microbatch, and its data-parallel group; and for the whole step, the schedule
(:meth:`Plan.schedule` gives every stage's action list), the microbatch split, the gradient
path (collective or parameter server) and the cost model's predictions. It holds only
plain values, so it round-trips through JSON (:meth:`Plan.to_json`) and msgpack
(``plan.model_dump(mode="json")``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.planning.config import Mode, Precision, ZeroStage
from coordinator.planning.graph import CutInfo
from coordinator.planning.profile import format_bytes
from coordinator.planning.schedules import Schedule, build_schedule

__all__ = ["MemoryUse", "Plan", "StagePlan"]

# how the plan's precision reads after its shape (fp32, the default, reads as nothing)
_PRECISION_TEXT = {"fp32": "", "bf16": ", bf16 autocast", "fp16": ", fp16 autocast + loss scaling"}


class MemoryUse(BaseModel):
    """A worker's predicted peak bytes, by what holds them (``coordinator/planning/memory.py``).

    ``params`` counts buffers and, under ZeRO-3, the cells gathered at once; ``activations`` the
    microbatches in flight (or their inputs, with recompute), deferred weight gradients and the
    recomputed cell; ``comm`` the gradient path's buffers (buckets in flight, received frames, the
    sharded paths' gather and scatter buffers); ``runtime`` what the worker's runtime maps besides
    tensors (threads, libraries loaded on first use: ``Profile.runtime_bytes``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: int = Field(default=0, ge=0)
    grads: int = Field(default=0, ge=0)
    optimizer: int = Field(default=0, ge=0)
    activations: int = Field(default=0, ge=0)
    comm: int = Field(default=0, ge=0)
    runtime: int = Field(default=0, ge=0)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.comm + self.runtime

    def __add__(self, other: MemoryUse) -> MemoryUse:
        return MemoryUse(params=self.params + other.params, grads=self.grads + other.grads,
                         optimizer=self.optimizer + other.optimizer,
                         activations=self.activations + other.activations, comm=self.comm + other.comm,
                         runtime=self.runtime + other.runtime)

    def text(self) -> str:
        """``parameters 8 MiB + gradients 8 MiB + optimizer state 16 MiB + activations 1 MiB`` (then the
        communication buffers and the runtime, where there are any)."""
        extra = (f" + communication buffers {format_bytes(self.comm)}" * bool(self.comm)
                 + f" + runtime {format_bytes(self.runtime)}" * bool(self.runtime))
        return (f"parameters {format_bytes(self.params)} + gradients {format_bytes(self.grads)} + optimizer "
                f"state {format_bytes(self.optimizer)} + activations {format_bytes(self.activations)}{extra}")


class StagePlan(BaseModel):
    """One pipeline stage, replicated on ``len(workers)`` data-parallel workers.

    The stage runs profiled nodes ``[start, stop)``; it receives ``incoming`` (cut
    ``start``) and sends ``outgoing`` (cut ``stop``) once per microbatch, shapes at the
    plan's microbatch size (stage 0's incoming are the model inputs, the last stage's
    outgoing its outputs; neither travels between stages). Times are per microbatch on
    the stage's slowest worker (``weight_s``: the ``W`` of a split list, 0 otherwise; ``tail_s``: the
    weight gradients it computes after its last backward's send, once a step: see [Note: the backward
    as the schedule runs it] in ``planner.py``); ``memory`` is ``peak_memory_bytes`` by part.
    ``devices[i]`` is the kind of device ``workers[i]`` runs the stage on
    (``coordinator/planning/devices.py``; empty: all on the CPU).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    start: int
    stop: int
    nodes: tuple[str, ...]
    workers: tuple[str, ...]
    forward_s: float
    backward_s: float
    transfer_s: float
    sync_s: float
    param_bytes: int
    optimizer_s: float = 0.0
    weight_s: float = 0.0
    tail_s: float = 0.0
    in_flight: int
    peak_memory_bytes: int
    memory: MemoryUse = MemoryUse()
    incoming: CutInfo
    outgoing: CutInfo
    devices: tuple[Literal["cpu", "cuda"], ...] = ()

    @model_validator(mode="after")
    def _one_device_per_worker(self) -> StagePlan:
        if self.devices and len(self.devices) != len(self.workers):
            raise ValueError(f"stage {self.index}: {len(self.devices)} devices for {len(self.workers)} "
                             "workers")
        return self

    @property
    def device(self) -> str:
        """The kinds of device its workers run it on: ``cpu``, ``cuda`` or ``cpu+cuda``."""
        return "+".join(sorted(set(self.devices))) or "cpu"

    @property
    def time_s(self) -> float:
        """Forward + backward + the transfers at its cuts (the cutter's stage time)."""
        return self.forward_s + self.backward_s + self.transfer_s


class Plan(BaseModel):
    """A complete parallel plan and its predicted cost.

    Attributes:
        data_parallel: Number of replicas ``d``.
        num_stages: Pipeline stages ``p``; the plan uses ``d * p / chunks`` workers.
        mode: Gradient path between replicas.
        schedule_name: A key of ``coordinator.planning.schedules.SCHEDULES``.
        num_microbatches: Microbatches ``m`` per replica per step.
        microbatch_size: Samples per microbatch; ``global_batch = d * m * microbatch_size``.
        global_batch: Samples per step over all replicas.
        cutter: The cutter's name (or the callable's name) that chose ``bounds``.
        bounds: Stage boundaries over the profiled chain, ``(0, ..., n)``.
        stages: One entry per stage.
        placement: ``placement[r][s]`` is the worker running stage ``s`` of replica ``r``.
        chunks: Stages each worker of a replica holds (``v``, the virtual stages of an interleaved
            schedule; [Note: chunks] in ``coordinator/planning/schedules.py``): rank ``k`` of the
            ``R = p / v`` workers of a replica holds stages ``k, k + R, ...``, so
            ``placement[r][s] == placement[r][s % R]``. 1: a worker per stage.
        step_time_s: Predicted step: ``pipeline_time_s + sync_time_s + overhead_s``.
        pipeline_time_s: The simulated schedule (each stage's optimizer step, then
            forward, backward, transfers).
        sync_time_s: Gradient synchronisation not hidden behind the last backward.
        overhead_s: The step's control messages (the request out, the replies back).
        bubble_fraction: Idle share of the pipeline (see ``coordinator/planning/simulator.py``).
        peak_memory_bytes: The largest per-worker peak.
        precision: What every stage computes in: ``fp32``, or ``bf16``/``fp16`` autocast over float32
            master weights (the cut tensors' dtypes are autocast's: see ``docs/running.md``).
        zero_stage: What each stage's replicas shard among ``shard_factor`` of them (0: nothing;
            1: optimizer state; 2: + gradients; 3: + parameters), collective mode only.
        shard_factor: Replicas per sharding group (``data_parallel``: one group; fewer: hybrid
            sharding, replicated across the ``data_parallel / shard_factor`` groups); 1 without ZeRO.
        recompute: Each cell's activations are recomputed in the backward instead of held.
        offload: The optimizer state and master parameters live in host memory, stepped there.
        staleness: Parameter-server mode: how many steps a replica may run ahead (0: synchronous).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 1
    data_parallel: int = Field(ge=1)
    num_stages: int = Field(ge=1)
    mode: Mode
    schedule_name: str
    num_microbatches: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    cutter: str
    bounds: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    placement: tuple[tuple[str, ...], ...]
    step_time_s: float
    pipeline_time_s: float
    sync_time_s: float
    overhead_s: float = 0.0
    bubble_fraction: float
    peak_memory_bytes: int
    precision: Precision = "fp32"
    chunks: int = Field(default=1, ge=1)
    zero_stage: ZeroStage = 0
    shard_factor: int = Field(default=1, ge=1)
    recompute: bool = False
    offload: bool = False
    staleness: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        d, p, v = self.data_parallel, self.num_stages, self.chunks
        if self.zero_stage == 0 and self.shard_factor != 1:
            raise ValueError(f"shard_factor={self.shard_factor} without sharding (zero_stage=0): use 1")
        if self.zero_stage and (self.mode != "collective" or self.shard_factor < 2 or d % self.shard_factor):
            raise ValueError(f"zero_stage={self.zero_stage} shards across groups of shard_factor >= 2 "
                             f"collective replicas dividing data_parallel={d}; got shard_factor="
                             f"{self.shard_factor}, mode {self.mode}")
        if self.staleness and self.mode != "parameter_server":
            raise ValueError(f"staleness={self.staleness} needs parameter-server mode, not {self.mode}")
        if self.global_batch != d * self.num_microbatches * self.microbatch_size:
            raise ValueError("global_batch must equal data_parallel * num_microbatches * microbatch_size")
        if len(self.stages) != p or len(self.bounds) != p + 1:
            raise ValueError(f"{p} stages need {p} stage entries and {p + 1} bounds")
        if len(self.placement) != d or any(len(r) != p for r in self.placement):
            raise ValueError(f"placement must be {d} replicas x {p} stages")
        if p % v:
            raise ValueError(f"{p} stages do not split into chunks={v} per worker")
        ranks = p // v
        if any(row[s] != row[s % ranks] for row in self.placement for s in range(p)):
            raise ValueError(f"with chunks={v}, the worker of stage s holds stages s % {ranks} + {ranks} k: "
                             f"{self.placement}")
        names = [w for r in self.placement for w in r[:ranks]]
        if len(set(names)) != len(names):
            raise ValueError(f"a worker appears twice in the placement: {names}")
        return self

    @property
    def num_ranks(self) -> int:
        """The workers of one replica (``num_stages / chunks``)."""
        return self.num_stages // self.chunks

    @property
    def num_workers(self) -> int:
        return self.data_parallel * self.num_ranks

    @property
    def dp_groups(self) -> tuple[tuple[str, ...], ...]:
        """Per stage, the workers holding its replicas (they synchronise gradients)."""
        return tuple(tuple(r[s] for r in self.placement) for s in range(self.num_stages))

    def role(self, worker: str) -> tuple[int, int]:
        """``(replica, stage)`` of ``worker`` (its first stage when it holds several: :meth:`stages_of`).

        Raises:
            KeyError: If the plan does not use that worker.
        """
        for r, row in enumerate(self.placement):
            if worker in row:
                return r, row.index(worker)
        raise KeyError(f"worker {worker!r} has no role in this plan")

    def stages_of(self, worker: str) -> tuple[int, ...]:
        """The stages ``worker`` holds (one, or ``chunks`` of them), in increasing order.

        Raises:
            KeyError: If the plan does not use that worker.
        """
        replica, _ = self.role(worker)
        return tuple(s for s in range(self.num_stages) if self.placement[replica][s] == worker)

    def fullest_memory(self) -> tuple[int, MemoryUse]:
        """The rank (a replica's worker) whose stages hold the most, and what they hold by part."""
        ranks = [[self.stages[s].memory for s in range(k, self.num_stages, self.num_ranks)]
                 for k in range(self.num_ranks)]
        # one runtime per worker, whatever the stages it holds
        held = [sum(uses, MemoryUse()).model_copy(update={"runtime": max(u.runtime for u in uses)})
                for uses in ranks]
        rank = max(range(self.num_ranks), key=lambda k: held[k].total)
        return rank, held[rank]

    def schedule(self) -> Schedule:
        """Every stage's action list (the same for every replica), validated; what ``RunStep`` carries."""
        return build_schedule(self.schedule_name, self.num_stages, self.num_microbatches, self.chunks)

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parses :meth:`to_json` output.

        Raises:
            pydantic.ValidationError: If the text is not a consistent plan.
        """
        return cls.model_validate_json(text)

    def summary(self) -> str:
        """One line: shape and predicted cost."""
        chunks = f" ({self.chunks} per worker)" if self.chunks > 1 else ""
        return (f"d={self.data_parallel} x p={self.num_stages}{chunks} {self.schedule_name} "
                f"m={self.num_microbatches} (microbatch {self.microbatch_size}) "
                f"{self.mode}{self._memory_text()}{_PRECISION_TEXT[self.precision]}: "
                f"step {self.step_time_s * 1e3:.2f} ms, "
                f"peak {format_bytes(self.peak_memory_bytes)}")

    def __str__(self) -> str:
        lines = [
            f"plan: {self.data_parallel} replica(s) x {self.num_stages} stage(s) = "
            f"{self.num_workers} worker(s){self._chunks_text()}, "
            f"{self.schedule_name}, {self.num_microbatches} microbatches of {self.microbatch_size} "
            f"(global batch {self.global_batch}), {self.mode.replace('_', ' ')}{self._memory_text()}, "
            f"cut by {self.cutter}{_PRECISION_TEXT[self.precision]}",
            f"predicted step {self.step_time_s * 1e3:.3f} ms = pipeline {self.pipeline_time_s * 1e3:.3f} "
            f"+ gradient sync {self.sync_time_s * 1e3:.3f} + messages {self.overhead_s * 1e3:.3f}; "
            f"bubble {self.bubble_fraction:.1%}; "
            f"peak memory {format_bytes(self.peak_memory_bytes)} per worker",
            "",
            f"{'stage':>5}  {'nodes':<24} {'fwd ms':>8} {'bwd ms':>8} {'xfer ms':>8} {'sync ms':>8} "
            f"{'held':>4} {'memory':>10} {'device':>8}  workers (data-parallel group)",
        ]
        for st in self.stages:
            span = st.nodes[0] if len(st.nodes) == 1 else f"{st.nodes[0]}..{st.nodes[-1]} ({len(st.nodes)})"
            lines.append(f"{st.index:>5}  {span:<24} {st.forward_s * 1e3:>8.3f} {st.backward_s * 1e3:>8.3f} "
                         f"{st.transfer_s * 1e3:>8.3f} {st.sync_s * 1e3:>8.3f} {st.in_flight:>4} "
                         f"{format_bytes(st.peak_memory_bytes):>10} {st.device:>8}  {', '.join(st.workers)}")
        lines += [self._fullest_text(), "", "crossing tensors per microbatch:"]
        for st in self.stages[:-1]:
            tensors = ", ".join(f"{t.name}{list(t.shape)} {t.dtype}{'' if t.requires_grad else ' (no grad)'}"
                                for t in st.outgoing.tensors)
            nbytes = st.outgoing.forward_bytes
            lines.append(f"  {st.index} -> {st.index + 1}: {format_bytes(nbytes)}: {tensors}")
        if self.num_stages == 1:
            lines.append("  none (one stage)")
        return "\n".join(lines)

    def _fullest_text(self) -> str:
        """``memory of the fullest worker (w1, stage 1): parameters ... + activations ...``."""
        rank, use = self.fullest_memory()
        stages = ", ".join(map(str, range(rank, self.num_stages, self.num_ranks)))
        return (f"memory of the fullest worker ({self.placement[0][rank]}, stage{'s' * (self.chunks > 1)} "
                f"{stages}): {use.text()}")

    def _memory_text(self) -> str:
        """``, ZeRO-2 over 2 of 4 replicas, recompute``: what the plan does to save memory ("" if nothing)."""
        parts = []
        if self.zero_stage:
            groups = "" if self.shard_factor == self.data_parallel else f" in groups of {self.shard_factor}"
            parts.append(f"ZeRO-{self.zero_stage} over {self.data_parallel} replicas{groups}")
        if self.recompute:
            parts.append("recompute")
        if self.offload:
            parts.append("optimizer offloaded")
        if self.staleness:
            parts.append(f"asynchronous (staleness {self.staleness})")
        return "".join(f", {p}" for p in parts)

    def _chunks_text(self) -> str:
        """`` (2 stages per worker: 0,2 | 1,3)``: which stages each worker of a replica holds."""
        if self.chunks == 1:
            return ""
        held = " | ".join(",".join(map(str, range(k, self.num_stages, self.num_ranks)))
                          for k in range(self.num_ranks))
        return f" ({self.chunks} stages per worker: {held})"
