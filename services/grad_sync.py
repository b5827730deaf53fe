"""The communication service: gradient synchronisation for data-parallel replicas.

Gradients are gathered into buckets (``bucket_bytes``, 25 MiB by default, as torch DDP)
in the reverse order of the parameters, which is roughly the order backward produces
them. A hook on every parameter copies its gradient into the bucket as soon as autograd
has accumulated it; when a bucket is full it is all-reduced asynchronously while backward
goes on with earlier layers, so communication overlaps compute. :meth:`GradSync.finish`
waits for the buckets and writes the averaged gradients back into ``param.grad``.

Buckets are launched strictly in bucket order (bucket i waits until buckets < i were
launched), so every replica issues the same collectives in the same order even if its
hooks fire in a slightly different order. A parameter that got no gradient in a step
contributes zeros (as DDP with ``find_unused_parameters``).

The reduce-scatter path (``mode="reduce_scatter"``) is the one a sharded optimizer
(ZeRO) uses: :meth:`GradSync.finish` then leaves each replica with the averaged gradient
of its own contiguous shard of every bucket, returned as :class:`Shard` views, and the
full gradients are not written back.

Pipeline stages run one backward per microbatch and gradients accumulate over them;
only the last backward of a step may launch buckets. :attr:`GradSync.armed` says whether
hooks act (True by default): a stage sets it False at the start of a step and True just
before its last backward (see ``services/grad_path.py``). A parameter whose hook did not
fire while armed contributes its accumulated ``.grad`` (zeros if it has none).

Works on any :class:`~comm.base.Communicator` backend. Not thread-safe: one backward
at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
from torch import nn

from comm.base import Communicator, ReduceOp, Work

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "GradSync", "Shard", "assign_buckets"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 << 20


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


@dataclass(frozen=True)
class Shard:
    """reduce_scatter mode: this replica's slice ``[start, stop)`` of a bucket's flat gradient."""

    bucket: int
    start: int
    stop: int
    grad: torch.Tensor


def assign_buckets(sizes: list[tuple[str, int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_bytes`` (one dtype each).

    ``sizes`` lists (name, bytes, dtype) in registration order; buckets are filled in reverse
    order. A parameter larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in reversed(range(len(sizes))):
        _, nbytes, dtype = sizes[i]
        current, used = open_by_dtype.get(dtype, ([], 0))
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
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
        mode: ``"all_reduce"`` (every replica gets the full averaged gradient) or
            ``"reduce_scatter"`` (each gets its shard; for sharded optimizers).
        timeout: bound on waiting for each bucket's collective.

    Usage::

        sync = GradSync(model, comm)
        loss.backward()        # buckets go out while backward runs
        sync.finish()          # param.grad now holds the average over replicas
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        mode: Literal["all_reduce", "reduce_scatter"] = "all_reduce",
        timeout: timedelta | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm = comm
        self.mode = mode
        self.timeout = timeout
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        sizes = [(n, p.numel() * p.element_size(), p.dtype) for n, p in named]
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        world = comm.world_size
        for b, indices in enumerate(assign_buckets(sizes, bucket_bytes)):
            params = [named[i][1] for i in indices]
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            padded = -(-total // world) * world if mode == "reduce_scatter" else total
            buffer = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
            self.buckets.append(Bucket(b, params, [named[i][0] for i in indices], offsets, buffer))
            for pos, p in enumerate(params):
                self._where[id(p)] = (b, pos)
        self._next_launch = 0
        self.armed = True
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]  # torch stub
            for _, p in named
        ]

    # -- during backward ----------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        b, pos = self._where[id(param)]
        bucket = self.buckets[b]
        grad = param.grad
        view = bucket.buffer[bucket.offsets[pos]:bucket.offsets[pos] + param.numel()]
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.reshape(-1))
        bucket.ready.add(pos)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.mode == "all_reduce":
            bucket.work = self.comm.all_reduce(bucket.buffer, ReduceOp.MEAN, timeout=self.timeout,
                                               async_op=True)
        else:
            n = bucket.buffer.numel() // self.comm.world_size
            bucket.shard = torch.empty(n, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
            bucket.work = self.comm.reduce_scatter_tensor(bucket.shard, bucket.buffer, ReduceOp.MEAN,
                                                          timeout=self.timeout, async_op=True)

    # -- after backward -----------------------------------------------------------------

    def finish(self) -> list[Shard]:
        """Wait for every bucket and publish the averaged gradients; reset for the next step.

        Parameters whose hook did not fire contribute their ``.grad`` as it is (zeros if
        None). Returns the shards in reduce_scatter mode (an empty list in all_reduce mode).
        """
        for bucket in self.buckets:  # parameters whose hook did not fire (no gradient, or not armed)
            for pos, p in enumerate(bucket.params):
                if pos not in bucket.ready:
                    view = bucket.buffer[bucket.offsets[pos]:bucket.offsets[pos] + p.numel()]
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad.reshape(-1))
                    bucket.ready.add(pos)
        self._launch_ready()
        shards: list[Shard] = []
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait(self.timeout)
            if self.mode == "all_reduce":
                for pos, p in enumerate(bucket.params):
                    view = bucket.buffer[bucket.offsets[pos]:bucket.offsets[pos] + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
            else:
                assert bucket.shard is not None
                n = bucket.shard.numel()
                start = self.comm.rank * n
                shards.append(Shard(bucket.index, start, start + n, bucket.shard))
            bucket.ready.clear()
            bucket.work = None
        self._next_launch = 0
        return shards

    def reset(self) -> None:
        """Forget a step abandoned midway (buckets gathered but not finished)."""
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
            bucket.shard = None
        self._next_launch = 0

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
