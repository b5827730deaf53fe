"""The communication service: gradient synchronisation for data-parallel replicas.

Gradients are gathered into buckets (``bucket_bytes``, 25 MiB by default, the first 1 MiB, as torch DDP)
in the reverse order of the parameters, which is roughly the order backward produces
them. In all_reduce mode every ``param.grad`` becomes a view into its bucket's flat buffer
(DDP's ``gradient_as_bucket_view``): a hook on every parameter fires once autograd has
accumulated its gradient; if ``param.grad`` is already the view (autograd accumulates into
an existing ``.grad`` in place) the hook only marks it ready, otherwise (the first backward
after ``param.grad`` was set to None or replaced) it copies the gradient into the view once
and re-points ``param.grad`` at it. When a bucket is full it is all-reduced asynchronously,
in place, while backward goes on with earlier layers, so communication overlaps compute.
:meth:`GradSync.finish` waits for the buckets; ``param.grad`` then holds the average with
no copy back. Zeroing gradients in place (``zero_grad(set_to_none=False)``) keeps the views
and costs no copy at all; setting them to None costs one copy per parameter and step.

[Note: the first bucket is small]
Each dtype's first bucket (the last parameters, whose gradients backward makes first) holds at most
``first_bytes`` (1 MiB, :data:`FIRST_BUCKET_BYTES`, as torch DDP's first bucket), the next ones
``bucket_bytes``. A model smaller than ``bucket_bytes`` (the GPT of ``bench/zero.py``: 6.6 MB in one
25 MiB bucket) so still sends part of its gradient while backward runs instead of all of it after;
a large model loses nothing (one more collective). Both modes ramp, so plain data parallelism,
ZeRO-1 (all_reduce) and ZeRO-2 (reduce_scatter) all get it. The assignment depends on the
parameters' sizes, dtypes and order alone, so every replica makes the same buckets.

Buckets are launched strictly in bucket order (bucket i waits until buckets < i were
launched), so every replica issues the same collectives in the same order even if its
hooks fire in a slightly different order. A parameter that got no gradient in a step
contributes zeros (as DDP with ``find_unused_parameters``).

The reduce-scatter path (``mode="reduce_scatter"``) is the one a sharded optimizer
(ZeRO-2, ``services/params/zero.py``) uses: each bucket is packed in the dim-0 layout of
``services/params/layout.py`` (every parameter's rows cut into ``F`` chunks, rank-major), a
parameter's gradient is copied into its bucket once its hook fired armed and ``param.grad`` is
then dropped (set to None), and one reduce-scatter per bucket leaves each replica with the
averaged gradient of its own rows of every parameter: :meth:`GradSync.finish` returns them as
:class:`Shard` views. A bucket's buffer lives from its first gradient until its reduce-scatter
is seen finished (at a later hook's launch, or in :meth:`finish`), so after a step a replica
holds only its shards. With ``across`` (hybrid sharding: ``comm`` is
one group of ``F`` replicas, ``across`` the replicas holding the same shard in the other
groups) each shard is then all-reduced (MEAN) across the groups.

[Note: a large gradient all-reduced as it is]
In all_reduce mode too, a contiguous parameter of at least :data:`DIRECT_BYTES` gets a bucket of its own
whose buffer is its gradient as autograd made it: the all-reduce averages ``param.grad`` in place. A
bucket view would cost a copy of every such gradient each step (the step sets ``.grad`` to None, so
autograd makes a new tensor, which the hook copied into the view: 34 MB a step on ``bench.models:mlp``)
and the bucket's own memory besides; later microbatches of a pipeline stage accumulate into
``param.grad`` as autograd does. The bucket lets go of the gradient once it is averaged.

[Note: the gradient shards kept]
A bucket's segment (this replica's averaged rows, ``1 / F`` of the bucket) is made by the first
reduce-scatter and written by every later one, with its :class:`Shard` and the views in it: a step's
shards replace the last step's, which the commit before that step's backward has stepped with. So a
replica holds one segment per bucket between steps (as it did, a new one each step), and a step makes
no views of its own. A bucket reduced on the CPU for a GPU gets a new device copy each step.

[Note: a large gradient reduce-scattered as it is]
A parameter of at least :data:`DIRECT_BYTES` whose rows split evenly over the group, stored
contiguously (a large weight: every layer of ``bench.models:mlp``), packs as itself: rank ``r``'s
segment is its rows. It gets a bucket of its own, and its gradient, as autograd made it, is the
reduce-scatter's input: no packed buffer to allocate (a new one each step, its pages touched anew)
and no copy into it. Its bucket holds the gradient until the reduce-scatter is seen finished, as a
packed bucket holds its buffer; ``param.grad`` is dropped at once. Such a bucket also goes out as soon
as its gradient is ready rather than with a 25 MiB bucket, so more of the reduce-scatter overlaps
the backward (DDP's small first bucket has the same purpose).

Pipeline stages run one backward per microbatch and gradients accumulate over them;
only the last backward of a step may launch buckets. :attr:`GradSync.armed` says whether
hooks launch (True by default): a stage sets it False at the start of a step and True just
before its last backward (see ``services/params/grad_path.py``). A disarmed hook still re-points
``param.grad`` at its view (all_reduce mode), so later microbatches accumulate in place.
A parameter whose hook did not fire while armed contributes its accumulated ``.grad``
(zeros if it has none).

Works on any :class:`~comm.base.Communicator` backend, with the buffers on the parameters'
device. A backend that moves CPU tensors (zmq, gloo) reduces a CPU copy of a GPU bucket, copied
back when it finished (``comm.factory.wire_device``); NCCL reduces the bucket in place on its
GPU. Not thread-safe: one backward at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
from torch import nn

from comm.base import Communicator, ReduceOp, Work
from comm.factory import wire_device
from services.params.layout import ShardLayout

__all__ = ["DEFAULT_BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucket", "GradSync", "Shard", "assign_buckets"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20  # each dtype's first bucket, as torch DDP's ([Note: the first bucket is small])
DIRECT_BYTES = 1 << 20  # reduce_scatter mode: a parameter at least this large that packs as itself goes alone


@dataclass
class Bucket:
    """Parameters whose gradients travel together, and their flat buffer."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]  # element offset of each parameter in the buffer
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)  # positions in params whose grad is in
    work: Work | None = None
    shard: torch.Tensor | None = None  # reduce_scatter mode: this rank's part
    staged: torch.Tensor | None = None  # the CPU copy a CPU backend reduces, for a buffer on a GPU
    layout: ShardLayout | None = None  # reduce_scatter mode: the dim-0 layout of the buffer
    direct: bool = False  # one parameter whose gradient is the buffer as it is (either mode)
    # reduce_scatter mode: the segment the reduce-scatters write, kept step to step, and its Shard (views
    # made once): [Note: the gradient shards kept]
    kept: Shard | None = None


