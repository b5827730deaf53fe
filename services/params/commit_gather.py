"""ZeRO-1/2's all-gather of the updated rows, bucket by bucket in forward order, behind the next forward.

After a ZeRO-1/2 optimizer step each replica of a sharding group holds its own rows of every
parameter updated and the others' rows stale; an all-gather in the group makes every parameter
whole again. :class:`CommitGather` runs it.

[Note: the commit's all-gather, deferred]
The all-gather once ran whole in the commit: every bucket in flight at once before the next
forward, overlapped with nothing, holding ``P / F + P`` of buffers. Two ways to do better were
open: (a) gather bucket by bucket in forward order, each just before the first cell that uses it
runs its forward, with the next bucket prefetched (what ZeRO-3 does for its units), or (b) a
bounded number of buckets in flight during the commit. cellmesh does (a), which bounds the memory
as (b) does and also hides the gather behind the next step's forward:

* Buckets: the trainable parameters in the order the stage's forward first uses them (the
  ``get_attr`` parameters of a traced model's own forward first, then each leaf module's as the
  graph calls it, then those no node reads; a module that is not an ``fx.GraphModule`` is one
  leaf), cut into runs of one
  dtype of at most ``gather_bytes`` (a larger parameter alone), each laid out as
  :class:`~services.params.layout.ShardLayout` lays it out.
* [Note: the first buckets ramp up] The first bucket's gather has nothing to hide behind: the first
  module waits for it. So the buckets grow from ``gather_bytes / 16`` (at least 256 KiB), doubling, to
  ``gather_bytes`` (:func:`ramp`), as DDP's first gradient bucket is small: on the GPT of
  ``bench/zero.py`` (6.6 MB) the default 4 MiB made two buckets, the first of 4 MiB waited for before
  the embedding ran; now 5 buckets of 0.26-4 MB, and the forward waits for the embedding's 160 KB.
  A parameter larger than its bucket's limit travels alone, as always; ``gather_bytes`` of 256 KiB or
  less does not ramp.
* The commit's optimizer step marks every bucket *stale* (:meth:`CommitGather.mark_stale`). A
  forward pre-hook on each leaf module gathers the stale buckets holding its parameters (waiting for
  one already in flight), copies them into the parameters, and issues the next stale bucket's
  all-gather (``async_op``): it travels while the module computes. The step's
  :meth:`CommitGather.start` gathers the ``get_attr`` parameters' buckets and prefetches the next.
* [Note: the small ones pooled] Each bucket is one collective, and a collective costs its fixed
  overhead whatever its size (about 0.1-0.3 ms of CPU per rank here). Runs in forward order put every
  small parameter between two large ones in a bucket of its own: the biases of ``bench.models:mlp``
  made 8 of its 16 buckets (4 KiB each, beside 8 weights of 4 MiB gathered in place). So the tiny
  buckets (under 64 KiB and under ``gather_bytes / 16``, of one dtype and device, up to 256 KiB in all:
  :func:`pool_small`) are merged into one that comes first; the others keep their order. The pool is
  complete before the first module that uses any of it, as every bucket is.
* At most :data:`IN_FLIGHT` buckets are in flight: issuing one more first completes the oldest.
  The gather so holds at most ``IN_FLIGHT`` whole buckets of buffers (the segment is a part of its
  bucket's), whatever the model's size (:attr:`CommitGather.peak_bytes` measures it; the planner still
  counts ``1 + 1 / F`` buckets each, a little over).
* Whatever was not gathered by the forward (a parameter no forward of the step used) is gathered
  when the step's gradients are final (:meth:`CommitGather.settle`, from the path's ``finish``),
  so between steps every parameter is whole: a clipping, a checkpoint, an evaluation, the job's
  final state and a new plan read whole, up-to-date parameters. A commit that does not precede a
  step (the job's last, before an evaluation or a new plan) or that saves a checkpoint settles at
  once, bounded the same way.

[Note: a bucket gathered in place]
A bucket of one contiguous parameter whose rows split evenly over the group (a large weight alone in
its bucket: every layer of ``bench.models:mlp``) packs as the parameter itself: segment ``r`` is rank
``r``'s rows. Its all-gather then runs on the parameter's own memory (the rank's rows as the input,
the whole parameter as the output), when the backend moves the parameter's device (``wire_device``):
no segment to fill, no packed buffer to allocate (its pages touched anew each step) and nothing to
unpack, three copies of the parameter's bytes fewer per step. Rows other ranks own are written while the
gather runs, before any module reads them (as below); the rows a rank owns are never written. A gather
dropped midway leaves those other rows stale, as any dropped bucket is.

Any other bucket is packed into its place in the gathered buffer (this rank's segment of it, the
collective's input; one copy when no shard is short of its chunk) and unpacked
from the gathered buffer into the other ranks' rows only: this rank's rows are the optimizer's, current
already (``ShardLayout.unpack(skip=rank)``); each row is copied once, straight from its strided place.

[Note: a bucket's copies worked out once]
The parameters, and so their shards, keep their storage for the stage's life (the optimizer steps
views of them), so the views a gather copies through are made at a bucket's first gather and kept:
its shards flattened for the segment's concatenation, and its unpack's destinations with each
source's place in the gathered buffer (``ShardLayout.unpack_plan``), so that each later gather makes
one view per copy of the fresh buffer, not several per parameter (the GPT of ``bench/zero.py``: 102
parameters in 5 buckets).

Why a bucket is written only before its modules run: autograd saves parameters for the backward
(a linear layer its weight), and a parameter written after its module's forward would fail the
backward's version check. Every bucket is complete before the first module using it runs, and a
bucket holds the parameters of later modules only (forward order), so a prefetched bucket completed
early writes parameters no forward of the step has read yet. Every replica of the group runs the
same action list on the same graph, so the hooks fire, and the collectives are issued, in the same
order on every rank.

A step that fails midway drops the gathers in flight (:meth:`CommitGather.abandon`): their buckets
stay stale (each replica's own rows are current) and are gathered in the next step, over the group
made anew after the reconnect.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.utils.hooks import RemovableHandle

from comm.base import Communicator, Work
from comm.errors import CommError, CommTimeoutError
from comm.factory import wire_device
from services.params.layout import ShardLayout, UnpackPlan

__all__ = ["GATHER_BYTES", "IN_FLIGHT", "CommitGather", "forward_order", "pool_small", "ramp"]

GATHER_BYTES = 4 << 20  # ComputeOptions.gather_bytes' default
IN_FLIGHT = 2  # buckets of the all-gather in flight at once: the one needed now and the next
RAMP_STEPS = 4  # the first bucket holds at most gather_bytes / 2**RAMP_STEPS, each next one twice that...
RAMP_FLOOR = 256 << 10  # ...but at least this ([Note: the first buckets ramp up])
POOL_PARAM_BYTES = 64 << 10  # a bucket under this (and gather_bytes / 16) joins the pool of tiny ones...
POOL_BYTES = 256 << 10  # ...while the pool holds at most this many bytes ([Note: the small ones pooled])


def pool_small(runs: Sequence[list[nn.Parameter]], gather_bytes: int) -> list[list[nn.Parameter]]:
    """``runs`` (buckets in forward order) with the tiny ones merged into one, first
    ([Note: the small ones pooled]): a run under :data:`POOL_PARAM_BYTES` and under a sixteenth of
    ``gather_bytes``, of the first tiny run's dtype and device, while the pool holds at most
    :data:`POOL_BYTES`; ``runs`` as they are when fewer than two are tiny."""
    def nbytes(run: list[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in run)

    tiny = min(POOL_PARAM_BYTES, gather_bytes // 16)
    pooled: list[int] = []
    left = POOL_BYTES
    for i, run in enumerate(runs):
        size = nbytes(run)
        first = runs[pooled[0]][0] if pooled else run[0]
        if size < tiny and size <= left and (run[0].dtype, run[0].device) == (first.dtype, first.device):
            pooled.append(i)
            left -= size
    if len(pooled) < 2:
        return list(runs)
    return [[p for i in pooled for p in runs[i]], *(run for i, run in enumerate(runs) if i not in pooled)]


def ramp(gather_bytes: int, index: int) -> int:
    """Bucket ``index``'s most bytes: ``gather_bytes`` halved ``RAMP_STEPS - index`` times, at least
    :data:`RAMP_FLOOR` and at most ``gather_bytes`` ([Note: the first buckets ramp up])."""
    return min(gather_bytes, max(gather_bytes >> max(RAMP_STEPS - index, 0), RAMP_FLOOR))


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    shards: list[torch.Tensor]  # this rank's rows of each (views of the parameters)
    layout: ShardLayout
    state: Literal["whole", "stale", "gathering"] = "whole"
    segment: torch.Tensor | None = None  # in flight: this rank's packed rows
    full: torch.Tensor | None = None  # in flight: the whole packed bucket
    work: Work | None = None
    in_place: bool = False  # in flight into the parameter itself ([Note: a bucket gathered in place])
    # made at the first gather, for every later one ([Note: a bucket's copies worked out once]): the shards
    # flattened (None: a shard is not contiguous, so flattening copies) and the unpack's copies
    flat: list[torch.Tensor] | None = None
    plan: UnpackPlan | None = None
    planned: bool = False

    def bytes(self) -> int:
        if self.in_place:
            return 0
        return self.full.numel() * self.full.element_size() if self.full is not None else 0  # segment: a view

    def packs_as_itself(self) -> bool:
        """Whether the bucket's packed layout is its one parameter's own memory: one contiguous parameter
        whose rows split evenly over the group (no padding), so rank ``r``'s segment is its rows."""
        return (len(self.params) == 1 and self.params[0].is_contiguous()
                and self.layout.numel == self.params[0].numel())


