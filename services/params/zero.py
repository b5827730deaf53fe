"""ZeRO-1 and ZeRO-2 (and hybrid sharding): a stage's replicas split the optimizer's state (and gradients).

:class:`ZeroPath` is the collective gradient path of a stage whose plan shards
(``ComputeOptions.zero_stage`` 1 or 2) over groups of ``F = shard_factor`` consecutive replicas:
replica ``r`` is rank ``r % F`` of group ``r // F``. Every parameter is cut on dim 0 (the layout
of :mod:`services.params.layout`); a rank's shard of a parameter is a view of its rows of the
parameter itself, and the stage's optimizer is an ordinary ``torch.optim`` optimizer over those
views (one per parameter), so it holds the state of its rows only.

Per step::

    ZeRO-1: backward -> all-reduce MEAN over all d replicas (GradSync, param.grad = the average)
            commit: shard.grad = param.grad's rows; optimizer.step() on the shards
            next forward: all-gather of the updated rows in the group, bucket by bucket
    ZeRO-2: backward -> reduce-scatter MEAN in the group (GradSync reduce_scatter mode; packed
            buckets, overlapped with the last backward; param.grad dropped once packed)
            [hybrid: the shard all-reduced MEAN across the d / F groups]
            commit: shard.grad = the shard; optimizer.step()
            next forward: all-gather in the group, bucket by bucket

The all-gather runs behind the next step's forward, each bucket gathered before the first module
that uses it, the next prefetched, at most two in flight; a commit that no step follows at once
(the job's last, before an evaluation) or that saves a checkpoint gathers at once: see [Note: the
commit's all-gather, deferred] in ``services/params/commit_gather.py``.

[Note: elementwise optimizers]
An optimizer over row shards computes what one process computes only if its update of an
element reads that element's gradient and state alone (SGD with momentum or Nesterov, Adam,
AdamW, Adagrad, RMSprop, ...: weight decay is elementwise too). :data:`NOT_ELEMENTWISE` lists the
``torch.optim`` classes that are not (LBFGS: a closure over the whole model; SparseAdam: sparse
gradients; Adafactor: row and column statistics of a matrix; Muon: orthogonalises a whole
matrix); :func:`check_elementwise` refuses them naming the fix.

[Note: gradients of a sharded step]
Clipping and the non-finite check read the gradients this replica holds after the path
(:meth:`ZeroPath.held_grads`): ZeRO-1, the full average, as plain data parallelism; ZeRO-2, its
shard only, so each replica reports its rows' squared norm and the non-finite ones among its rows,
and the coordinator adds the group's parts and stops or skips the step on any replica's
(``coordinator/runtime/clipping.py``): no collective of the workers' (a scalar all-reduce in the
group once did it, on the step's critical path).

[Note: ZeRO-2 in a pipeline]
A stage runs one backward per microbatch and its gradients accumulate in ``param.grad`` (full
size) until the last one, whose hooks pack and reduce-scatter them: so a pipeline stage's
ZeRO-2 peak still holds one full gradient during the step (reduce-scattering each microbatch
would cost ``m`` times the traffic), and the saving is what stays between steps (``1 / F`` of
the gradient) plus the optimizer state. (Without a pipeline too, a packed bucket is held until
its reduce-scatter is seen finished, so buckets in flight add up: nothing bounds them yet.)
Every schedule arms the path before its last backward (``B`` or ``I``), and zb-h1's deferred
weight gradients fire their hooks in the final flush, armed (``services/compute/weight_grads.py``),
so GPipe, 1F1B, interleaved and zb-h1 all pack the gradient of every microbatch.

Checkpoints hold whole tensors by parameter name (as every plan's): a save all-gathers each
optimizer state tensor in the group (:meth:`ZeroPath.full_state`); a restore cuts each saved
tensor to this rank's rows (:meth:`ZeroPath.shard_restored`). So a ZeRO run resumes as plain
data parallelism and back, or with another ``F``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from comm.base import Communicator
from comm.factory import wire_device
from services.checkpoint.stage_state import OptimizerState
from services.params.commit_gather import CommitGather
from services.params.grad_path import CollectivePath
from services.params.grad_sync import GradSync
from services.params.layout import ShardLayout
from services.protocol import ComputeOptions, PhaseTiming

__all__ = ["NOT_ELEMENTWISE", "ZeroPath", "check_elementwise", "per_element", "restored_rows"]

NOT_ELEMENTWISE = frozenset({"LBFGS", "SparseAdam", "Adafactor", "Muon"})


def check_elementwise(optimizer: str) -> None:
    """Raise ValueError if ``optimizer`` (a ``torch.optim`` class name) cannot step row shards exactly."""
    if optimizer in NOT_ELEMENTWISE:
        raise ValueError(f"optimizer {optimizer} is not elementwise, so it cannot step a shard of each "
                         "parameter (plan.zero 1 or 2): use an elementwise one (SGD, Adam, AdamW, ...) or "
                         "drop plan.zero")


class ZeroPath(CollectivePath):
    """The collective path of a stage whose replicas shard the optimizer (ZeRO-1) or also gradients (ZeRO-2).

    Args:
        module: The stage's module.
        options: The stage's options (``zero_stage`` 1 or 2, ``shard_factor``, and those of
            :class:`~services.params.grad_path.CollectivePath`).
    """

    def __init__(self, module: nn.Module, options: ComputeOptions) -> None:
        if options.zero_stage not in (1, 2):
            raise ValueError(f"ZeroPath runs plan.zero 1 or 2, not {options.zero_stage}")
        super().__init__(module, options)
        self.stage = options.zero_stage
        self.factor = options.shard_factor
        self.rank = options.replica % self.factor
        self._replicas = options.num_replicas
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._rows = {id(p): ShardLayout([p.shape], self.factor) for p in self._params}
        # id(param) -> this rank's rows of it (a view)
        self._shards = {id(p): self._rows[id(p)].shard_of(p.detach(), 0, self.rank) for p in self._params}
        self._gather = CommitGather(module, self._params, self._shards, self.factor, self.rank,
                                    options.gather_bytes)
        self._grads: dict[int, torch.Tensor] = {}  # ZeRO-2: id(param) -> its gradient shard
        # ZeRO-1: id(param) -> (its .grad, the view of this rank's rows of it)
        self._grad_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._segments: list[torch.Tensor] = []  # ZeRO-2: the flat shards those are views of
        self._shard_comm: Communicator | None = None  # this replica's group of F
        self._across: Communicator | None = None  # the replicas of the same rank in the other groups

    # -- the step -----------------------------------------------------------------------

    def begin(self, timeout: timedelta) -> None:
        try:
            comm = self._link.wait(timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"replica {self._replica}: the data-parallel group: {exc}") from None
        assert comm is not None  # num_replicas > 1
        if comm is not self._comm:
            self._make_groups(comm)
        assert self._shard_comm is not None
        self._comm = comm
        if self._sync is None:
            if self.stage == 1:
                self._sync = GradSync(self._module, comm, bucket_bytes=self._bucket_bytes, timeout=timeout)
            else:
                self._sync = GradSync(self._module, self._shard_comm, bucket_bytes=self._bucket_bytes,
                                      timeout=timeout, mode="reduce_scatter", across=self._across)
        self._sync.timeout = timeout
        self._sync.armed = False
        # the last commit's all-gather, behind this step's forward: collectives in flight from here
        self.launched = self._gather.start(self._shard_comm, timeout)

    def _make_groups(self, comm: Communicator) -> None:
        """The sub-communicators: every replica makes every group, in the same order (``new_group``)."""
        self._close_groups()
        f, d = self.factor, self._replicas
        shard: Communicator | None = None
        across: Communicator | None = None
        if f == d:
            shard = comm
        else:
            for g in range(d // f):
                shard = comm.new_group(range(g * f, (g + 1) * f)) or shard
            for j in range(f):
                across = comm.new_group(range(j, d, f)) or across
        self._shard_comm, self._across = shard, across

    def _groups_ready(self, timeout: timedelta) -> Communicator:
        """The group's communicator (made now if a reconnect dropped it: a commit before the next step)."""
        if self._shard_comm is None:
            try:
                comm = self._link.wait(timeout)
            except TimeoutError as exc:
                raise TimeoutError(f"replica {self._replica}: the data-parallel group: {exc}") from None
            assert comm is not None
            self._make_groups(comm)
            self._comm = comm
        assert self._shard_comm is not None
        return self._shard_comm

    def _close_groups(self) -> None:
        for sub in (self._shard_comm, self._across):
            if sub is not None and sub is not self._comm:
                sub.close()
        self._shard_comm = self._across = None

    def finish(self, timeout: timedelta) -> PhaseTiming | None:
        assert self._sync is not None, "begin() first"
        start = time.time()
        self._sync.timeout = timeout
        shards = self._sync.finish()
        self._sync.armed = False
        if self._shard_comm is not None:  # what no forward of the step gathered: whole between steps
            self._gather.settle(self._shard_comm, timeout)
        # the last step's segments again: their views are mapped already ([Note: the gradient shards kept])
        kept = len(shards) == len(self._segments) and all(
            s.segment is seg for s, seg in zip(shards, self._segments, strict=True))
        if self.stage == 2 and not kept:
            by_name = {name: grad for s in shards for name, grad in s.grads.items()}
            named = {name: p for name, p in self._module.named_parameters()}
            self._grads = {id(named[name]): grad for name, grad in by_name.items()}
            self._segments = [s.segment for s in shards]
        return PhaseTiming(name="all_reduce" if self.stage == 1 else "reduce_scatter", start=start,
                           end=time.time())

    def held_grads(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        if self.stage == 1:
            return super().held_grads(params)
        return [(n, self._grads[id(p)]) for n, p in params if id(p) in self._grads]

    def abandon(self) -> None:
        super().abandon()
        self._gather.abandon()
        self._grads, self._segments = {}, []

    def reconnect(self, prefix: str) -> None:
        self._gather.abandon()
        self._close_groups()
        self._grads, self._segments = {}, []
        super().reconnect(prefix)

    def close(self) -> None:
        self._gather.close()
        self._close_groups()
        super().close()

    # -- the update ---------------------------------------------------------------------

    def optimizer_params(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        """What the stage's optimizer steps: this rank's rows of each of ``params``, by name (a frozen
        parameter as it is: it never gets a gradient)."""
        return [(n, self._shards.get(id(p), p)) for n, p in params]

    def attach_grads(self, params: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Point each shard's ``.grad`` at its rows of the step's averaged gradient (None: no gradient).

        ZeRO-1: ``param.grad`` is the same bucket view step after step (``GradSync``), so the view of its
        rows is made once and kept while it is."""
        for p in self._params:
            shard = self._shards[id(p)]
            if self.stage == 2:
                shard.grad = self._grads.get(id(p))
            elif p.grad is None:
                shard.grad = None
            else:
                of, rows = self._grad_rows.get(id(p), (None, None))
                if of is not p.grad or rows is None:
                    rows = self._rows[id(p)].shard_of(p.grad, 0, self.rank)
                    self._grad_rows[id(p)] = (p.grad, rows)
                shard.grad = rows

    def gather_params(self, timeout: timedelta, *, defer: bool = False) -> PhaseTiming | None:
        """After the optimizer stepped the rows: make every replica's parameters whole again.

        ``defer``: the next step's forward gathers each bucket before it is used (None: no phase);
        otherwise the buckets are gathered now, at most two in flight ([Note: the commit's all-gather,
        deferred]), on the device the backend moves (``comm.factory.wire_device``: a CPU copy for zmq
        or gloo with a stage on a GPU).
        """
        self._gather.mark_stale()
        if defer:
            return None
        shard_comm = self._groups_ready(timeout)
        start = time.time()
        self._gather.settle(shard_comm, timeout)
        return PhaseTiming(name="all_gather", start=start, end=time.time())

    @property
    def gather_peak_bytes(self) -> int:
        """The most bytes the parameters' all-gather held at once (since the path was made)."""
        return self._gather.peak_bytes

    # -- checkpoints --------------------------------------------------------------------

    def full_state(self, optimizer: OptimizerState,
                   timeout: timedelta) -> dict[nn.Parameter, dict[str, Any]]:
        """The optimizer's state as one process holds it, keyed by the whole parameters: each tensor of a
        shard's shape all-gathered in the group, other entries (``step``) as they are. Every replica of
        the group must call it (a save is on every replica's commit)."""
        shard_comm = self._groups_ready(timeout)
        out: dict[nn.Parameter, dict[str, Any]] = {}
        for p in self._params:
            one = ShardLayout([p.shape], self.factor)
            shard = self._shards[id(p)]
            mine = optimizer.state.get(shard, {})
            out[p] = {key: self._gather_one(shard_comm, one, mine[key], p, timeout)
                      if per_element(key, mine[key], shard.shape) else mine[key] for key in sorted(mine)}
        return out

    def _gather_one(self, comm: Communicator, one: ShardLayout, value: torch.Tensor, p: nn.Parameter,
                    timeout: timedelta) -> torch.Tensor:
        device = wire_device(comm.backend, p.device)  # the parameter's: offloaded state is in host memory
        segment = torch.zeros(one.segment_numel, dtype=value.dtype, device=device)
        segment[:value.numel()].copy_(value.reshape(-1))
        full = torch.empty(one.numel, dtype=value.dtype, device=device)
        comm.all_gather_into_tensor(full, segment, timeout=timeout)
        whole = torch.empty(p.shape, dtype=value.dtype, device=device)
        one.unpack(full, [whole])
        return whole

    def shard_restored(self, params: Sequence[tuple[str, nn.Parameter]],
                       state: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """A checkpoint's per-parameter optimizer state (whole tensors, by name) cut to this rank's rows."""
        return restored_rows(params, state, self.factor, self.rank)

    def held_bytes(self, optimizer: torch.optim.Optimizer | None) -> int:
        """Bytes of parameters, gradients (held after the step) and optimizer state on this replica."""
        total = sum(p.numel() * p.element_size() for p in self._params) + self._gather.held_bytes()
        if self.stage == 2:
            total += sum(g.numel() * g.element_size() for g in self._segments)
        else:
            total += sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        if optimizer is not None:
            total += state_bytes(optimizer)
        return total


def restored_rows(params: Sequence[tuple[str, nn.Parameter]], state: Mapping[str, Mapping[str, torch.Tensor]],
                  factor: int, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per-parameter optimizer state saved whole, by name, cut to rank ``rank``'s rows of ``factor`` (the
    scalars, such as the step count, kept as they are): what a sharded path restores a checkpoint into."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params:
        entries = state.get(name)
        if not entries:
            continue
        one = ShardLayout([p.shape], factor)
        out[name] = {key: one.shard_of(v, 0, rank).clone() if per_element(key, v, p.shape) else v
                     for key, v in entries.items()}
    return out


def per_element(key: str, value: object, shape: torch.Size) -> bool:
    """Whether an optimizer state entry has one value per element of the parameter (``shape``: the
    parameter's or the shard's): a tensor of that shape that is not the step count."""
    return isinstance(value, torch.Tensor) and value.shape == shape and key != "step"


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
