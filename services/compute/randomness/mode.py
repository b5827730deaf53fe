"""Keyed forwards: every random draw of a model's forward a function of where and for whom it is drawn.

[Note: randomness that survives the cut] A forward run inside :meth:`ModelRandomness.forward`
draws every random number from :mod:`~services.compute.randomness.keys`, keyed by (job seed,
step, the qualified name of the innermost module running, that module's draw counter in this
forward, the global index of the sample, the element within the sample). None of these depends
on the plan: a replica or a microbatch holds some of the samples, a pipeline stage runs some of
the modules, and each draws exactly the values one process training the whole batch draws for
them. Nothing is stored either, so a recovered or resumed run draws them again.

How. A ``TorchDispatchMode`` sees every ATen op of the forward and answers the random ones
(``torch.Tag.nondeterministic_seeded``) from keyed uniforms (``services/compute/randomness/ops.py``);
global module forward hooks keep the stack of modules running, named by
``services/compute/randomness/names.py``. A draw is *per sample* when its tensor's dim 0 is the
forward's sample count ``n`` (row ``r`` belongs to sample ``samples[r]``; what dropout on
activations, noise like the input and attention dropout with the batch first draw), or, inside
``nn.MultiheadAttention``, ``n * num_heads`` (its attention weights flatten the batch with the
heads, sample-major). Any other draw is keyed without samples: every microbatch draws the same
values, which equal one process's when the tensor's shape does not depend on the batch (a
``torch.rand(d)`` is one draw per forward, the same in every plan), but not when the batch sits on
another dim (sequence-first layouts: put the batch first). In a one-sample microbatch a draw whose
dim 0 is 1 counts as per sample: a per-batch draw shaped ``(1, ...)`` then differs from one
process.

Modules are counted, not draws overall: a module called twice in a forward (a shared dropout)
continues its counter, so the keys do not depend on what other modules drew. A module shared by
cells placed on different stages counts its calls per stage and then differs from one process.

Activation checkpointing inside the model (``torch.utils.checkpoint``) recomputes forwards during
backward, outside the keyed forward: their draws would not be the keyed ones, so do not combine
it with random layers. cellmesh's own recompute (``plan.recompute``, ``services/compute/recompute.py``)
does replay them: :func:`replaying`, called as a cell's forward starts, notes the keyed forward's
module stack and counters, and the recomputation of that cell draws inside a keyed forward started
from them again, so it draws the keys, and so the values, the forward drew.

Cost. The mode adds a Python call to every op of the forward (see docs/benchmarks.md); a model
that draws nothing runs without it: :class:`ModelRandomness` runs its first training-mode
forward keyed and drops the mode if that forward drew nothing and no module of the model is
one of torch's random layers (dropout, RReLU, attention or recurrent layers with dropout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from services.compute.randomness import ops
from services.compute.randomness.keys import DrawKey, sample_hashes
from services.compute.randomness.names import module_names

__all__ = ["Drawn", "ModelRandomness", "check_draws", "replaying", "reproducible"]



@dataclass(frozen=True)
class Drawn:
    """One draw of a forward, as :meth:`ModelRandomness.forward` notes it when asked."""

    module: str
    counter: int
    shape: tuple[int, ...]  # () for an op keyed by torch's generators (no keyed implementation)
    per_sample: bool


@dataclass
class _Forward:
    """One keyed forward's state: the key's fixed parts, the module stack and the counters."""

    seed: int
    step: int
    samples: torch.Tensor  # int64, one global index per sample of the forward
    names: dict[int, str]
    rows: torch.Tensor | None = None  # the samples' hashes, made on the first per-sample draw
    record: list[Drawn] | None = None  # where each draw is noted, if asked
    stack: list[tuple[str, nn.Module | None]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    draws: int = 0

    def draw(self, shape: torch.Size) -> ops.Draw:
        """The next draw of the innermost module, per sample if ``shape`` is batch-shaped."""
        name, module = self.stack[-1] if self.stack else ("", None)
        counter = self.counters.get(name, 0)
        self.counters[name] = counter + 1
        self.draws += 1
        batched = _per_sample(shape, int(self.samples.numel()), module)
        if batched and self.rows is None:
            self.rows = sample_hashes(self.samples)
        key = DrawKey(self.seed, self.step, name, counter, batched=batched)
        if self.record is not None:
            self.record.append(Drawn(name, counter, tuple(shape), batched))
        return ops.Draw(key, self.rows if batched else None)


def _per_sample(shape: torch.Size, n: int, module: nn.Module | None) -> bool:
    """Whether a draw of ``shape`` holds rows per sample (see [Note: randomness that survives the cut])."""
    if not shape or n == 0:
        return False
    if shape[0] == n:
        return True
    return isinstance(module, nn.MultiheadAttention) and shape[0] == n * module.num_heads


class _KeyedMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch stub
    """Answers the forward's random ops from keys; every other op runs as it is."""

    def __init__(self, forward: _Forward) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch stub
        self._forward = forward

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._dynamo.disable`` around :meth:`__torch_dispatch__`: it would import torch._dynamo
        on the first op (4 s on a loaded 2-core machine, in every worker) and wrap every op; nothing
        here runs under ``torch.compile``."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not ops.draws(func, args, kwargs):
            return func(*args, **kwargs)
        prepared = ops.prepare(func, args, kwargs)
        if prepared is None:  # an op without a keyed implementation: torch's, seeded from the key
            draw = self._forward.draw(torch.Size())
            with ops.seeded(draw.key, args):
                return func(*args, **kwargs)
        bound, shape = prepared
        return ops.run(func, bound, self._forward.draw(shape))


