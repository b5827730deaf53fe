"""Fully sharded parameters (ZeRO-3): each rank keeps 1/F of every parameter, gathered per unit to compute.

A stage's modules are split into *units* of consecutive cells (nodes) of the stage, in the stage's
node order ([Note: units of several cells]). Each unit's trainable parameters are laid out as
:class:`~services.params.layout.ShardLayout` lays them out ([Note: the dim-0 layout]): rank ``r`` of
the sharding group of ``F`` ranks keeps segment ``r`` (``S`` elements: its rows of every parameter
of the unit) in one flat tensor, and the optimizer's parameters are views into it
(:meth:`FullyShard.named_shards`, one per parameter, named by the parameter). The module keeps its
own ``nn.Parameter`` objects, so names, hooks, tied-weight checks and the deferred linear layers of
``services/compute/weight_grads.py`` see the model they expect; only their storage comes and goes.

[Note: gather, free, prefetch]
Before a unit's forward (a forward pre-hook) its parameters are all-gathered: one
``all_gather_into_tensor`` of the segments into the packed ``F * S`` buffer, copied out into each
parameter's storage, re-allocated for it (``untyped_storage().resize_``), after which the packed
buffer is dropped. After the forward (a forward hook) the storage is released again
(``resize_(0)``): autograd's saved tensors that alias a parameter (a linear layer saves its weight)
keep the same storage object, so the next gather refills what they read. The copies run with the
version counter preserved (``torch.autograd._unsafe_preserve_version_counter``, FSDP2's way), as
the values written back are those autograd saved. Before the unit's backward (a hook on each of
its forward outputs that requires grad, FSDP2's pre-backward) it is gathered again; once its
backward has produced the gradients of its inputs (an identity autograd function on its inputs,
FSDP2's post-backward) it is freed. A unit whose inputs need no gradient (the model's first) is
freed by a callback at the end of the backward. A worker so holds its segments plus the units in
flight: the one computing and the one prefetched.

Prefetch: the pre-hook of unit ``k`` issues unit ``k + 1``'s all-gather (``async_op``) before unit
``k`` computes; the pre-backward of unit ``k`` issues unit ``k - 1``'s. The order is the stage's
node order and its reverse, known before the step (never a recorded trace). Every rank of the
group runs the same list of actions on the same graph, so the hooks fire in the same order on
every rank and the collectives match. A forward run again inside a backward (activation
recomputation) finds its unit gathered and leaves it so.

[Note: units of several cells]
One collective per cell pays a collective's fixed cost per cell, which dominates when cells are
small (the benchmark's GPT blocks of 0.8 MB, ``docs/benchmarks.md``), so consecutive cells share a unit
up to ``unit_bytes`` of trainable parameters (of one dtype and device; a cell larger than that is a
unit alone; 0: one cell per unit). A unit is gathered before the forward of whichever of its cells
runs first and freed after the forward of its last cell (cells without parameters in between run
while it is held). In the backward each cell's outputs gather it again (a no-op once gathered) and
its inputs' gradients end that cell's part: the unit is freed once every cell of it that ran with
inputs requiring a gradient has ended its part in that backward (a count per forward pass, so the
microbatches of a pipeline step each free their own); a unit with a cell whose inputs need no
gradient stays gathered until the end of the backward. The cells need not form a chain: a cell of
a branch ends its part independently of the others. The memory held per unit in flight grows to
``unit_bytes`` (the planner's memory model counts the units as the runtime cuts them).

[Note: the stage's own unit]
A parameter that no one cell holds, because the model's own forward uses it (learned positions added in
``forward``, a scalar temperature: a ``get_attr`` of the traced stage) or because two cells share it (a
tied embedding and head), belongs to the *stage's* unit, as FSDP2 puts the parameters no child unit
claims into the root module's: the stage's own code reads it, between and around the cells, and with
recompute (``services/compute/recompute.py``) that code runs in per-node modules, not the stage module,
so no module's hooks could bracket its uses. So the stage's unit is *pinned*, as FSDP2 keeps its root
unsharded between forward and backward: :meth:`FullyShard.gather_pinned` gathers it as each step begins
(after the commit's update, so it is fresh), it stays gathered through every forward and backward of
the step, and :meth:`FullyShard.finish` (or :meth:`FullyShard.abandon`) frees it after its
reduce-scatter, the backward's last (it comes first in the order, one unit per dtype and device). Its
bytes are held for the whole step; models keep such parameters small (positions, gains), except a tied
embedding, which FSDP2 holds the same way.

[Note: gradients across microbatches]
A pipeline stage runs one backward per microbatch. Two choices: reduce-scatter each unit's
gradient after every microbatch's backward and accumulate shards (the stage never holds a full
gradient beyond a unit, at ``m`` times the gradient traffic), or accumulate the full gradients in
``.grad`` over the microbatches and reduce-scatter once, in the last backward (``m`` times less
traffic, holding the stage's full gradient from its first backward to its last). cellmesh does
the second, for reasons of its executor as much as of traffic:

* GPipe (every ``B`` after every ``F``) defers its linear layers' weight gradients to one product
  per layer at the end of its last ``B`` (``services/compute/weight_grads.py``): those parameters
  have no gradient at all before the last backward, so a per-microbatch reduce-scatter has nothing
  to send for them. In the last backward each parameter's post-accumulate-grad hook fires once its
  gradient holds every microbatch (the deferred ones in the final flush), and its unit is
  reduce-scattered as soon as all of its parameters are final, while backward goes on with the
  units before it (the overlap of ``grad_sync.py``). ``armed`` says whether the coming backward is
  the last: the path arms it as for the all-reduce ([Note: microbatches and the all-reduce] in
  ``services/params/grad_path.py``).
* 1F1B (and interleaved 1F1B) computes the weight gradients of its ``B`` s in between in place,
  ``addmm_`` into ``.grad``; that needs a full ``.grad`` to add into, so it keeps the same choice:
  unsharded accumulation, one reduce-scatter per unit in the last ``B``. Its price is the stage's
  full gradient held for most of the step, where 1F1B's point is holding little; a per-microbatch
  reduce-scatter would trade it for ``m`` times the traffic and is left for when memory, not
  bandwidth, is what a plan lacks.

Between steps a rank holds ``1/F`` of the parameters, of the gradients (the reduce-scattered
segments, ``.grad`` of the shard parameters) and of the optimizer state (an elementwise optimizer:
SGD, momentum, Adam, AdamW over the shards is exact), plus the padding of the last rows.

Hybrid sharding: with ``replicate`` (a communicator over the ranks holding the same segment in the
other groups), the reduce-scattered segment is then all-reduced (MEAN) across the groups, so every
group ends with the gradient of the mean over all ``F * R`` ranks.

Works on any :class:`~comm.base.Communicator`; a backend that moves CPU tensors (zmq, gloo) gathers
and reduces CPU copies of a GPU stage's buffers (``comm.factory.wire_device``). Not thread-safe:
one forward or backward at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from comm.base import Communicator, ReduceOp, Work
from comm.errors import CommError, CommTimeoutError
from comm.factory import wire_device
from services.params.layout import ShardLayout

# autograd's saved tensors alias the parameters; refilling them must not look like an in-place change
_preserve_version: Callable[[torch.Tensor], AbstractContextManager[None]] = (
    torch.autograd.grad_mode._unsafe_preserve_version_counter)

__all__ = ["FullyShard", "FullyShardError", "Unit", "storage_bytes"]


class FullyShardError(RuntimeError):
    """A unit's collective failed or its parameters were used in a state they cannot be (the message
    names the unit, what it was doing, and the cause)."""


@dataclass
class _Pass:
    """One forward pass through a unit: how many of its cells still have a backward to end, and whether
    a cell whose inputs need no gradient ran (then only the end of the backward frees the unit)."""

    pending: int = 0
    complete: bool = True


@dataclass
class Unit:
    """Consecutive cells of the stage: their parameters, their layout over the group, this rank's segment.

    Attributes:
        index: Its place in the stage's node order.
        name: The cell's name (several: ``"first..last"``).
        modules: The cells' modules, in node order.
        names: Its parameters' names, ``"{cell}.{name in the module}"``.
        params: The module's own parameters (their storage is freed between uses).
        layout: Their dim-0 layout over the sharding group.
        segment: This rank's ``S`` elements; ``shards`` are views into it.
        shards: One parameter per entry of ``params``: this rank's rows of it (the optimizer's).
    """

    index: int
    name: str
    modules: list[nn.Module]
    names: list[str]
    params: list[nn.Parameter]
    layout: ShardLayout
    segment: torch.Tensor
    shards: list[nn.Parameter]
    pinned: bool = False  # the stage's own unit: gathered for the whole step ([Note: the stage's own unit])
    state: Literal["free", "gathering", "gathered"] = "free"
    gather_out: torch.Tensor | None = None
    gather_work: Work | None = None
    ready: set[int] = field(default_factory=set)  # positions whose gradient is final (armed backward)
    reduce_in: torch.Tensor | None = None
    reduce_out: torch.Tensor | None = None
    reduce_work: Work | None = None
    current: _Pass | None = None  # the forward pass running through it (None between passes)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done with them."""

    @staticmethod
    def forward(ctx: Any, owner: FullyShard, unit: int, done: _Pass,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.unit, ctx.done = owner, unit, done
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.owner._post_backward(ctx.unit, ctx.done)
        return (None, None, None, *grads)


class FullyShard:
    """Shards the parameters of ``units`` over ``comm`` and gathers each unit around its forward and backward.

    Args:
        units: ``(name, module)`` per cell, in the stage's node order. Their trainable parameters
            are sharded (without ``root``, a parameter may belong to one cell only); every rank passes
            the same model, initialised alike.
        comm: The sharding group (``F = comm.world_size``).
        replicate: Hybrid sharding: the group of the ranks holding the same segment in other
            sharding groups; each reduce-scattered segment is all-reduced (MEAN) over it.
        timeout: Bound on every wait for a collective (None: the communicator's default).
        prefetch: Issue the next unit's all-gather before the current unit computes.
        unit_bytes: Consecutive cells share a unit up to this many bytes of parameters ([Note: units
            of several cells]); 0: a unit per cell.
        root: The stage module enclosing the cells and the parameters of its own that no one cell holds
            (used by its forward outside them, or shared by two cells), by name: they form the stage's
            unit ([Note: the stage's own unit]); a parameter two cells share goes there too.

    Usage::

        fs = FullyShard([(c.name, c.module) for c in cells], comm)
        opt = torch.optim.AdamW([p for _, p in fs.named_shards()])
        fs.armed = True          # the coming backward is the step's last
        loss.backward()          # units gathered, freed and reduce-scattered as backward goes
        fs.finish()              # the shards' .grad hold the mean over the group
        opt.step(); opt.zero_grad()

    Raises:
        ValueError: A parameter belongs to two cells and no ``root`` is given, or a cell mixes dtypes or
            devices.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], comm: Communicator, *,
                 replicate: Communicator | None = None, timeout: timedelta | None = None,
                 prefetch: bool = True, unit_bytes: int = 0,
                 root: tuple[nn.Module, Sequence[tuple[str, nn.Parameter]]] | None = None) -> None:
        self.comm = comm
        self.replicate = replicate
        self.timeout = timeout
        self.prefetch = prefetch
        self.armed = False
        self.gathers = 0  # all-gathers issued around forwards and backwards (a unit's counts once)
        self.units: list[Unit] = []
        self._handles: list[RemovableHandle] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (unit, position)
        self._next_launch = 0  # position in the backward order (units reversed) of the next reduce-scatter
        self._in_backward = False
        self._unit_of: dict[int, int] = {}  # id(module) -> its unit
        owner: dict[int, str] = {}
        shared = {id(p) for _, p in root[1]} if root is not None else set()
        cells: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] = []
        for name, module in units:
            named = [(f"{name}.{n}", p) for n, p in module.named_parameters()
                     if p.requires_grad and id(p) not in shared]
            for pname, p in named:
                if id(p) in owner:
                    raise ValueError(f"parameter {pname!r} is also {owner[id(p)]!r} of another unit: a "
                                     "parameter tied across cells cannot be fully sharded; keep the modules "
                                     "that share it in one cell")
                owner[id(p)] = pname
            if not named:
                continue
            kinds = {(p.dtype, p.device) for _, p in named}
            if len(kinds) > 1:
                raise ValueError(f"unit {name!r} mixes dtypes or devices {sorted(map(str, kinds))}: its "
                                 "parameters travel in one flat buffer; give them one dtype and device")
            cells.append((name, module, named))
        if root is not None:  # first the stage's own units, one per dtype and device
            by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
            for pname, p in root[1]:
                if p.requires_grad:
                    by_kind.setdefault((p.dtype, p.device), []).append((pname, p))
            for (dtype, _), own in by_kind.items():
                label = "stage" if len(by_kind) == 1 else f"stage ({dtype})"
                self.units.append(self._make_unit(len(self.units), [(label, root[0], own)]))
                self.units[-1].pinned = True
        for group in _group_cells(cells, unit_bytes):
            self.units.append(self._make_unit(len(self.units), group))
        for unit in self.units:
            if unit.pinned:  # no module's forward brackets its uses: only its gradients are hooked
                for p in unit.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._on_grad))
            else:
                self._hook(unit)

    # -- building --------------------------------------------------------------------

    def _make_unit(self, index: int,
                   cells: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]) -> Unit:
        named = [n for _, _, cell in cells for n in cell]
        name = cells[0][0] if len(cells) == 1 else f"{cells[0][0]}..{cells[-1][0]}"
        params = [p for _, p in named]
        for pname, p in named:
            own = p.untyped_storage().nbytes() == p.numel() * p.element_size()
            if p.storage_offset() or not p.is_contiguous() or not own:
                raise ValueError(f"parameter {pname!r} is a view into a larger tensor: a fully sharded "
                                 "parameter frees and refills its own storage; give it storage of its own")
        layout = ShardLayout([tuple(p.shape) for p in params], self.comm.world_size)
        rank = self.comm.rank
        segment = torch.zeros(layout.segment_numel, dtype=params[0].dtype, device=params[0].device)
        views = layout.segment_views(segment, rank)
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(params, views, strict=True)):
                view.copy_(layout.shard_of(p.detach(), i, rank))
        shards = [nn.Parameter(view, requires_grad=True) for view in views]
        unit = Unit(index, name, [m for _, m, _ in cells], [n for n, _ in named], params, layout, segment,
                    shards)
        for pos, p in enumerate(params):
            self._where[id(p)] = (index, pos)
        for _, m, _ in cells:
            self._unit_of[id(m)] = index
        _free(params)
        return unit

    def _hook(self, unit: Unit) -> None:
        for k, m in enumerate(unit.modules):
            last = k == len(unit.modules) - 1
            self._handles.append(m.register_forward_pre_hook(self._pre_forward(unit.index), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_forward(unit.index, last)))
        for p in unit.params:
            self._handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                self._on_grad))

    # -- public ----------------------------------------------------------------------

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's shard of every sharded parameter, named by the parameter (the optimizer's)."""
        return [(n, s) for u in self.units for n, s in zip(u.names, u.shards, strict=True)]

    def finish(self) -> None:
        """After the step's last backward: reduce-scatter what is left, wait for every unit, and point its
        shards' ``.grad`` at the segment's mean gradient (the step's: a gradient accumulates over the
        microbatches of a step, not across steps). Full ``.grad`` s are dropped; unarmed again.

        A parameter that got no gradient contributes zeros.
        """
        for unit in self.units:
            unit.ready.update(range(len(unit.params)))
        self._launch_ready()
        for unit in self.units:
            assert unit.reduce_work is not None and unit.reduce_out is not None
            self._wait(unit, unit.reduce_work, "reduce-scattering its gradients")
            out = unit.reduce_out
            if self.replicate is not None:
                work = self.replicate.all_reduce(out, ReduceOp.MEAN, timeout=self.timeout, async_op=True)
                self._wait(unit, work, "all-reducing its gradient segment across the sharding groups")
            out = out.to(unit.segment.device)
            for shard, grad in zip(unit.shards, unit.layout.segment_views(out, self.comm.rank), strict=True):
                shard.grad = grad
            unit.reduce_in = unit.reduce_out = unit.reduce_work = None
            unit.ready.clear()
            if unit.pinned:  # the step's update comes next: the next step gathers it anew
                self._release(unit.index)
        self._next_launch = 0
        self.armed = False

    def gather_pinned(self) -> None:
        """As a step begins, after the commit's update: gather the stage's own units anew and keep them for
        the step ([Note: the stage's own unit]). Every rank of the group calls it at each step."""
        for unit in self.units:
            if unit.pinned:
                self._release(unit.index)  # gathered before the last update (an evaluation's): stale
                self._ensure(unit.index)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter whole (a copy), by name: one all-gather per unit, so every rank of
        the group must call it (checkpoints, checks)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            packed = self._gather_into(unit)
            for i, name in enumerate(unit.names):
                full = torch.empty(unit.params[i].shape, dtype=unit.segment.dtype, device=unit.segment.device)
                unit.layout.unpack_one(packed, i, full)
                out[name] = full
        return out

    def held_bytes(self) -> dict[str, int]:
        """What this rank holds now, in bytes: the full parameters' storage, the packed buffers of the
        all-gathers in flight (prefetches), their full gradients, the segments (the shards), and the
        shards' gradients."""
        params = [p for u in self.units for p in u.params]
        return {
            "full_parameters": storage_bytes(params),
            "gathering": storage_bytes(u.gather_out for u in self.units),
            "full_gradients": storage_bytes(p.grad for p in params),
            "shards": storage_bytes(u.segment for u in self.units),
            "shard_gradients": storage_bytes(s.grad for u in self.units for s in u.shards),
        }

    def abandon(self) -> None:
        """Forget a step that failed midway: pending collectives are dropped (the group must be made
        anew before the next step), every unit freed, full gradients dropped."""
        for unit in self.units:
            unit.gather_out = unit.gather_work = None
            unit.reduce_in = unit.reduce_out = unit.reduce_work = None
            unit.ready.clear()
            _free(unit.params)
            unit.state = "free"
            unit.current = None
            for p in unit.params:
                p.grad = None
        self._next_launch = 0
        self._in_backward = False
        self.armed = False

    def close(self) -> None:
        """Remove every hook (the parameters stay freed: read them with :meth:`full_parameters`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- gather and free -----------------------------------------------------------------

    def _wire(self, unit: Unit) -> torch.device:
        return wire_device(self.comm.backend, unit.segment.device)

    def _issue_gather(self, unit: Unit) -> None:
        if unit.state != "free":
            return
        wire = self._wire(unit)
        segment = unit.segment.to(wire)
        unit.gather_out = torch.empty(unit.layout.numel, dtype=segment.dtype, device=wire)
        try:
            unit.gather_work = self.comm.all_gather_into_tensor(unit.gather_out, segment,
                                                                timeout=self.timeout, async_op=True)
        except Exception as exc:
            raise FullyShardError(f"unit {unit.name!r}: all-gathering its parameters: {exc}") from exc
        unit.state = "gathering"
        self.gathers += 1

    def _gather_into(self, unit: Unit) -> torch.Tensor:
        """A synchronous all-gather of ``unit``'s packed buffer (on the unit's device)."""
        wire = self._wire(unit)
        out = torch.empty(unit.layout.numel, dtype=unit.segment.dtype, device=wire)
        work = self.comm.all_gather_into_tensor(out, unit.segment.to(wire), timeout=self.timeout,
                                                async_op=True)
        self._wait(unit, work, "all-gathering its parameters")
        return out.to(unit.segment.device)

    def _ensure(self, index: int) -> None:
        """Unit ``index`` gathered: its all-gather issued if it was not, waited for, copied out."""
        unit = self.units[index]
        if unit.state == "gathered":
            return
        self._issue_gather(unit)
        assert unit.gather_work is not None and unit.gather_out is not None
        self._wait(unit, unit.gather_work, "all-gathering its parameters")
        packed = unit.gather_out.to(unit.segment.device)
        unit.gather_out = unit.gather_work = None
        with torch.no_grad():
            for i, p in enumerate(unit.params):
                _allocate(p)
                with _preserve_version(p):
                    unit.layout.unpack_one(packed, i, p.detach())
        unit.state = "gathered"

    def _release(self, index: int) -> None:
        unit = self.units[index]
        if unit.state == "gathering":  # a prefetch nobody used: complete it, so the group stays in step
            assert unit.gather_work is not None
            self._wait(unit, unit.gather_work, "all-gathering its parameters (prefetched)")
            unit.gather_out = unit.gather_work = None
        _free(unit.params)
        unit.state = "free"

    def _wait(self, unit: Unit, work: Work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except CommTimeoutError as exc:
            raise CommTimeoutError(f"unit {unit.name!r} (fully sharded): {what}: {exc}", op=exc.op,
                                   peer=exc.peer, waited=exc.waited) from exc
        except CommError as exc:
            raise FullyShardError(f"unit {unit.name!r} (fully sharded): {what}: {exc}") from exc

    # -- hooks ------------------------------------------------------------------------

    def _pre_forward(self, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self._ensure(index)
            if self._in_backward:  # a recomputed forward inside the backward: the unit stays gathered
                return None
            if self.prefetch and index + 1 < len(self.units):
                self._issue_gather(self.units[index + 1])
            if not torch.is_grad_enabled():
                return None
            unit = self.units[index]
            if unit.current is None:
                unit.current = _Pass()
            flat, spec = pytree.tree_flatten((args, kwargs))
            where = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not where:
                unit.current.complete = False  # freed at the end of the backward instead
                return None
            unit.current.pending += 1
            outs = _PostBackward.apply(  # type: ignore[no-untyped-call]  # torch stub
                self, index, unit.current, *[flat[k] for k in where])
            for k, x in zip(where, outs, strict=True):
                flat[k] = x
            return pytree.tree_unflatten(flat, spec)
        return hook

    def _post_forward(self, index: int, last: bool) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._in_backward:
                return None
            if last:  # the unit's last cell: the pass through it ends
                self._release(index)
                self.units[index].current = None
            if torch.is_grad_enabled():
                for t in pytree.tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward(index))  # type: ignore[no-untyped-call]
            return None
        return hook

    def _pre_backward(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._ensure(index)
            if self.prefetch and index > 0:
                self._issue_gather(self.units[index - 1])
        return hook

    def _post_backward(self, index: int, done: _Pass) -> None:
        done.pending -= 1
        if done.pending == 0 and done.complete:
            self._release(index)

    def _end_backward(self) -> None:
        for unit in self.units:
            if unit.state != "free" and not unit.pinned:
                self._release(unit.index)
        self._in_backward = False

    # -- gradients ----------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        index, pos = self._where[id(param)]
        self.units[index].ready.add(pos)
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Reduce-scatter units in backward order (the last unit first), each once its gradients are in."""
        while self._next_launch < len(self.units):
            unit = self.units[len(self.units) - 1 - self._next_launch]
            if len(unit.ready) < len(unit.params):
                return
            self._launch(unit)
            self._next_launch += 1

    def _launch(self, unit: Unit) -> None:
        wire = self._wire(unit)
        packed = torch.empty(unit.layout.numel, dtype=unit.segment.dtype, device=unit.segment.device)
        unit.layout.pack([None if p.grad is None else p.grad.detach() for p in unit.params], out=packed)
        for p in unit.params:
            p.grad = None  # the full gradient lives on in the packed buffer until the reduce-scatter ends
        unit.reduce_in = packed.to(wire)
        unit.reduce_out = torch.empty(unit.layout.segment_numel, dtype=packed.dtype, device=wire)
        try:
            unit.reduce_work = self.comm.reduce_scatter_tensor(unit.reduce_out, unit.reduce_in, ReduceOp.MEAN,
                                                               timeout=self.timeout, async_op=True,
                                                               reuse_input=True)  # dropped once it ends
        except Exception as exc:
            raise FullyShardError(f"unit {unit.name!r}: reduce-scattering its gradients: {exc}") from exc


def _group_cells(cells: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]], unit_bytes: int
                 ) -> list[list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]]:
    """Consecutive cells in units of at most ``unit_bytes`` of parameters, one dtype and device each (a
    larger cell alone; ``unit_bytes`` 0: a unit per cell)."""
    groups: list[list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]] = []
    used = 0
    for cell in cells:
        size = sum(p.numel() * p.element_size() for _, p in cell[2])
        kind = (cell[2][0][1].dtype, cell[2][0][1].device)
        last = groups[-1] if groups else None
        if (last is None or used + size > unit_bytes
                or (last[0][2][0][1].dtype, last[0][2][0][1].device) != kind):
            groups.append([cell])
            used = size
        else:
            last.append(cell)
            used += size
    return groups


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of the distinct storages behind ``tensors`` (views of one storage count once; None: 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _free(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.untyped_storage().resize_(0)


def _allocate(p: nn.Parameter) -> None:
    p.untyped_storage().resize_(p.numel() * p.element_size())
