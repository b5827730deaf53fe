"""fp16's dynamic loss scale, held by the coordinator: ``torch.amp.GradScaler``'s rules over a whole plan.

[Note: the loss scale]
fp16 holds numbers from about 6e-8 to 65504, so small gradients of a float16 activation
flush to zero. torch's recipe multiplies the loss by a large scale ``S`` before the backward
and divides the gradients by ``S`` before the optimizer step; when ``S`` is too large, some
gradient overflows to Inf or NaN, the step's update is skipped and ``S`` halves. cellmesh
splits that over the plan:

* the coordinator holds ``S`` (:class:`LossScaler`) and sends it with every step
  (``RunStep.loss_scale``); the last stage multiplies its loss by it before the backward
  (the losses it reports stay unscaled);
* every stage reports the parameters whose gradient is not finite after the gradient path
  (``StepReply.nonfinite_grads``, as for [Note: a step that is not finite]);
* a step some stage reports is an overflow: it is never committed and ``S`` backs off,
  whatever ``runtime.nonfinite`` says (an overflow is how the scale is found, not a failure);
  otherwise its commit carries ``1/S`` (``CommitStep.grad_scale``), which every stage
  multiplies into its gradients before the optimizer step (or the push to its shards).

The state machine is ``GradScaler``'s with its defaults: ``S`` starts at 2**16, halves on an
overflow (which also resets the count of good steps), and doubles after 2000 good steps in a
row, if the doubled value is finite. ``S`` is rounded to float32 as GradScaler's tensor is,
and powers of two keep ``1/S`` exact. The state (scale and the count) goes into the
checkpoint's ``trainer.json``, so a resumed run goes on with it. A scale that halved down to
0 (every step overflows: NaN in the data or the model, at any scale) stops the job
(``coordinator/runtime/nonfinite.py``).
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BACKOFF_FACTOR", "GROWTH_FACTOR", "GROWTH_INTERVAL", "INIT_SCALE", "LossScaler", "ScalerState"]

# torch.amp.GradScaler's defaults
INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class ScalerState(BaseModel):
    """The loss scale and the good steps in a row since it last changed (``trainer.json``'s ``scaler``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scale: float = Field(default=INIT_SCALE, ge=0, allow_inf_nan=False)
    growth_tracker: int = Field(default=0, ge=0)


class LossScaler:
    """The dynamic loss scale of one job (see [Note: the loss scale]).

    Args:
        state: Where to start (a checkpoint's); the default is GradScaler's initial state.
    """

    def __init__(self, state: ScalerState | None = None) -> None:
        state = state or ScalerState()
        self.scale = state.scale
        self.growth_tracker = state.growth_tracker

    @property
    def inverse(self) -> float:
        """What a step's gradients are multiplied by before its update: ``1 / scale`` (the scale is > 0)."""
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Take a step's outcome: back off after an overflow, grow after enough good steps in a row.

        As ``torch._amp_update_scale_``: on an overflow the scale is multiplied by the backoff and
        the count restarts; otherwise the count grows, and at the interval the scale is multiplied
        by the growth factor (kept only if finite) and the count restarts.
        """
        if found_inf:
            self.scale = _float32(self.scale * BACKOFF_FACTOR)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == GROWTH_INTERVAL:
            grown = _float32(self.scale * GROWTH_FACTOR)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state(self) -> ScalerState:
        """The state to save (and to resume from)."""
        return ScalerState(scale=self.scale, growth_tracker=self.growth_tracker)


def _float32(value: float) -> float:
    """``value`` rounded to float32 (Inf beyond its range, 0 below it), as GradScaler's scale tensor is."""
    return float(torch.tensor(value, dtype=torch.float32))
