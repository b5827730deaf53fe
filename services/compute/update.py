"""A stage's local update at a commit: gradients scaled by the commit's ``grad_scale``, then the optimizer.

The coordinator folds fp16's unscale and the clipping coefficient into one factor
(``CommitStep.grad_scale``, ``coordinator/runtime/clipping.py``). :func:`scale_grads` applies it;
on the parameter-server path the stage scales what it pushes, and on the collective path
:func:`local_update` scales the gradients and runs the update with its learning-rate scheduler
(``services/params/scheduling.py``: [Note: a scheduler's position]). With ``plan.offload`` the
optimizer is built over host-memory masters (``services/params/offload.py``): :func:`local_update`
copies the final gradients to them first, scales and steps them there, and copies the updated values
back to the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.params import scheduling
from services.params.offload import HostCopy
from services.protocol import CommitStep

__all__ = ["local_update", "scale_grads"]


def scale_grads(params: Sequence[tuple[str, torch.Tensor]], factor: float) -> None:
    """Multiply every gradient of ``params`` by ``factor`` in place (nothing to do for 1.0)."""
    grads = [p.grad for _, p in params if p.grad is not None]
    if factor != 1.0 and grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, factor)


def local_update(params: Sequence[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, commit: CommitStep,
                 host: HostCopy | None = None) -> None:
    """The scheduler brought to the commit's step, the gradients scaled by ``grad_scale``, the optimizer
    step, one scheduler step. With ``host`` (offload) ``optimizer`` steps ``host.masters()`` rather than
    ``params``: the gradients are copied there first and the updated values back after.

    Raises:
        ValueError: The scheduler cannot step (OneCycleLR past its ``total_steps``) or is past the step.
    """
    if scheduler is not None:
        scheduling.advance(scheduler, commit.train_step)
    if host is not None:
        host.pull_grads()
        params = host.masters()
    scale_grads(params, commit.grad_scale)
    optimizer.step()
    if host is not None:
        host.push_params()
    if scheduler is not None:
        scheduling.step(scheduler)