# -- the module stack: global forward hooks, live while any keyed forward runs -----------

_local = threading.local()  # .forward: the thread's keyed forward, if one runs
_hooks_lock = threading.Lock()
_hooks: list[Any] = []  # the two global hook handles while _users > 0
_users = 0


def _current() -> _Forward | None:
    forward: _Forward | None = getattr(_local, "forward", None)
    return forward


def _push(module: nn.Module, args: Any) -> None:
    forward = _current()
    if forward is not None:
        name = forward.names.get(id(module))
        if name is not None:
            forward.stack.append((name, module))
        else:  # not the model's (made on the fly): its draws count as its caller's
            forward.stack.append(forward.stack[-1] if forward.stack else ("", None))


def _pop(module: nn.Module, args: Any, output: Any) -> None:
    forward = _current()
    if forward is not None and forward.stack:
        forward.stack.pop()


@contextmanager
def _stack_hooks() -> Iterator[None]:
    """The global module hooks installed while inside (counted: nested and concurrent users share them)."""
    global _users
    with _hooks_lock:
        if _users == 0:
            _hooks[:] = [nn.modules.module.register_module_forward_pre_hook(_push),
                         nn.modules.module.register_module_forward_hook(_pop, always_call=True)]
        _users += 1
    try:
        yield
    finally:
        with _hooks_lock:
            _users -= 1
            if _users == 0:
                for handle in _hooks:
                    handle.remove()
                _hooks.clear()


class ModelRandomness:
    """Keyed forwards of one model (a stage's module, the reference's cells, a user's model).

    Args:
        root: The module the forwards run; its modules are named by
            :func:`~services.compute.randomness.names.module_names`.
        seed: The job's seed.
    """

    def __init__(self, root: nn.Module, seed: int) -> None:
        self.seed = seed
        self._root = root
        self._names = module_names(root)
        self._layers = any(_random_layer(m) for m in root.modules())
        self.keyed: bool | None = True if self._layers else None  # None: decided by the first forward

    @contextmanager
    def forward(self, step: int, samples: Sequence[int] | torch.Tensor,
                record: list[Drawn] | None = None) -> Iterator[None]:
        """Inside, the thread's forward draws keyed by ``step`` and ``samples`` (the global index of
        each sample of the forward, in row order); each draw is noted in ``record``, if given."""
        if self.keyed is False and record is None:
            yield
            return
        index = torch.as_tensor(samples, dtype=torch.int64).reshape(-1)
        forward = _Forward(self.seed, step, index, self._names, record=record)
        previous, _local.forward = _current(), forward
        try:
            with _stack_hooks(), _KeyedMode(forward):
                yield
        finally:
            _local.forward = previous
        if self.keyed is None and self._root.training:  # an evaluation forward draws nothing anyway
            self.keyed = forward.draws > 0


