"""Activation recompute (``plan.recompute``): each node of a stage runs under ``torch.utils.checkpoint``.

[Note: recompute per cell]
A recomputing stage runs its nodes ``[start, stop)`` one at a time, each as its own module
(``Chain.stage_module(i, i + 1)``: it takes what crosses cut ``i`` and returns what crosses cut
``i + 1``, so the nodes in a row compute exactly what the stage module computes, sharing its
parameters), each called through non-reentrant ``torch.utils.checkpoint``. A node's forward then
holds nothing for the backward but its inputs (the values crossing its cut); the backward runs the
node's forward again, as its first saved tensor is needed, and then the node's own backward. So a
stage holds one node's activations at a time in its backward, plus the values at its cuts, where it
held every node's activations of every microbatch in flight.

What the recomputation must see again is what the forward saw:

* autocast (``bf16``/``fp16``): ``torch.utils.checkpoint`` notes the autocast state at the forward
  and recomputes under it;
* random draws: keyed forwards (``services/compute/randomness/``) are replayed from the module
  stack and counters noted as the node's forward starts (``randomness.replaying``), so dropout draws
  the same masks; torch's own generators are restored by the checkpoint (``preserve_rng_state``);
* the split backward's deferred linear layers (``services/compute/weight_grads.py``): the layers
  take their path from the store's ``microbatch``, which the executor has moved on by the time a
  node is recomputed; the recomputation runs with the value the forward had, so it saves the same
  tensors. The backward that runs is the forward's own graph (the recomputation only fills in its
  saved tensors), so each layer queues ``(x, g)`` under the microbatch of its forward: ``I`` and
  ``W`` stay exact (GPipe, zb-h1 and 1F1B's in-place ``W`` alike).

Every callable in ``replays`` is called as a node's forward starts and returns the context its
recomputation runs in. The recomputation must compute the saved tensors again exactly: a forward
that changes state read by a later forward (a BatchNorm's running statistics in training) would
change it twice; the compute service refuses BatchNorm in training mode with recompute.

Only training forwards are checkpointed (an evaluation forward holds nothing for a backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Replay", "attribute_replay", "recomputed_forward"]

Replay = Callable[[], AbstractContextManager[Any]]


def attribute_replay(owner: object, name: str) -> Replay:
    """A replay putting ``owner.name`` back to the value it has as the node's forward starts."""
    def note() -> AbstractContextManager[Any]:
        return _attribute_as(owner, name, getattr(owner, name))
    return note


@contextmanager
def _attribute_as(owner: object, name: str, value: Any) -> Iterator[None]:
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextmanager
def _all(contexts: list[AbstractContextManager[Any]]) -> Iterator[None]:
    with ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def _contexts(replays: Sequence[Replay]) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward, the replays around the
    recomputation (noted now, as the node's forward starts)."""
    return contextlib.nullcontext(), _all([replay() for replay in replays])


def _run(piece: nn.Module, several: bool, *values: Any) -> Any:
    return piece(tuple(values) if several else values[0])


def recomputed_forward(pieces: Sequence[nn.Module], inputs: Any, replays: Sequence[Replay] = ()) -> Any:
    """The stage's forward of ``inputs`` through its node modules ``pieces``, each checkpointed.

    A tuple of values (several crossing a cut) is passed to the checkpoint as its arguments, so it
    finds their device; a single value as one argument. Without gradients the nodes simply run.
    """
    value = inputs
    for piece in pieces:
        if not torch.is_grad_enabled():
            value = piece(value)
            continue
        several = isinstance(value, tuple)
        args = value if several else (value,)
        value = checkpoint(_run, piece, several, *args, use_reentrant=False,
                           context_fn=lambda: _contexts(replays))
    return value
