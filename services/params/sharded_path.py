"""ZeRO-3 as a stage's gradient path: the replicas shard the parameters themselves (``plan.zero = 3``).

:class:`FullyShardedPath` is the collective path of a stage whose plan fully shards
(``ComputeOptions.zero_stage`` 3) over groups of ``F = shard_factor`` consecutive replicas (replica
``r`` is rank ``r % F`` of group ``r // F``, as ZeRO-1/2's groups in ``services/params/zero.py``).
Its first :meth:`~FullyShardedPath.begin` (the group is formed) hands the stage's units to
:class:`~services.params.fully_sharded.FullyShard`: the leaf modules the stage's graph calls (a cell,
a block of a stack), in graph order, consecutive ones sharing a unit up to ``gather_bytes`` of
parameters ([Note: units of several cells]), so from then on the stage holds its rows of every
parameter and gathers each unit around its forward and backward ([Note: gather, free, prefetch]).
Before that (an evaluation before the first training step) the stage runs whole, as plain data
parallelism would.

Per step::

    run_step: begin (the group; FullyShard made once)  arm before the last backward
              the units reduce-scatter in the last backward  finish: the shards' .grad set
    commit:   the optimizer steps the shards (this path's optimizer_params), nothing to gather:
              the next forward gathers each unit

It offers what the compute service asks of ZeRO-1/2's :class:`~services.params.zero.ZeroPath`
(``optimizer_params``, ``attach_grads``, ``held_grads``, ``full_state``,
``shard_restored``, ``held_bytes``) and :meth:`~FullyShardedPath.whole` for what reads the
parameters whole (the final state, a checkpoint's snapshot): an all-gather per unit, so every
replica of the group must call it.

A parameter used outside the leaf modules (a ``get_attr`` of a traced model's own forward: learned
positions, a gain) or by two of them (a tied embedding and head) belongs to no cell's unit: it is the
stage's own, gathered as each step begins and held through it ([Note: the stage's own unit] in
``services/params/fully_sharded.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import fx, nn

from comm.base import Communicator
from comm.factory import wire_device
from services.checkpoint.stage_state import OptimizerState
from services.params.fully_sharded import FullyShard, storage_bytes
from services.params.grad_path import CollectivePath
from services.params.layout import ShardLayout
from services.params.zero import per_element, restored_rows
from services.protocol import ComputeOptions, PhaseTiming

__all__ = ["FullyShardedPath", "stage_units"]


def stage_units(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Parameter]]]:
    """The units of a stage's module: each leaf module its graph calls, in graph order (a module that is
    not an ``fx.GraphModule`` is one unit), and the trainable parameters none of them holds alone (used
    by the stage's own forward, or by two of them), by their names in ``module``: the stage's own."""
    units: list[tuple[str, nn.Module]] = []
    direct: set[int] = set()  # read by the stage's own forward (a get_attr), even if a leaf holds it too
    if isinstance(module, fx.GraphModule):
        seen: set[int] = set()
        for node in module.graph.nodes:
            if node.op == "call_module":
                sub = module.get_submodule(str(node.target))
                if id(sub) not in seen:
                    seen.add(id(sub))
                    units.append((str(node.target), sub))
            elif node.op == "get_attr":
                attr = _attribute(module, str(node.target))
                if isinstance(attr, nn.Parameter):
                    direct.add(id(attr))
    else:
        units.append(("stage", module))
    holders: dict[int, int] = {}
    for _, m in units:
        for p in m.parameters():  # a module's parameters() lists a tensor it holds twice once
            holders[id(p)] = holders.get(id(p), 0) + 1
    own = [(n, p) for n, p in module.named_parameters()
           if p.requires_grad and (holders.get(id(p), 0) != 1 or id(p) in direct)]
    return units, own


def _attribute(module: nn.Module, target: str) -> object:
    """What ``target`` (a dotted ``get_attr`` path) names on ``module``, or None."""
    found: object = module
    for part in target.split("."):
        found = getattr(found, part, None)
    return found


class FullyShardedPath(CollectivePath):
    """The collective path of a stage whose replicas fully shard its parameters (ZeRO-3).

    Args:
        module: The stage's module (an ``fx.GraphModule`` of the model's leaf modules).
        options: The stage's options (``zero_stage`` 3, ``shard_factor``, and those of
            :class:`~services.params.grad_path.CollectivePath`).

    Raises:
        ValueError: Not ``zero_stage`` 3.
    """

    def __init__(self, module: nn.Module, options: ComputeOptions) -> None:
        if options.zero_stage != 3:
            raise ValueError(f"FullyShardedPath runs plan.zero 3, not {options.zero_stage}")
        super().__init__(module, options)
        self.stage = 3  # the ZeRO stage, as ZeroPath.stage
        self.factor = options.shard_factor
        self.rank = options.replica % self.factor
        self._replicas = options.num_replicas
        self._units, self._own = stage_units(module)
        self._unit_bytes = options.gather_bytes
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._fs: FullyShard | None = None
        self._shards: dict[int, nn.Parameter] = {}  # id(param) -> this rank's rows of it
        self._shard_comm: Communicator | None = None
        self._across: Communicator | None = None

    @property
    def sharded(self) -> bool:
        """Whether the parameters are sharded yet (from the first :meth:`begin` on)."""
        return self._fs is not None

    # -- the step -----------------------------------------------------------------------

    def begin(self, timeout: timedelta) -> None:
        shard_comm = self._groups_ready(timeout)
        if self._fs is None:
            self._fs = FullyShard(self._units, shard_comm, replicate=self._across, timeout=timeout,
                                  unit_bytes=self._unit_bytes,
                                  root=(self._module, self._own) if self._own else None)
            by_name = dict(self._fs.named_shards())
            for unit in self._fs.units:
                for name, p in zip(unit.names, unit.params, strict=True):
                    self._shards[id(p)] = by_name[name]
        self._fs.comm, self._fs.replicate = shard_comm, self._across  # new ones after a reconnect
        self._fs.timeout = timeout
        self._fs.armed = False
        self.launched = False
        self._fs.gather_pinned()  # the stage's own unit, for the whole step

    def _groups_ready(self, timeout: timedelta) -> Communicator:
        if self._shard_comm is None:
            try:
                comm = self._link.wait(timeout)
            except TimeoutError as exc:
                raise TimeoutError(f"replica {self._replica}: the data-parallel group: {exc}") from None
            assert comm is not None  # num_replicas > 1
            self._comm = comm
            f, d = self.factor, self._replicas
            if f == d:
                self._shard_comm = comm
            else:  # every replica makes every group, in the same order (new_group)
                for g in range(d // f):
                    self._shard_comm = comm.new_group(range(g * f, (g + 1) * f)) or self._shard_comm
                for j in range(f):
                    self._across = comm.new_group(range(j, d, f)) or self._across
        assert self._shard_comm is not None
        return self._shard_comm

    def arm(self) -> None:
        assert self._fs is not None, "begin() first"
        self._fs.armed = True
        self.launched = True

    def finish(self, timeout: timedelta) -> PhaseTiming | None:
        assert self._fs is not None, "begin() first"
        start = time.time()
        self._fs.timeout = timeout
        self._fs.finish()
        return PhaseTiming(name="reduce_scatter", start=start, end=time.time())

    def held_grads(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for n, p in params:
            shard = self._shards.get(id(p))
            grad = shard.grad if shard is not None else p.grad
            if grad is not None:
                out.append((n, grad))
        return out

    def abandon(self) -> None:
        if self._fs is not None:
            self._fs.abandon()
        self.launched = False

    def reconnect(self, prefix: str) -> None:
        """A new generation: the same replicas, so each keeps its segments; the groups are made anew at the
        next :meth:`begin` and the units collect over them from then on."""
        if self._fs is not None:
            self._fs.abandon()
        self._close_groups()
        self._comm = None
        self.launched = False
        self._link.connect(prefix)

    def close(self) -> None:
        if self._fs is not None:
            self._fs.close()
        self._close_groups()
        super().close()

    def _close_groups(self) -> None:
        for sub in (self._shard_comm, self._across):
            if sub is not None and sub is not self._comm:
                sub.close()
        self._shard_comm = self._across = None

    # -- the update ---------------------------------------------------------------------

    def optimizer_params(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        """What the stage's optimizer steps: this rank's rows of each of ``params``, by name (a frozen
        parameter, which no unit shards, as it is: it gets no gradient, so no update)."""
        self._require_shards()
        return [(n, self._shards.get(id(p), p)) for n, p in params]

    def attach_grads(self, params: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Nothing to do: :meth:`finish` pointed the shards' ``.grad`` at the reduce-scattered segments."""

    def gather_params(self, timeout: timedelta, *, defer: bool = False) -> PhaseTiming | None:
        """Nothing to gather after the update: each unit is gathered before its next forward."""
        return None

    def _require_shards(self) -> None:
        if self._fs is None:
            raise RuntimeError(f"replica {self._replica}: the fully sharded stage has not begun a step, so "
                               "its parameters are not sharded yet")

    # -- reading the parameters whole ---------------------------------------------------------

    def whole(self, named: Sequence[tuple[str, torch.Tensor]],
              timeout: timedelta) -> list[tuple[str, torch.Tensor]]:
        """``named`` (the stage's parameters and buffers) with every sharded parameter gathered whole (a
        copy); the others as they are. A collective before the first step shards nothing."""
        if self._fs is None:
            return list(named)
        self._fs.comm = self._groups_ready(timeout)
        self._fs.replicate = self._across
        self._fs.timeout = timeout
        full = self._fs.full_parameters()
        names = {id(p): n for u in self._fs.units for n, p in zip(u.names, u.params, strict=True)}
        return [(n, full[names[id(t)]] if id(t) in names else t) for n, t in named]

    def full_state(self, optimizer: OptimizerState,
                   timeout: timedelta) -> dict[nn.Parameter, dict[str, Any]]:
        """The optimizer's state as one process holds it, keyed by the whole parameters (each tensor of a
        shard's shape all-gathered in the group). Every replica of the group must call it."""
        self._require_shards()
        comm = self._groups_ready(timeout)
        out: dict[nn.Parameter, dict[str, Any]] = {}
        for p in self._params:
            one = ShardLayout([p.shape], self.factor)
            shard = self._shards[id(p)]  # every trainable parameter is a unit's
            mine = optimizer.state.get(shard, {})
            out[p] = {key: _gather_rows(comm, one, mine[key].to(wire_device(comm.backend, p.device)),
                                        p.shape, self.rank, timeout)
                      if per_element(key, mine[key], shard.shape) else mine[key] for key in sorted(mine)}
        return out

    def shard_restored(self, params: Sequence[tuple[str, nn.Parameter]],
                       state: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """A checkpoint's per-parameter optimizer state (whole tensors, by name) cut to this rank's rows."""
        return restored_rows(params, state, self.factor, self.rank)

    def held_bytes(self, optimizer: torch.optim.Optimizer | None) -> int:
        """Bytes of parameters (shards, and any unit left gathered), gradients and optimizer state here."""
        if self._fs is None:
            grads = [p.grad for p in self._params]
            total = storage_bytes([*self._params, *grads])
        else:
            held = self._fs.held_bytes()
            total = sum(held.values())
        if optimizer is not None:
            total += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor))
        return total


def _gather_rows(comm: Communicator, one: ShardLayout, value: torch.Tensor, shape: torch.Size, rank: int,
                 timeout: timedelta) -> torch.Tensor:
    """A parameter's whole tensor from each rank's rows of it (``value``: this rank's)."""
    segment = torch.zeros(one.segment_numel, dtype=value.dtype, device=value.device)
    segment[:value.numel()].copy_(value.reshape(-1))
    full = torch.empty(one.numel, dtype=value.dtype, device=value.device)
    comm.all_gather_into_tensor(full, segment, timeout=timeout)
    whole = torch.empty(shape, dtype=value.dtype, device=value.device)
    one.unpack(full, [whole])
    return whole
