"""Deferred weight gradients of a stage's ``nn.Linear`` layers: the backward split into ``I`` and ``W``.

[Note: splitting a backward]
A zero-bubble schedule (``zb-h1``) runs each microbatch's backward in two halves: ``I``, the
gradients of the stage's inputs (what ``SEND_B`` sends, on the pipeline's critical path), and
later ``W``, the weight gradients (which nothing downstream waits for: they fill bubbles).
For a linear layer ``y = x W^T + b`` with output gradient ``g`` the halves are
``dx = g W`` and ``dW = g^T x``, ``db = sum(g)``: ``W`` needs only ``x`` and ``g``.

While a :class:`WeightGradStore` is :meth:`~WeightGradStore.deferring`, each eligible linear
layer of the module (see :func:`eligible_layers`) runs its forward through an autograd
function whose backward returns ``dx`` only and queues ``(x, g)`` under the microbatch that ran
the forward (:attr:`WeightGradStore.microbatch`). So ``torch.autograd.backward`` on the stage's
outputs is ``I``: every input gradient and every gradient of the parameters outside such layers
(LayerNorm, embeddings, attention's fused projections...), as plain autograd computes them.
:meth:`~WeightGradStore.flush` is ``W`` for the microbatches it is given: per layer, ONE
matrix product over their queued rows concatenated (``dW = [g_1; g_2; ...]^T [x_1; x_2; ...]``),
so a run of ``W`` s streams each weight gradient once instead of once per microbatch (the
per-microbatch product of a small microbatch is bound by that stream, not by its arithmetic).
The sums are the same as plain autograd's, in another order: float64 agrees to rounding.

Accumulation. The step's final flush (and one that finds no ``.grad`` yet) hands its gradients
to autograd on the parameters themselves (``torch.autograd.backward(params, grads)``): they
accumulate into ``.grad`` as a backward's do and every post-accumulate-grad hook fires once (the
data-parallel buckets of ``services/params/grad_sync.py``). What the gradient path needs is that
a parameter's last contribution comes while it is armed and no earlier one does: the executor
arms before the last ``I`` (the last contribution of every other parameter) and flushes every
queued microbatch at the first ``W`` after it (the last contribution of the deferred ones).
Earlier flushes add in place (``addmm_`` into ``.grad``: no weight-sized temporary, one pass over
the gradient), which is what the disarmed hooks would have left.

[Note: handing a flush's gradients over]
``torch.autograd.backward(params, grads)`` copies each gradient it hands to a parameter without
``.grad``: its caller still holds it, and autograd takes a gradient as it is only when nothing else
does. A flush instead hands its products over from inside a backward (:class:`_HandOver`: a node of
no elements on every parameter, whose backward returns the products, held by nothing else), so each
becomes ``.grad`` as it is, with the hooks firing as before. And a step that starts from no gradients
makes fresh weight-sized tensors, whose memory the allocator takes from the system page by page (the
step before freed it, and it was given back): so the store keeps each weight gradient it handed over,
and the next step's first flush writes its product into it (``mm(..., out=)``) once the step has
dropped it, if nothing else holds it or its memory (a name, a ``.grad``, a view: else a new tensor).
What the store so keeps is the deferred weights' gradient bytes, which the planner counts as held for
the whole step anyway (``NodeProfile.grad_bytes``): from the step's ``zero_grad`` to its first flush
they are held by the store instead of ``.grad``.
Measured in one process, one thread, 8 x Linear(1024)+GELU, 8 microbatches of 8, the step's flush of
64 rows through autograd, under load (load average 4.7-5.4): 89.3 ms and 16 352 page faults before,
30.9 ms and none now (4 layers: 33.9 and 12.3 ms).

GPipe runs every backward after every forward, so it holds all its microbatches' activations at
its peak anyway; its ``B`` s defer too (:func:`defers`), and its last ``B`` ends with one flush of
all of them. 1F1B does not: it would hold every microbatch's layer inputs and output gradients
until the end, where it holds at most ``p - s`` microbatches' activations.

[Note: a backward's weight gradients in place]
A list that does not defer (1F1B, interleaved 1F1B: any ``B`` s that are not GPipe's) still runs
some of its ``B`` s split: ``I``, and the ``W`` of that microbatch added into ``.grad`` in place
(:func:`in_place_backwards` says which). The gain is the accumulation: plain autograd makes
each weight gradient as a new tensor and ``AccumulateGrad`` adds it into ``.grad`` in a second
pass, where ``addmm_`` into ``.grad`` does both in one (``bench/weight_grads.py``: per-B
``W`` in place, measured against plain ``B`` s). So only a ``B`` that finds ``.grad`` there gains, and
it is the ``B`` s in between that split:

* not the first ``B`` of a step that starts from no gradients (``zero_grad``): autograd would hand
  its new tensor over as ``.grad`` without an addition, as the flush would (through autograd);
* not the last ``B``: it is the parameters' last contribution, and a flush through autograd (the
  hooks must fire, armed) computes what a plain ``B`` computes. Left plain, it fires every hook once
  while armed, so the data-parallel path needs nothing from the store;
* a microbatch's ``W`` adds in place, firing no hook, while the path is disarmed (what a disarmed
  hook would have left; one that finds no ``.grad`` goes through autograd, its hook disarmed).

Held W's. Each such ``W`` streams every deferred weight gradient (read and write ``.grad``) for a few
rows: at 8 rows of 1024 features the pass over the 4 MiB gradient costs as much as the product.
So the executor holds the ``(x, g)`` of successive in-between ``B`` s and computes them in one flush
(one product per layer over their rows), once they hold more than 1/:data:`HOLD_SHARE` of the
deferred layers' weight bytes, and before the list's last ``B`` (while the hooks are still disarmed).
A replica alone (its gradient path without hooks) holds every ``B`` 's ``W`` so, and a zero-bubble
list's ``W`` s too (each run computes what is queued once past the share, the last one the rest).
A stage so holds at most that many bytes beyond 1F1B's activations (0.5 MiB a stage of 4 x
Linear(1024) at 8 rows: every in-between ``B`` of 8 microbatches), and a microbatch whose rows are
larger than that is flushed at once, as before. Measured on one stage of 4 x Linear(1024)+GELU, 8
microbatches of 8 in 1F1B order, one thread: 61.8 ms of CPU a step with each ``W`` at once, 56.2
holding pairs, 53.6 holding every in-between one (GPipe's single flush: 48.8; plain autograd: 93.5).

Both parts of a deferred weight also used outside its layer (see below) then come in ``B`` s that
are not the last one, while the hooks are disarmed: the sum is right and no bucket waits for it,
so such a list does not :meth:`~WeightGradStore.check`. A single ``B`` (or two, from no gradients)
leaves nothing to split, and autocast falls back as below.

A layer is deferred only if the module holds its parameters there alone: a weight tied to
another module of the stage gets its gradient from plain autograd. A deferred weight that is
also used outside its layer's forward (a functional use inside another leaf module) would get
its gradient in two parts, which a data-parallel bucket may not wait for; the store notices the
second part and :meth:`~WeightGradStore.check` raises, naming the parameter. Mixed precision
(autocast) falls back to plain autograd: the store does not defer a call under autocast.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from services.protocol import Action

__all__ = ["HOLD_SHARE", "WeightGradStore", "defers", "eligible_layers", "in_place_backwards", "weight_runs"]

_DTYPES = (torch.float32, torch.float64)
HOLD_SHARE = 8  # held in-between W's flush past 1/HOLD_SHARE of the weight bytes ([Note: ... in place])


def defers(actions: Sequence[Action]) -> bool:
    """Whether a stage running ``actions`` defers its linear layers' weight gradients (in fp32/fp64).

    A split backward (``I`` and ``W``) does; so does a list of at least two ``B`` s that runs every
    ``B`` after every ``F`` (GPipe's shape): it computes the weight gradients of all its microbatches
    after its last ``B``, one product per layer, holding each microbatch's layer inputs and output
    gradients until then (the planner counts them: ``NodeProfile.deferred_bytes``). A list that
    interleaves them (1F1B) does not: it would hold them for more microbatches than its activations.
    """
    kinds = [a.kind for a in actions]
    if "I" in kinds:
        return True
    if kinds.count("B") < 2:
        return False
    return max(k for k, kind in enumerate(kinds) if kind == "F") < kinds.index("B")


def in_place_backwards(actions: Sequence[Action], zero_grad: bool) -> set[int]:
    """The microbatches whose ``B`` computes its weight gradients in place, right after its input
    gradients ([Note: a backward's weight gradients in place]): in a list that does not :func:`defers`,
    every ``B`` but the last one and, when the step starts from no gradients (``zero_grad``), the first.
    """
    if defers(actions):
        return set()
    backwards = [a.microbatch for a in actions if a.kind == "B"]
    return set(backwards[1 if zero_grad else 0:-1])


def weight_runs(actions: Sequence[Action]) -> dict[int, list[int]]:
    """The position of the first ``W`` of each run of consecutive ``W`` s in ``actions`` -> the run's
    positions (the executor computes a run with one flush)."""
    runs: dict[int, list[int]] = {}
    for k, a in enumerate(actions):
        if a.kind != "W":
            continue
        if k > 0 and actions[k - 1].kind == "W":
            runs[next(reversed(runs))].append(k)
        else:
            runs[k] = [k]
    return runs


def eligible_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``module`` whose weight gradients a store defers, in module order.

    A layer is eligible when it is an ``nn.Linear`` running ``nn.Linear.forward`` (a subclass
    that overrides it is not), its weight is a trainable float32 or float64 ``nn.Parameter``,
    its bias is None or one alike, and neither is held by any other module of ``module``
    (a tied weight: plain autograd sums its uses).
    """
    holders: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        holders[id(p)] = holders.get(id(p), 0) + 1
    layers = []
    for name, m in module.named_modules():
        if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:
            continue
        params = [m.weight] if m.bias is None else [m.weight, m.bias]
        if all(type(p) is nn.Parameter and p.requires_grad and p.dtype in _DTYPES
               and p.dtype == m.weight.dtype and holders[id(p)] == 1 for p in params):
            layers.append((name, m))
    return layers


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient only and queues ``(x, g)`` in the store.

    The weight and bias come detached: autograd must not reach their accumulators in ``I`` at all
    (an accumulator reached with no gradient still runs the parameter's hooks, and a data-parallel
    hook would take the parameter for done). ``anchor``, a leaf of no elements that requires grad,
    makes the output require grad when ``x`` does not (a first layer), so the backward runs.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                anchor: torch.Tensor, store: WeightGradStore, layer: int, microbatch: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.layer, ctx.microbatch = store, layer, microbatch
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.store._queue(ctx.layer, ctx.microbatch, x, grad)
        return grad_x, None, None, None, None, None, None


class _HandOver(torch.autograd.Function):
    """Hands gradients computed outside autograd to parameters through autograd: the output, of no
    elements, depends on every parameter, and its backward returns the gradients it holds, taken out
    of ``box`` so that nothing else refers to them ([Note: handing a flush's gradients over])."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, box: list[torch.Tensor],
                *params: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads, ctx.box = ctx.box, None
        out: list[torch.Tensor | None] = [None, None]
        while grads:
            out.append(grads.pop(0))
        return tuple(out)


def _unshared(t: torch.Tensor) -> bool:
    """Whether nothing but the caller's one reference holds ``t`` or its memory: no other Python name, no
    ``.grad`` or saved tensor (its implementation's count), no view or detached alias (its storage's)."""
    storage = t.untyped_storage()  # one reference of its own to the storage
    try:
        implementations = t._use_count()  # type: ignore[attr-defined]  # torch's stub lacks it
        storages = torch._C._storage_Use_Count(storage._cdata)
    except (AttributeError, RuntimeError):  # a torch without these counters: never reuse
        return False
    return (sys.getrefcount(t) <= 3 and implementations == 1  # the caller's name, ours, getrefcount's
            and storages == 2)


def _hand_over(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Accumulate ``grads`` into ``params``' ``.grad`` as a backward would (each parameter's hooks fire
    once), emptying ``grads``: a parameter without ``.grad`` takes its gradient as it is, no copy."""
    anchor = torch.empty(0, dtype=params[0].dtype, device=params[0].device)
    box = list(grads)
    grads.clear()
    out: torch.Tensor = _HandOver.apply(anchor, box, *params)  # type: ignore[no-untyped-call]  # torch stub
    torch.autograd.backward([out], [torch.empty_like(out)])


class WeightGradStore:
    """Defers the weight gradients of ``module``'s eligible linear layers (see the module docstring).

    Args:
        module: The stage's module; its eligible layers are found once, here.

    Attributes:
        microbatch: The microbatch the forwards run now belong to (set by the executor before
            each ``F``); None: forwards are not deferred.
    """

    def __init__(self, module: nn.Module) -> None:
        self._layers = eligible_layers(module)
        self.microbatch: int | None = None
        # per layer: microbatch -> the (x, g) of each call of the layer in that microbatch's forward
        self._queues: list[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in self._layers]
        self._flushing = False
        self._deferred: set[int] = set()  # ids of parameters the step deferred
        self._outside: dict[int, str] = {}  # id -> name of deferred parameters autograd accumulated into
        self._anchor = torch.empty(0, requires_grad=True)  # see _DeferredLinear
        # per layer: the weight gradient a flush handed over, for the next step's first flush to write into
        self._spares: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, module: nn.Module) -> WeightGradStore:
        """The store of a stage's ``module``, made at its first step that defers (kept while it lives)."""
        store = _STORES.get(module)
        if store is None:
            store = _STORES[module] = cls(module)
        return store

    @property
    def layers(self) -> list[str]:
        """The deferred layers' names in the module."""
        return [name for name, _ in self._layers]

    def pending(self) -> list[int]:
        """The microbatches with queued weight gradients, in order."""
        return sorted({mb for q in self._queues for mb in q})

    def repeat(self, microbatch: int, copies: Iterable[int]) -> None:
        """Queue ``microbatch``'s rows again under each microbatch of ``copies``, so that one flush is a
        product over that many times its rows (the profiler times held ``W`` s' flushes so)."""
        for queue in self._queues:
            rows = list(queue.get(microbatch, ()))
            for mb in copies:
                queue.setdefault(mb, []).extend(rows)

    def held_bytes(self) -> int:
        """The bytes of the queued layer inputs and output gradients (what waits for a flush)."""
        return sum(x.nbytes + g.nbytes for q in self._queues for rows in q.values() for x, g in rows)

    def weight_bytes(self) -> int:
        """The bytes of the deferred layers' weights (what one flush streams, whatever its rows)."""
        return sum(layer.weight.nbytes for _, layer in self._layers)

    @contextmanager
    def deferring(self) -> Iterator[WeightGradStore]:
        """Inside, the eligible layers defer their weight gradients; on the way out their forwards are
        restored and whatever is still queued is dropped (a step that failed midway)."""
        handles: list[RemovableHandle] = []
        patched: list[tuple[nn.Linear, Any]] = []  # (layer, its own forward attribute if it had one)
        try:
            for index, (name, layer) in enumerate(self._layers):
                patched.append((layer, layer.__dict__.get("forward")))
                layer.forward = types.MethodType(self._forward(index), layer)  # type: ignore[method-assign]
                for pname, p in layer.named_parameters():
                    handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._watch(f"{name}.{pname}")))
            yield self
        finally:
            for layer, own in patched:
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own  # type: ignore[method-assign]  # put back as it was
            for handle in handles:
                handle.remove()
            self.clear()

    def clear(self) -> None:
        """Drop every queued microbatch and forget the step."""
        self._queues = [{} for _ in self._layers]
        self.microbatch = None
        self._deferred.clear()
        self._outside.clear()

    def flush(self, microbatches: Iterable[int] | None = None, *, final: bool = False,
              check: bool = True) -> None:
        """``W`` of ``microbatches`` (None: of every queued one): per layer one product over their rows,
        accumulated into the parameters' ``.grad``.

        ``final`` (the parameters' last contribution of the step) or a parameter without ``.grad``
        yet: the gradient goes through autograd, and the parameter's hooks fire once. Otherwise it is
        added in place (``addmm_``: no weight-sized temporary, one pass over ``.grad``) and no hook
        fires, which is what a disarmed data-parallel hook would have done with a ``.grad`` it
        already points at its bucket.

        ``check``: False for a ``B`` that computes its own weight gradients in place, where a weight's
        gradient in two parts is harmless ([Note: a backward's weight gradients in place]).

        Raises:
            RuntimeError: A deferred parameter also got a gradient outside its layer (see :meth:`check`).
        """
        chosen = None if microbatches is None else set(microbatches)
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        handed: dict[int, int] = {}  # layer -> the address of its weight gradient, going through autograd
        with torch.no_grad():
            for index, ((_, layer), queue) in enumerate(zip(self._layers, self._queues, strict=True)):
                rows = [e for mb in sorted(queue) if chosen is None or mb in chosen for e in queue[mb]]
                for mb in [mb for mb in queue if chosen is None or mb in chosen]:
                    del queue[mb]
                if not rows:
                    continue
                x = rows[0][0] if len(rows) == 1 else torch.cat([x for x, _ in rows])
                g = rows[0][1] if len(rows) == 1 else torch.cat([g for _, g in rows])
                weight, bias = layer.weight, layer.bias
                if final or weight.grad is None or (bias is not None and bias.grad is None):
                    params.append(weight)
                    grads.append(self._product(index, g, x) if weight.grad is None else g.t().mm(x))
                    handed[index] = grads[-1].data_ptr()
                    if bias is not None:
                        params.append(bias)
                        grads.append(g.sum(0))
                    continue
                weight.grad.addmm_(g.t(), x)
                if bias is not None:
                    assert bias.grad is not None
                    bias.grad.add_(g.sum(0))
        if params:
            self._flushing = True
            try:
                _hand_over(params, grads)
            finally:
                self._flushing = False
            for index, ptr in handed.items():  # kept, to be written again once the step drops it
                weight = self._layers[index][1].weight
                if weight.grad is not None and weight.grad.data_ptr() == ptr:
                    self._spares[index] = weight.grad
        if check:
            self.check()

    def _product(self, index: int, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``g^T x`` for layer ``index``'s weight, into the gradient tensor the store handed over last time
        when nothing else refers to it any more ([Note: handing a flush's gradients over])."""
        spare = self._spares.pop(index, None)
        if spare is not None and _unshared(spare) and spare.shape == (x.shape[1], g.shape[1])[::-1] \
                and spare.dtype == x.dtype and spare.device == x.device:
            return torch.mm(g.t(), x, out=spare)
        del spare
        return g.t().mm(x)

    def check(self) -> None:
        """Raise if a deferred parameter also got a gradient from plain autograd in this step.

        Raises:
            RuntimeError: Naming the parameter and what to do.
        """
        both = [name for pid, name in self._outside.items() if pid in self._deferred]
        if both:
            raise RuntimeError(
                f"parameter {both[0]!r} is used by its nn.Linear and outside it in the stage's forward, so "
                "its gradient comes in two parts and the stage cannot defer it (gpipe and zb-h1 defer the "
                "weight gradients of nn.Linear layers); train this model with schedule 1f1b")

    def _forward(self, index: int) -> Callable[[nn.Linear, torch.Tensor], torch.Tensor]:
        def forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            mb = self.microbatch
            if (mb is None or not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
                    or x.dtype != layer.weight.dtype):
                return nn.functional.linear(x, layer.weight, layer.bias)
            bias = None if layer.bias is None else layer.bias.detach()
            out: torch.Tensor = _DeferredLinear.apply(  # type: ignore[no-untyped-call]  # torch stub
                x, layer.weight.detach(), bias, self._anchor, self, index, mb)
            return out
        return forward

    def _watch(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._flushing:
                self._outside[id(p)] = name
        return hook

    def _queue(self, layer: int, microbatch: int, x: torch.Tensor, grad: torch.Tensor) -> None:
        lin = self._layers[layer][1]
        self._queues[layer].setdefault(microbatch, []).append(
            (x.detach().reshape(-1, lin.in_features), grad.detach().reshape(-1, lin.out_features)))
        self._deferred.update(id(p) for p in lin.parameters())


_STORES: weakref.WeakKeyDictionary[nn.Module, WeightGradStore] = weakref.WeakKeyDictionary()
