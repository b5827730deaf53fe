"""Clipping by the global gradient norm, the coordinator's half: the parts of the norm added up.

The arithmetic is ``services/params/clipping.py``'s. Where the parts come from:

* collective mode: each stage reports the squared norm of its gradients after the all-reduce
  (``StepReply.grad_sq_norm``); every replica of a stage holds the same averaged gradient, so
  :func:`grad_scale` adds replica 0's of every stage, and the coefficient rides on the commit
  that already travels with the next step (``CommitStep.grad_scale``): clipping costs no round
  trip of its own;
* sharded gradients (ZeRO-2 and 3, sharding groups of ``F`` replicas): each replica holds the
  averaged gradient of its rows only and reports their squared norm, its part; the parts of
  replicas ``0 .. F-1`` (the first group: under hybrid sharding every group holds the same
  averaged rows) add up to the stage's. The coordinator adds them (``parts``): the workers spend no
  collective on it (one scalar all-reduce per step on the step's critical path before);
* parameter-server mode: the shards hold the averaged gradient, the stages only their own, so
  the shards hold each round until the coordinator has every shard's norm and sends the
  coefficient (``coordinator/runtime/shards.py``): one more coordinator round trip, after the
  pushes, while the stages wait in their pull.

A parameter is counted once: a stage lists each of its parameters once (tied weights within a
stage too: ``cell_parameters``), and a shard holds each of its parameters once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.runtime.records import _Service
from services.params.clipping import clip_coefficient
from services.protocol.compute import StepReport

__all__ = ["global_norm", "grad_scale", "norm_parts"]


def _sq_norm(bodies: Sequence[tuple[_Service, StepReport]], parts: int) -> float | None:
    """The stages' squared norms added: replica 0's report of each stage, or with ``parts`` > 1
    (sharded gradients) replicas ``0 .. parts-1``'s, each its rows' part."""
    got = [body.grad_sq_norm for sv, body in bodies if sv.replica < parts]
    if not got or any(p is None for p in got):
        return None
    return sum(p for p in got if p is not None)


def norm_parts(zero_stage: int, shard_factor: int) -> int:
    """How many replicas' reports make up a stage's gradient norm under a plan: ``shard_factor`` where the
    replicas hold gradient shards (ZeRO-2 and 3), else 1 (every replica holds the whole average)."""
    return shard_factor if zero_stage >= 2 else 1


def global_norm(bodies: Sequence[tuple[_Service, StepReport]], loss_scale: float = 1.0,
                parts: int = 1) -> float | None:
    """The L2 norm of the whole model's (unscaled) gradient of a step with these replies, before clipping
    (``StepRecord.grad_norm``); None on the parameter-server path, whose stages report no norm.

    ``loss_scale`` is the fp16 loss scale the step ran with (``coordinator/runtime/scaler.py``): the stages'
    gradients, and so their norms, are that many times the true ones.
    """
    sq = _sq_norm(bodies, parts)
    return math.sqrt(sq) / loss_scale if sq is not None else None


def grad_scale(bodies: Sequence[tuple[_Service, StepReport]], max_norm: float | None,
               loss_scale: float = 1.0, parts: int = 1) -> float:
    """What the commit of a step with these replies multiplies its gradients by: ``1 / loss_scale`` (fp16's
    unscale; 1 otherwise) times the clipping coefficient of the unscaled gradients' norm (replica 0's of
    every stage; ``parts``: as :func:`global_norm`), as torch's AMP recipe unscales before
    ``clip_grad_norm_``. Without clipping, or on the parameter-server path (whose shards clip the unscaled
    gradients the stages push), the unscale alone.
    """
    unscale = 1.0 / loss_scale
    sq = _sq_norm(bodies, parts) if max_norm is not None else None
    if sq is None or max_norm is None:
        return unscale
    return unscale * clip_coefficient(sq * unscale * unscale, max_norm)
