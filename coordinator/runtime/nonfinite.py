"""Steps whose loss or gradients are not finite: found in the replies, then dropped or the job stopped.

[Note: a step that is not finite]
A step whose loss (any microbatch's, from the last stage) or gradients (any parameter's, from
any stage, after the gradient path) hold a NaN or an Inf would write NaN into the parameters
when committed. The coordinator reads a step's replies before it commits the step, so it can
drop it: nothing of its update is applied anywhere, as AMP's ``GradScaler`` skips the
optimizer step. ``RunSpec.nonfinite`` (the config's ``runtime.nonfinite``) decides what then:

* ``stop`` (the default): :class:`NonFiniteStep` names the step, the stage and the last good
  loss; the parameters stay those of the last committed step, and ``cellmesh run`` writes
  nothing (an earlier output stays as it was);
* ``skip``: the step's record is marked ``skipped`` (its loss as reported), a warning names
  it, and the next step trains on the next batch from the same parameters. What a forward
  changes outside the update (batch-norm statistics) is not rolled back, as with ``GradScaler``.

Under ``plan.precision: fp16`` gradients that are not finite are an overflow of the loss
scale, not a failure: the step is dropped and the scale backs off, whatever
``runtime.nonfinite`` says (:func:`overflowed`; [Note: the loss scale] in
``coordinator/runtime/scaler.py``). A loss that is not finite over finite gradients still
follows ``runtime.nonfinite``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from coordinator.runtime.errors import JobError
from coordinator.runtime.records import StepRecord, _Service
from coordinator.runtime.scaler import LossScaler
from services.protocol.compute import StepReport

__all__ = ["NonFiniteStep", "first_nonfinite", "overflowed", "refuse"]

log = logging.getLogger(__name__)


class NonFiniteStep(JobError):
    """A step's loss or gradients are NaN or Inf under ``nonfinite: stop``: the job stopped before its update.

    See [Note: a step that is not finite]. The message counts steps from 1, as the progress does.

    Attributes:
        step: The step (from 0, as ``StepRecord.step``).
        stage: The stage that reported the value.
        last_good_loss: The loss of the last step that was finite (None: there was none).
    """

    def __init__(self, message: str, *, step: int, stage: int, last_good_loss: float | None) -> None:
        super().__init__(message)
        self.step = step
        self.stage = stage
        self.last_good_loss = last_good_loss
        self.before: list[StepRecord] = []  # the steps of its window before it, committed (Runtime.run_steps)


def first_nonfinite(bodies: Sequence[tuple[_Service, StepReport]]) -> tuple[_Service, str] | None:
    """The first service whose reply holds a loss or gradient that is not finite, and what it is."""
    for sv, body in bodies:
        for m, value in enumerate(body.losses):
            if not math.isfinite(value):
                return sv, f"the loss of microbatch {m} is {value}"
    for sv, body in bodies:
        if body.nonfinite_grads:
            names = ", ".join(body.nonfinite_grads)
            return sv, f"the gradients of {names} are not finite (while the loss is)"
    return None


def refuse(run: str, mode: str, step: int, sv: _Service, what: str, *,
           last_good: tuple[int, float] | None) -> None:
    """Stop the job (:class:`NonFiniteStep`) or warn that ``step`` is skipped, per ``runtime.nonfinite``.

    ``last_good`` is the last finite step and its loss (None: there was none).

    Raises:
        NonFiniteStep: ``mode`` is ``stop``.
    """
    where = f"stage {sv.stage} (worker {sv.worker}, replica {sv.replica})"
    if mode == "skip":
        log.warning("[coordinator %s] step %d: %s on %s; its update is dropped (runtime.nonfinite: skip)",
                    run, step + 1, what, where)
        return
    last = (f"the last good loss was {last_good[1]:.6g} at step {last_good[0] + 1}"
            if last_good is not None else "no step before it had a finite loss")
    raise NonFiniteStep(
        f"step {step + 1}: {what} on {where}; the job stopped before applying it ({last}). Lower the "
        "learning rate, look for NaN or Inf in the data, or set runtime.nonfinite: skip to drop such "
        "steps' updates and go on", step=step, stage=sv.stage,
        last_good_loss=last_good[1] if last_good is not None else None)


def overflowed(run: str, step: int, bodies: Sequence[tuple[_Service, StepReport]], scaler: LossScaler, *,
               last_good: tuple[int, float] | None) -> bool:
    """fp16: give ``scaler`` the step's outcome; whether its gradients overflowed (its update is dropped).

    See [Note: the loss scale] in ``coordinator/runtime/scaler.py``: an overflow is logged, not
    raised, until the scale has backed off to 0. ``last_good`` is the last finite step and its loss.

    Raises:
        NonFiniteStep: The scale backed off to 0: the gradients are not finite at any scale.
    """
    found = next(((sv, body) for sv, body in bodies if body.nonfinite_grads), None)
    used = scaler.scale
    scaler.update(found is not None)
    if found is None:
        return False
    sv, body = found
    names = ", ".join(body.nonfinite_grads)
    if scaler.scale == 0.0:
        raise NonFiniteStep(
            f"step {step + 1}: the gradients of {names} on stage {sv.stage} are not finite at loss scale "
            f"{used:g}, and the scale has backed off to 0: they are not finite at any scale. Look for NaN "
            "or Inf in the data or the model, or train in bf16 or fp32 (plan.precision)",
            step=step, stage=sv.stage, last_good_loss=last_good[1] if last_good is not None else None)
    log.info("[coordinator %s] step %d: the gradients of %s on stage %d overflowed at loss scale %g; its "
             "update is dropped and the scale is now %g", run, step + 1, names, sv.stage, used, scaler.scale)
    return True