_Leaves = list[tuple[nn.Module, list[nn.Parameter]]]


def forward_order(module: nn.Module, params: Sequence[nn.Parameter]
                  ) -> tuple[list[nn.Parameter], _Leaves, list[nn.Parameter]]:
    """``params`` in the order ``module``'s forward first uses them: those its own forward reads
    (``get_attr`` nodes of an ``fx.GraphModule``), then per leaf module in the graph's call order its
    parameters not listed yet, then those no node reaches."""
    wanted = {id(p): p for p in params}
    seen: set[int] = set()

    def take(candidates: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        out = [p for p in candidates if id(p) in wanted and id(p) not in seen]
        seen.update(id(p) for p in out)
        return out

    if not isinstance(module, fx.GraphModule):
        return [], [(module, take(list(module.parameters())))], take(list(params))
    own: list[nn.Parameter] = []
    leaves: _Leaves = []
    for node in module.graph.nodes:
        if node.op == "get_attr":
            try:
                got = module.get_parameter(str(node.target))
            except AttributeError:  # a buffer or a plain attribute
                continue
            own += take([got])
    for node in module.graph.nodes:
        if node.op == "call_module":
            sub = module.get_submodule(str(node.target))
            leaves.append((sub, take(list(sub.parameters()))))
    return own, leaves, take(list(params))


class CommitGather:
    """All-gathers a ZeRO-1/2 stage's updated rows in buckets, each before the forward that needs it.

    Args:
        module: The stage's module (leaf modules get a forward pre-hook).
        params: Its trainable parameters.
        shards: ``id(param)`` -> this rank's rows of it (a view of the parameter: the optimizer's).
        world: The sharding group's size ``F``.
        rank: This rank in it.
        gather_bytes: A bucket's most bytes (a larger parameter travels alone).

    Attributes:
        peak_bytes: The most bytes of buffers the all-gather held at once since the last
            :meth:`reset_peak`.
    """

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], shards: dict[int, torch.Tensor],
                 world: int, rank: int, gather_bytes: int) -> None:
        self.world, self.rank = world, rank
        self.comm: Communicator | None = None
        self.peak_bytes = 0
        self._deadline = 0.0
        self._timeout = timedelta(0)
        own, leaves, unreached = forward_order(module, params)
        ordered = own + [p for _, ps in leaves for p in ps] + unreached
        self.buckets: list[_Bucket] = []
        runs: list[list[nn.Parameter]] = []
        run: list[nn.Parameter] = []
        used = 0
        for p in ordered:
            size = p.numel() * p.element_size()
            limit = ramp(gather_bytes, len(runs))
            if run and (used + size > limit or p.dtype != run[0].dtype or p.device != run[0].device):
                runs.append(run)
                run, used = [], 0
            run.append(p)
            used += size
        if run:
            runs.append(run)
        for params_of in pool_small(runs, gather_bytes):
            self._add(params_of, shards)
        where = {id(p): b.index for b in self.buckets for p in b.params}
        self._first = sorted({where[id(p)] for p in own})  # what start() gathers
        self._flight: list[_Bucket] = []
        self._handles: list[RemovableHandle] = []
        hooked: dict[int, list[int]] = {}
        for sub, ps in leaves:
            if ps:
                hooked.setdefault(id(sub), [])
                hooked[id(sub)] = sorted({*hooked[id(sub)], *(where[id(p)] for p in ps)})
        for sub, _ in leaves:
            if id(sub) in hooked:
                self._handles.append(sub.register_forward_pre_hook(self._hook(hooked.pop(id(sub)))))

    def _add(self, params: list[nn.Parameter], shards: dict[int, torch.Tensor]) -> None:
        layout = ShardLayout([p.shape for p in params], self.world)
        self.buckets.append(_Bucket(len(self.buckets), params, [shards[id(p)] for p in params], layout))

    # -- public ------------------------------------------------------------------------

    @property
    def stale(self) -> bool:
        """Whether some bucket is not whole yet (stale or in flight)."""
        return any(b.state != "whole" for b in self.buckets)

    def mark_stale(self) -> None:
        """The optimizer stepped this rank's rows: every bucket needs gathering before it is read."""
        for b in self.buckets:
            b.state = "stale" if b.state == "whole" else b.state

    def start(self, comm: Communicator, timeout: timedelta) -> bool:
        """A step begins over ``comm`` (bounded by ``timeout``): gather the buckets the stage's own forward
        reads, prefetch the next stale one. Whether it issued a collective."""
        self._arm(comm, timeout)
        if not self.stale:
            return False
        for i in self._first:
            self._ensure(i)
        self._prefetch(self._first[-1] if self._first else -1)
        return True

    def settle(self, comm: Communicator, timeout: timedelta) -> float:
        """Gather every bucket still stale and wait for those in flight (at most :data:`IN_FLIGHT` at
        once); the seconds it took (0.0: nothing to do)."""
        if not self.stale:
            return 0.0
        start = time.monotonic()
        self._arm(comm, timeout)
        for b in self.buckets:
            if b.state == "stale":
                self._issue(b)
        while self._flight:
            self._complete(self._flight[0])
        return time.monotonic() - start

    def held_bytes(self) -> int:
        """Bytes of the buffers in flight now."""
        return sum(b.bytes() for b in self._flight)

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes()

    def abandon(self) -> None:
        """Forget the gathers in flight (the group is made anew): their buckets stay stale."""
        for b in self._flight:
            b.state, b.segment, b.full, b.work, b.in_place = "stale", None, None, None, False
        self._flight.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- gathering ---------------------------------------------------------------------

    def _arm(self, comm: Communicator, timeout: timedelta) -> None:
        self.comm = comm
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout.total_seconds()

    def _hook(self, indices: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.comm is None or all(self.buckets[i].state == "whole" for i in indices):
                return
            for i in indices:
                self._ensure(i)
            self._prefetch(indices[-1])
        return hook

    def _ensure(self, index: int) -> None:
        b = self.buckets[index]
        if b.state == "stale":
            self._issue(b)
        if b.state == "gathering":
            self._complete(b)

    def _prefetch(self, after: int) -> None:
        nxt = next((b for b in self.buckets[after + 1:] if b.state == "stale"), None)
        if nxt is not None:
            self._issue(nxt)

    def _issue(self, b: _Bucket) -> None:
        assert self.comm is not None, "start() or settle() first"
        while len(self._flight) >= IN_FLIGHT:
            self._complete(self._flight[0])
        device = wire_device(self.comm.backend, b.params[0].device)
        b.in_place = b.packs_as_itself() and device == b.params[0].device
        if b.in_place:  # [Note: a bucket gathered in place]
            full = b.params[0].detach().view(-1)
            n = b.layout.segment_numel
            segment = full[self.rank * n:(self.rank + 1) * n]
        else:  # the segment is this rank's part of the gathered buffer (the collective copies nothing in)
            full = torch.empty(b.layout.numel, dtype=b.params[0].dtype, device=device)
            n = b.layout.segment_numel
            segment = full[self.rank * n:(self.rank + 1) * n]
            if (device == b.params[0].device  # no padding, no device to cross: one copy
                    and sum(s.numel() for s in b.shards) == n):
                if b.flat is None and all(s.is_contiguous() for s in b.shards):
                    b.flat = [s.view(-1) for s in b.shards]  # views of the parameters: made once
                torch.cat(b.flat if b.flat is not None else [s.reshape(-1) for s in b.shards], out=segment)
            else:  # the padding of short shards is sent unset: unpack reads no padding
                torch._foreach_copy_(b.layout.segment_views(segment, self.rank), b.shards)
        try:
            b.work = self.comm.all_gather_into_tensor(full, segment, timeout=self._left(b), async_op=True)
        except CommError as exc:
            raise CommError(f"{self._what(b)}: {exc}") from exc
        b.segment, b.full, b.state = segment, full, "gathering"
        self._flight.append(b)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def _complete(self, b: _Bucket) -> None:
        assert b.work is not None and b.full is not None
        try:
            b.work.wait(self._left(b))
        except CommTimeoutError as exc:
            raise CommTimeoutError(f"{self._what(b)}: {exc}", op=exc.op, peer=exc.peer,
                                   waited=exc.waited) from exc
        except CommError as exc:
            raise CommError(f"{self._what(b)}: {exc}") from exc
        if not b.in_place:  # this rank's rows are the optimizer's, current already
            with torch.no_grad():
                if not b.planned and b.full.device == b.params[0].device:
                    b.plan = b.layout.unpack_plan([p.detach() for p in b.params], skip=self.rank)
                    b.planned = True
                if b.plan is not None and b.full.device == b.params[0].device:
                    b.plan.run(b.full)
                else:
                    b.layout.unpack(b.full, [p.detach() for p in b.params], skip=self.rank)
        b.state, b.segment, b.full, b.work, b.in_place = "whole", None, None, None, False
        self._flight.remove(b)

    def _left(self, b: _Bucket) -> timedelta:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"{self._what(b)}: the {self._timeout.total_seconds():.1f}s given ran out "
                                   "before it was gathered", op="all_gather", peer=None,
                                   waited=self._timeout.total_seconds())
        return timedelta(seconds=left)

    def _what(self, b: _Bucket) -> str:
        return (f"all-gathering the updated rows of bucket {b.index} of {len(self.buckets)} "
                f"({len(b.params)} parameters, {b.layout.numel * b.params[0].element_size()} B) in the "
                f"sharding group of {self.world}")