def _packs_as_itself(p: nn.Parameter, world: int) -> bool:
    """Whether ``p``'s dim-0 layout over ``world`` ranks is its own memory: contiguous, rows split evenly."""
    return p.is_contiguous() and ShardLayout([p.shape], world).numel == p.numel()


@dataclass(frozen=True)
class Shard:
    """reduce_scatter mode: this replica's part of a bucket's averaged gradient.

    ``segment`` is the flat part (``layout.segment_numel`` elements); ``grads`` maps each parameter
    name of the bucket to its rows' gradient, a view of ``segment`` shaped as the parameter's shard.
    """

    bucket: int
    segment: torch.Tensor
    grads: dict[str, torch.Tensor]


def assign_buckets(sizes: list[tuple[str, int, torch.dtype]], bucket_bytes: int,
                   alone: Collection[int] = (), first_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_bytes`` (one dtype each).

    ``sizes`` lists (name, bytes, dtype) in registration order; buckets are filled in reverse
    order. A parameter larger than ``bucket_bytes`` gets a bucket of its own, and so does every index in
    ``alone`` (its bucket comes where its gradient does, before the open buckets of later parameters).
    ``first_bytes`` (at most ``bucket_bytes``; None: ``bucket_bytes``) bounds each dtype's first bucket
    ([Note: the first bucket is small]); a larger parameter still goes alone.
    """
    first = bucket_bytes if first_bytes is None else min(first_bytes, bucket_bytes)
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    closed: set[torch.dtype] = set()  # dtypes whose first bucket is closed: the cap is bucket_bytes
    for i in reversed(range(len(sizes))):
        _, nbytes, dtype = sizes[i]
        if i in alone:
            buckets.append([i])
            continue
        current, used = open_by_dtype.get(dtype, ([], 0))
        if current and used + nbytes > (bucket_bytes if dtype in closed else first):
            buckets.append(current)
            closed.add(dtype)
            current, used = [], 0
        current.append(i)
        open_by_dtype[dtype] = (current, used + nbytes)
    buckets.extend(indices for indices, _ in open_by_dtype.values() if indices)
    return buckets


class GradSync:
    """Averages gradients across the ranks of ``comm`` with bucketed, overlapped collectives.

    Args:
        module: the replica's model; its parameters that require grad are synchronised.
        comm: the data-parallel group.
        bucket_bytes: bucket capacity (25 MiB default).
        mode: ``"all_reduce"`` (every replica gets the full averaged gradient; ``param.grad``
            becomes a view into the bucket buffer) or ``"reduce_scatter"`` (each gets its
            shard; for sharded optimizers).
        timeout: bound on waiting for each bucket's collective.
        across: reduce_scatter mode, hybrid sharding: the group the shards are then averaged over.
        direct_bytes: reduce_scatter mode: a parameter this large that packs as itself is reduce-scattered
            from its gradient as it is ([Note: a large gradient reduce-scattered as it is]).
        first_bytes: each dtype's first bucket's capacity (1 MiB default; at most ``bucket_bytes``):
            [Note: the first bucket is small].

    Usage::

        sync = GradSync(model, comm)
        loss.backward()        # buckets go out while backward runs
        sync.finish()          # param.grad now holds the average over replicas

    In all_reduce mode ``param.grad`` is a view into a bucket buffer after the hooks or
    :meth:`finish` ran: zero it in place or set it to None, but do not keep references to
    it across steps (the next step's all-reduce overwrites it).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        mode: Literal["all_reduce", "reduce_scatter"] = "all_reduce",
        timeout: timedelta | None = None,
        across: Communicator | None = None,
        direct_bytes: int = DIRECT_BYTES,
        first_bytes: int = FIRST_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes <= 0 or first_bytes <= 0:
            raise ValueError(f"bucket_bytes and first_bytes must be positive, got {bucket_bytes} and "
                             f"{first_bytes}")
        self.comm = comm
        self.mode = mode
        self.timeout = timeout
        self.across = across
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        sizes = [(n, p.numel() * p.element_size(), p.dtype) for n, p in named]
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        world = comm.world_size
        # [Note: a large gradient reduce-scattered as it is], [Note: a large gradient all-reduced as it is]
        alone = {i for i, (_, p) in enumerate(named) if p.numel() * p.element_size() >= direct_bytes
                 and (_packs_as_itself(p, world) if mode == "reduce_scatter" else p.is_contiguous())}
        for b, indices in enumerate(assign_buckets(sizes, bucket_bytes, alone, first_bytes)):
            params = [named[i][1] for i in indices]
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            names = [named[i][0] for i in indices]
            if mode == "reduce_scatter":  # allocated by the step's first gradient, freed by finish
                layout = ShardLayout([p.shape for p in params], world)
                buffer = torch.empty(0, dtype=params[0].dtype, device=params[0].device)
                self.buckets.append(Bucket(b, params, names, offsets, buffer, layout=layout,
                                           direct=indices[0] in alone))
            elif indices[0] in alone:  # its gradient, once autograd made it
                buffer = torch.empty(0, dtype=params[0].dtype, device=params[0].device)
                self.buckets.append(Bucket(b, params, names, offsets, buffer, direct=True))
            else:
                buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
                self.buckets.append(Bucket(b, params, names, offsets, buffer))
            for pos, p in enumerate(params):
                self._where[id(p)] = (b, pos)
        self._next_launch = 0
        self.armed = True
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]  # torch stub
            for _, p in named
        ]

    # -- during backward ----------------------------------------------------------------

    def _view(self, bucket: Bucket, pos: int) -> torch.Tensor:
        """Parameter ``pos`` of ``bucket``'s slice of the buffer, shaped as the parameter."""
        p = bucket.params[pos]
        return bucket.buffer[bucket.offsets[pos]:bucket.offsets[pos] + p.numel()].view_as(p)

    def _gather(self, bucket: Bucket, pos: int) -> None:
        """Bring parameter ``pos``'s gradient into the bucket (all_reduce: make ``.grad`` the view;
        reduce_scatter: pack it, then drop ``.grad``)."""
        p = bucket.params[pos]
        if bucket.direct and self.mode == "all_reduce":  # [Note: a large gradient all-reduced as it is]
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # no gradient this step: zeros, as any bucket's
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            bucket.buffer = p.grad.detach().view(-1)
            return
        if bucket.direct:  # [Note: a large gradient reduce-scattered as it is]
            grad = p.grad
            bucket.buffer = (grad.detach().reshape(-1) if grad is not None and grad.is_contiguous()
                             else torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if grad is None
                             else grad.detach().contiguous().view(-1))
            p.grad = None
            return
        if bucket.layout is not None:
            if bucket.buffer.numel() != bucket.layout.numel:
                bucket.buffer = torch.empty(bucket.layout.numel, dtype=p.dtype, device=p.device)
            bucket.layout.pack_one(bucket.buffer, pos, p.grad)
            p.grad = None
            return
        view = self._view(bucket, pos)
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.dtype == view.dtype:
            return  # already the view: autograd accumulated in place
        else:
            view.copy_(grad)
        if self.mode == "all_reduce":
            p.grad = view

    def _on_grad(self, param: torch.Tensor) -> None:
        b, pos = self._where[id(param)]
        bucket = self.buckets[b]
        if not self.armed:
            if self.mode == "all_reduce" and param.grad is not None:
                self._gather(bucket, pos)  # later microbatches accumulate into the view
            return
        self._gather(bucket, pos)
        bucket.ready.add(pos)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                break
            self._launch(bucket)
            self._next_launch += 1
        if self.mode == "reduce_scatter":  # a finished reduce-scatter's input is not needed any more
            for done in self.buckets[:self._next_launch]:
                if done.work is not None and done.buffer.numel() and done.work.is_completed():
                    done.buffer, done.staged = done.buffer.new_empty(0), None

    def _launch(self, bucket: Bucket) -> None:
        wire = bucket.buffer.to(wire_device(self.comm.backend, bucket.buffer.device))  # a CPU copy, or itself
        bucket.staged = wire if wire is not bucket.buffer else None
        if self.mode == "all_reduce":
            bucket.work = self.comm.all_reduce(wire, ReduceOp.MEAN, timeout=self.timeout, async_op=True)
        else:
            assert bucket.layout is not None
            n = bucket.layout.segment_numel
            kept = bucket.kept
            bucket.shard = (kept.segment if kept is not None and kept.segment.dtype == wire.dtype
                            and kept.segment.device == wire.device
                            else torch.empty(n, dtype=wire.dtype, device=wire.device))
            # the packed buffer (or a direct bucket's gradient, dropped from its parameter) is read by nothing
            # once it is reduced: the backend may reduce in it rather than in a copy
            bucket.work = self.comm.reduce_scatter_tensor(bucket.shard, wire, ReduceOp.MEAN,
                                                          timeout=self.timeout, async_op=True,
                                                          reuse_input=True)

    # -- after backward -----------------------------------------------------------------

    def finish(self) -> list[Shard]:
        """Wait for every bucket and publish the averaged gradients; reset for the next step.

        Parameters whose hook did not fire contribute their ``.grad`` as it is (zeros if
        None); in all_reduce mode each ``param.grad`` is then the averaged view. Returns the
        shards in reduce_scatter mode (an empty list in all_reduce mode).
        """
        for bucket in self.buckets:  # parameters whose hook did not fire (no gradient, or not armed)
            for pos in range(len(bucket.params)):
                if pos not in bucket.ready:
                    self._gather(bucket, pos)
                    bucket.ready.add(pos)
        self._launch_ready()
        shards: list[Shard] = []
        crossing: list[Work] = []
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait(self.timeout)
            if bucket.layout is not None:  # all_reduce: param.grad is the view, averaged in place
                assert bucket.shard is not None
                if self.across is not None:  # hybrid: the same rows of the other groups
                    crossing.append(self.across.all_reduce(bucket.shard, ReduceOp.MEAN, timeout=self.timeout,
                                                           async_op=True))
                shards.append(self._shard(bucket, bucket.shard))
                bucket.buffer = bucket.buffer.new_empty(0)  # the full gradients are gone
                bucket.shard = None
            elif bucket.staged is not None:  # reduced on the CPU: back into the GPU bucket param.grad views
                bucket.buffer.copy_(bucket.staged)
            if bucket.direct and bucket.layout is None:  # param.grad holds it: the bucket lets go
                bucket.buffer = bucket.buffer.new_empty(0)
            bucket.ready.clear()
            bucket.work = None
            bucket.staged = None
        for work in crossing:
            work.wait(self.timeout)
        if shards and shards[0].segment.device != self.buckets[0].buffer.device:  # reduced on the CPU
            shards = [self._shard(self.buckets[s.bucket], s.segment.to(self.buckets[s.bucket].buffer.device))
                      for s in shards]
        self._next_launch = 0
        return shards

    def _shard(self, bucket: Bucket, segment: torch.Tensor) -> Shard:
        if bucket.kept is not None and bucket.kept.segment is segment:
            return bucket.kept
        assert bucket.layout is not None
        views = bucket.layout.segment_views(segment, self.comm.rank)
        shard = Shard(bucket.index, segment, dict(zip(bucket.names, views, strict=True)))
        if segment.device == bucket.buffer.device:  # the reduce-scatters' own segment: kept
            bucket.kept = shard
        return shard

    def reset(self) -> None:
        """Forget a step abandoned midway (buckets gathered but not finished)."""
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
            bucket.shard = None
            bucket.staged = None
            if bucket.layout is not None or bucket.direct:
                bucket.buffer = bucket.buffer.new_empty(0)
        self._next_launch = 0

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
