"""Clipping by the global gradient norm, the coordinator's half: the parts of the norm added up.

The arithmetic is ``services/params/clipping.py``'s. Where the parts come from:

* collective mode: each stage reports the squared norm of its gradients after the all-reduce
  (``StepReply.grad_sq_norm``); every replica of a stage holds the same averaged gradient, so
  :func:`grad_scale` adds replica 0's of every stage, and the coefficient rides on the commit
  that already travels with the next step (``CommitStep.grad_scale``): clipping costs no round
  trip of its own;
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
from services.protocol import StepReply

__all__ = ["global_norm", "grad_scale"]


def _sq_norm(bodies: Sequence[tuple[_Service, StepReply]]) -> float | None:
    parts = [body.grad_sq_norm for sv, body in bodies if sv.replica == 0]
    if not parts or any(p is None for p in parts):
        return None
    return sum(p for p in parts if p is not None)


def global_norm(bodies: Sequence[tuple[_Service, StepReply]], loss_scale: float = 1.0) -> float | None:
    """The L2 norm of the whole model's (unscaled) gradient of a step with these replies, before clipping
    (``StepRecord.grad_norm``); None on the parameter-server path, whose stages report no norm.

    ``loss_scale`` is the fp16 loss scale the step ran with (``coordinator/runtime/scaler.py``): the stages'
    gradients, and so their norms, are that many times the true ones.
    """
    sq = _sq_norm(bodies)
    return math.sqrt(sq) / loss_scale if sq is not None else None


def grad_scale(bodies: Sequence[tuple[_Service, StepReply]], max_norm: float | None,
               loss_scale: float = 1.0) -> float:
    """What the commit of a step with these replies multiplies its gradients by: ``1 / loss_scale`` (fp16's
    unscale; 1 otherwise) times the clipping coefficient of the unscaled gradients' norm (replica 0's of
    every stage), as torch's AMP recipe unscales before ``clip_grad_norm_``. Without clipping, or on the
    parameter-server path (whose shards clip the unscaled gradients the stages push), the unscale alone.
    """
    unscale = 1.0 / loss_scale
    sq = _sq_norm(bodies) if max_norm is not None else None
    if sq is None or max_norm is None:
        return unscale
    return unscale * clip_coefficient(sq * unscale * unscale, max_norm)
