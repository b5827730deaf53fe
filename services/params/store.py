"""The memory of one parameter shard: parameter values, gradient accumulators and the optimizer.

The optimizer is any ``torch.optim`` class named by an
:class:`~services.protocol.OptimizerSpec` (looked up in ``torch.optim`` only, never
imported from elsewhere); its state lives here, next to the parameters it updates, with the
spec's learning-rate scheduler (``services/params/scheduling.py``), which the shard advances
to each round's training step and steps once the round is applied.

[Note: pull replies view the parameters]
A pull reply's frames are zero-copy views of the parameters' memory, and ZeroMQ sends them
from its I/O thread after the handler returned. Changing a parameter in place while such a
reply is still queued would send a torn mix of two versions. So each parameter's memory is
a numpy array that wire views reach through a torch storage of their own
(``torch.from_numpy`` holds a reference to the array until that storage dies, i.e. until
pyzmq released the reply's last frame). Before an update, :meth:`ParamStore.step` checks
each parameter's reference count: if a reply may still read it, that parameter first moves
to fresh memory (copy-on-write) and the old memory goes with the reply's last frame. In
the usual loop (pull, compute, push) no reply is in flight at update time, and updates
are in place. (Frames under ``zmq.COPY_THRESHOLD`` are copied by pyzmq and hold nothing.)
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from comm.wire import DTYPES
from services.params import scheduling
from services.params.clipping import squared_norm
from services.params.sharding import check_pieces, join_pieces, split_pieces
from services.protocol import OptimizerSpec, ParamInfo

__all__ = ["Grads", "NotOwnedError", "ParamStore", "build_optimizer"]

log = logging.getLogger(__name__)

# element ranges of each parameter paired with the received pieces that fill them
Grads = dict[str, list[tuple[slice, torch.Tensor]]]

_NEEDS_CLOSURE_OR_SPARSE = {"LBFGS", "SparseAdam"}


class NotOwnedError(ValueError):
    """Tensors named parameters this store does not hold (``names`` lists them)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"not held here: {names}")
        self.names = names


