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


def global_norm(bodies: Sequence[tuple[_Service, StepReply]]) -> float | None:
    """The L2 norm of the whole model's gradient of a step with these replies, before clipping
    (``StepRecord.grad_norm``); None on the parameter-server path, whose stages report no norm."""
    sq = _sq_norm(bodies)
    return math.sqrt(sq) if sq is not None else None


def grad_scale(bodies: Sequence[tuple[_Service, StepReply]], max_norm: float | None) -> float:
    """What the commit of a step with these replies multiplies its gradients by: the clipping coefficient
    of the stages' norms (replica 0's), or 1.0 without clipping or on the parameter-server path (whose
    shards clip: their stages report no norm)."""
    sq = _sq_norm(bodies) if max_norm is not None else None
    return clip_coefficient(sq, max_norm) if sq is not None and max_norm is not None else 1.0
