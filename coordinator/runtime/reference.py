"""One process training a job's model on the job's global batches: what every plan must match.

See [Note: what the invariant compares] in ``coordinator/runtime/job.py``. The reference builds
the model, data and loss from the job's factories exactly as the workers do, takes the
sampler's global batch of each step in order, and runs one forward, one backward of the
mean loss and one optimizer step per step. A step whose loss or gradients are not finite is
treated as the job's ``runtime.nonfinite`` says (see [Note: a step that is not finite] in
``coordinator/runtime/nonfinite.py``): ``skip`` drops its optimizer step, ``stop`` raises.

The optimizer section's extras, with torch's own code, as a torch training loop writes them:
``accumulate`` global batches per step, each one's mean loss divided by ``accumulate`` and
backpropagated in turn (the step's loss is their mean); ``clip_grad_norm`` through
``torch.nn.utils.clip_grad_norm_`` before the update; the ``torch.optim.lr_scheduler`` stepped
once per step after it, also when a non-finite step skips the update (as with AMP's
``GradScaler``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import nn

from coordinator.planning.config import SchedulerConfig
from coordinator.runtime.factories import build_cells, build_data, build_loss
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.nonfinite import NonFiniteStep
from services.compute.cell import cell_parameters
from services.compute.stage import make_optimizer

__all__ = ["max_abs_diff", "train_reference"]


def train_reference(job: Job, steps: int) -> FitResult:
    """Train ``job``'s model for ``steps`` steps in this process; return losses, gradient norms and the
    final state_dict.

    The losses are each step's loss before its update, as ``Job.fit`` reports them; the norms each
    step's whole gradient's before clipping (``torch.nn.utils.get_total_norm``).

    Raises:
        NonFiniteStep: A step's loss or gradients are not finite and ``runtime.nonfinite`` is ``stop``.
    """
    config = job.config
    model, cells = build_cells(config.model.factory, config.model.kwargs, config.data.seed)
    whole = nn.Sequential(*cells)
    source = build_data(config.data.factory, config.data.kwargs, config.data.seed)
    loss_fn = build_loss(config.loss.factory, config.loss.kwargs)
    params = [p for _, p in cell_parameters(cells)]
    optimizer = make_optimizer(job.optimizer, params)
    section = config.optimizer
    scheduler = _scheduler(section.scheduler, optimizer)
    sampler = job.sampler()
    losses: list[float] = []
    norms: list[float | None] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for a in range(section.accumulate):
            inputs, targets = source.load(sampler.indices(step * section.accumulate + a))
            loss = loss_fn(whole(inputs), targets) / section.accumulate
            loss.backward()  # type: ignore[no-untyped-call]  # torch stub
            value += float(loss.detach())
        finite = math.isfinite(value) and all(bool(torch.isfinite(p.grad).all()) for p in params
                                              if p.grad is not None)
        grads = [p.grad for p in params if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if finite:
            if section.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, section.clip_grad_norm)
            optimizer.step()
        if scheduler is not None:
            with warnings.catch_warnings():  # a skipped first update: torch warns of the order
                warnings.simplefilter("ignore")
                scheduler.step()
        if not finite and config.runtime.nonfinite == "stop":
            good = [x for x in losses if math.isfinite(x)]
            raise NonFiniteStep(f"step {step + 1}: the loss ({value}) or the gradients are not finite",
                                step=step, stage=0, last_good_loss=good[-1] if good else None)
        losses.append(value)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return FitResult(losses=losses, state_dict=state, grad_norms=norms)


def _scheduler(config: SchedulerConfig | None, optimizer: torch.optim.Optimizer,
               ) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The ``torch.optim.lr_scheduler`` class ``config`` names over ``optimizer`` (None: no scheduler)."""
    if config is None:
        return None
    cls: Callable[..., torch.optim.lr_scheduler.LRScheduler] = getattr(torch.optim.lr_scheduler, config.name)
    return cls(optimizer, **config.kwargs)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state_dicts with the same keys.

    Raises:
        KeyError: The keys differ.
    """
    if sorted(a) != sorted(b):
        raise KeyError(f"state_dict keys differ: {sorted(set(a) ^ set(b))}")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)