def build_optimizer(spec: OptimizerSpec, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer ``spec`` names, over ``params``.

    Raises:
        ValueError: the name is not an optimizer class of ``torch.optim`` (or needs a closure
            or sparse gradients), or the class refused ``spec.kwargs``.
    """
    cls = None if spec.name.startswith("_") else getattr(torch.optim, spec.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ValueError(f"unknown optimizer {spec.name!r}: name a torch.optim class, e.g. SGD, Adam, AdamW")
    if spec.name in _NEEDS_CLOSURE_OR_SPARSE:
        raise ValueError(f"optimizer {spec.name} needs a closure or sparse gradients; a shard cannot run it")
    factory: Callable[..., torch.optim.Optimizer] = cls
    try:
        return factory(params, **spec.kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{spec.name}(**{spec.kwargs}): {exc}") from None


class _Slot:
    """One parameter: its memory (see [Note: pull replies view the parameters]), value and gradient."""

    def __init__(self, info: ParamInfo) -> None:
        self.info = info
        self.dtype = DTYPES[info.dtype]
        self.numel = math.prod(info.shape)
        self.memory = np.empty(self.numel * self.dtype.itemsize, dtype=np.uint8)
        self.value = self._tensor(self.memory).view(info.shape)  # the optimizer's parameter
        self.grad = torch.zeros_like(self.value)  # the accumulator
        self._idle_refs = self._refs()

    def _tensor(self, memory: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(memory).view(self.dtype)

    def _refs(self) -> int:
        return sys.getrefcount(self.memory)

    def wire(self) -> torch.Tensor:
        """A flat view of the value through a storage of its own, alive as long as its frames."""
        return self._tensor(self.memory)

    def in_flight(self) -> bool:
        return self._refs() > self._idle_refs

    def move(self) -> None:
        """Copy the value to fresh memory and keep the same tensor object (the optimizer's key)."""
        memory = np.empty_like(self.memory)
        fresh = self._tensor(memory).view(self.info.shape)
        fresh.copy_(self.value)
        # the value now shares fresh's storage, which holds `memory`
        self.value.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
        self.memory = memory
        del fresh, memory  # so the idle count below is the same as __init__'s
        self._idle_refs = self._refs()


class ParamStore:
    """Parameters, one gradient accumulator per parameter, and the optimizer that owns their state.

    Not thread-safe: the shard calls it from its host thread only.

    Args:
        infos: the parameters (name, dtype, shape), in order.
        values: their initial values as pieces (see :mod:`services.params.sharding`).
        optimizer: the optimizer to build over them.

    Raises:
        ValueError: a parameter repeats, is not floating point, or its pieces are missing or
            malformed; extra pieces; or the optimizer cannot be built.
    """

    def __init__(self, infos: list[ParamInfo], values: Mapping[str, torch.Tensor],
                 optimizer: OptimizerSpec) -> None:
        names = [p.name for p in infos]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
        bad = [f"{p.name} ({p.dtype})" for p in infos if not DTYPES[p.dtype].is_floating_point]
        if bad:
            raise ValueError(f"only floating point parameters are trained: {bad}")
        pieces = join_pieces(values)
        extra = sorted(set(pieces) - set(names))
        if extra:
            raise ValueError(f"values sent for parameters not described in params: {extra}")
        # every value must have arrived before any memory is allocated for it
        checked = {p.name: check_pieces(p.name, pieces.get(p.name, {}), math.prod(p.shape), DTYPES[p.dtype])
                   for p in infos}
        self._slots = {p.name: _Slot(p) for p in infos}
        for name, slot in self._slots.items():
            flat = slot.value.view(-1)
            for s, piece in checked[name]:
                flat[s].copy_(piece)
        self.optimizer = build_optimizer(optimizer, [s.value for s in self._slots.values()])
        self.scheduler = (scheduling.build_scheduler(optimizer.scheduler, self.optimizer)
                          if optimizer.scheduler is not None else None)
        self.moves = 0  # parameters moved by copy-on-write (see the Note)
        self._counts: dict[str, int] = {}  # contributions to each parameter's sum this round
        self._stepped: set[str] = set()  # parameters already stepped this round

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def infos(self) -> list[ParamInfo]:
        return [s.info for s in self._slots.values()]

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Each parameter by name, the tensor the optimizer keys its state by (in order)."""
        return [(name, slot.value) for name, slot in self._slots.items()]

    def parse(self, tensors: Mapping[str, torch.Tensor]) -> Grads:
        """Check received gradient pieces against the parameters; nothing changes yet.

        Raises:
            NotOwnedError: pieces name parameters not held here.
            ValueError: a piece name is malformed, or a parameter's pieces are incomplete or
                of the wrong dtype or length.
        """
        pieces = join_pieces(tensors)
        unknown = sorted(set(pieces) - set(self._slots))
        if unknown:
            raise NotOwnedError(unknown)
        return {name: check_pieces(name, p, self._slots[name].numel, self._slots[name].dtype)
                for name, p in pieces.items()}

    @property
    def mid_round(self) -> bool:
        """Some parameters were already stepped this round, others not yet."""
        return bool(self._stepped)

    def accumulate(self, grads: Grads, complete_at: int) -> list[str]:
        """Add ``grads`` to this round's sums; return the parameters that now have ``complete_at`` of them.

        The first contribution to a parameter in a round is copied, later ones are added.
        """
        complete = []
        for name, parts in grads.items():
            flat = self._slots[name].grad.view(-1)
            count = self._counts.get(name, 0)
            for s, piece in parts:
                if count == 0:
                    flat[s].copy_(piece)
                else:
                    flat[s].add_(piece)
            self._counts[name] = count + 1
            if count + 1 == complete_at:
                complete.append(name)
        return complete

    def step(self, names: Iterable[str], divisor: int) -> None:
        """One optimizer step over ``names`` only, each with its round sum divided by ``divisor``.

        The other parameters get ``grad = None`` for the call, so the optimizer skips them
        (as torch does for unused parameters). Stepping a round's parameters in several
        calls equals one call over all of them for every per-parameter optimizer of
        ``torch.optim`` (their state is per parameter). A parameter is stepped at most once
        per round.
        """
        now = {n for n in names if n not in self._stepped}
        if not now:
            return
        for name, slot in self._slots.items():
            if name not in now:
                slot.value.grad = None
                continue
            if divisor != 1:
                slot.grad.div_(divisor)
            slot.value.grad = slot.grad
            if slot.in_flight():
                slot.move()
                self.moves += 1
                log.debug("parameter %s moved: a pull reply still reads its memory", name)
        self.optimizer.step()
        self._stepped |= now

    def finish_round(self, divisor: int) -> None:
        """Step every parameter with a contribution not stepped yet; start a new round.

        A parameter nobody sent a gradient for in the round is not stepped at all.
        """
        self.step(list(self._counts), divisor)
        self._counts.clear()
        self._stepped.clear()

    def advance(self, train_step: int) -> None:
        """Bring the scheduler (if any) to ``train_step`` before the round's first update.

        Raises:
            ValueError: It is past that step, or cannot step (see ``scheduling.advance``).
        """
        if self.scheduler is not None:
            scheduling.advance(self.scheduler, train_step)

    def step_scheduler(self) -> None:
        """One scheduler step (if any), once a round is applied.

        Raises:
            ValueError: The scheduler cannot step (OneCycleLR past its ``total_steps``).
        """
        if self.scheduler is not None:
            scheduling.step(self.scheduler)

    def average(self, divisor: int) -> float:
        """Divide this round's sums by ``divisor`` (held rounds: the replicas); their squared L2 norm."""
        grads = [self._slots[name].grad for name in self._counts]
        if divisor != 1 and grads:
            torch._foreach_div_(grads, divisor)
        return squared_norm(grads)

    def scale(self, factor: float) -> None:
        """Multiply this round's sums by ``factor`` (a held round's clipping coefficient)."""
        grads = [self._slots[name].grad for name in self._counts]
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)

    def pieces(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        """The current values of ``names`` as wire pieces (views; see the Note)."""
        out: list[tuple[str, torch.Tensor]] = []
        for name in names:
            out.extend(split_pieces(name, self._slots[name].wire()))
        return out