def replaying() -> contextlib.AbstractContextManager[None]:
    """Called as a recomputed cell's forward starts: a context in which its recomputation draws again
    what that forward draws (a no-op when no keyed forward runs on this thread).

    The context runs a keyed forward of the same seed, step and samples whose module stack and
    counters are those of this moment, so the recomputed modules count their draws from where the
    forward's counted them (see [Note: randomness that survives the cut]). It may be entered on
    another thread (the backward's): it sets that thread's forward, and puts it back on the way out.
    """
    forward = _current()
    if forward is None:
        return contextlib.nullcontext()
    start = dataclasses.replace(forward, record=None, stack=list(forward.stack),
                                counters=dict(forward.counters), draws=0)
    return _again(start)


@contextmanager
def _again(start: _Forward) -> Iterator[None]:
    forward = dataclasses.replace(start, stack=list(start.stack), counters=dict(start.counters))
    previous, _local.forward = _current(), forward
    try:
        with _stack_hooks(), _KeyedMode(forward):
            yield
    finally:
        _local.forward = previous


def _random_layer(module: nn.Module) -> bool:
    """A torch layer that draws in training (dropout, RReLU, attention or recurrent layers with dropout)."""
    if isinstance(module, nn.RReLU):
        return True
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, nn.MultiheadAttention | nn.RNNBase):
        return float(module.dropout) > 0
    return False


@contextmanager
def reproducible(model: nn.Module | Sequence[nn.Module], *, seed: int, step: int,
                 samples: Sequence[int] | torch.Tensor) -> Iterator[None]:
    """Draw a forward's random numbers as cellmesh does: the same dropout masks, noise and values.

    Run your own training loop's forward (and loss) inside, with the job's seed
    (``data.seed``), the step (0-based) and the global index of each sample of the batch, in
    the batch's order; ``model`` is the model the job's factory returns (a module, or a list
    of modules as the factory returns it)::

        batch = sampler.indices(step)
        with cellmesh.reproducible(model, seed=job.config.data.seed, step=step, samples=batch):
            loss = loss_fn(model(inputs), targets)
        loss.backward()

    The values depend only on (seed, step, module, call, sample, element), so any split of
    the batch draws the same (see [Note: randomness that survives the cut] in
    ``services/compute/randomness/mode.py``).
    """
    root = model if isinstance(model, nn.Module) else nn.Sequential(*model)
    with ModelRandomness(root, seed).forward(step, samples):
        yield


def check_draws(small: Sequence[Drawn], large: Sequence[Drawn], sizes: tuple[int, int]) -> str | None:
    """Why the draws of two forwards of ``sizes`` samples would differ between plans, or None.

    A draw is plan-independent if it is per sample at both sizes, or keyed without samples and of
    one shape at both (see [Note: randomness that survives the cut]); one whose shape follows the
    batch elsewhere than along dim 0 is not: each microbatch size would draw other values.
    Forwards that draw differently (by count or module) are not compared.
    """
    if [(d.module, d.counter) for d in small] != [(d.module, d.counter) for d in large]:
        return None
    for a, b in zip(small, large, strict=True):
        if (a.per_sample and b.per_sample) or a.shape == b.shape:
            continue
        where = f"module {a.module!r}" if a.module else "the model's root module"
        return (f"{where} draws random tensors of shape {list(a.shape)} for {sizes[0]} samples and "
                f"{list(b.shape)} for {sizes[1]}: its size follows the batch but not along dim 0, and "
                "cellmesh keys random values per sample along dim 0 only, so every plan would draw other "
                "values than one process does; put the batch first (batch_first=True)")
    return None
