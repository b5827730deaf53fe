"""One process training a job's model on the job's global batches: what every plan must match.

See [Note: what the invariant compares] in ``coordinator/runtime/job.py``. The reference builds
the model, data and loss from the job's factories exactly as the workers do, takes the
sampler's global batch of each step in order, and runs one forward, one backward of the
mean loss and one optimizer step per step. A step whose loss or gradients are not finite is
treated as the job's ``runtime.nonfinite`` says (see [Note: a step that is not finite] in
``coordinator/runtime/nonfinite.py``): ``skip`` drops its optimizer step, ``stop`` raises.

With an ``eval`` section it evaluates the model after the same steps as a fit of ``steps`` steps
(every ``eval.every_steps`` and the last): the whole held-out set in one forward, with torch's own
eval mode and ``no_grad``, the loss and the metric's mean over the held-out samples
(:func:`evaluate_reference`).

Mixed precision (``plan.precision``) is torch's own recipe, written as its documentation
writes it: the forward and the loss under ``torch.autocast``, the backward outside it, and
under fp16 a ``torch.amp.GradScaler`` with its defaults (scale the loss, unscale, step,
update; a step whose gradients overflow is skipped by the scaler whatever
``runtime.nonfinite`` says).

The optimizer section's extras, with torch's own code, as a torch training loop writes them:
``accumulate`` global batches per step, each one's mean loss divided by ``accumulate`` and
backpropagated in turn (the step's loss is their mean); ``clip_grad_norm`` through
``torch.nn.utils.clip_grad_norm_`` before the update; the ``torch.optim.lr_scheduler`` stepped
once per step after it, also when a non-finite step skips the update (as with AMP's
``GradScaler``).

Each forward is keyed by the step and the batch's sample indices, as the stages' are, so the
reference draws the same dropout masks (``services/compute/randomness/``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from coordinator.planning.config import JobConfig, SchedulerConfig
from coordinator.runtime.factories import build_data, build_loss, build_metric, build_model, unwrapped
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.nonfinite import NonFiniteStep
from coordinator.runtime.records import EvalRecord
from services.compute.chain import call_model
from services.compute.precision import autocast, device_type
from services.compute.randomness import ModelRandomness
from services.compute.stage import make_optimizer

__all__ = ["evaluate_reference", "max_abs_diff", "train_reference"]


def train_reference(job: Job, steps: int) -> FitResult:
    """Train ``job``'s model for ``steps`` steps in this process; return losses, gradient norms and the
    final state_dict.

    The losses are each step's loss before its update, as ``Job.fit`` reports them; the norms each
    step's whole gradient's before clipping (``torch.nn.utils.get_total_norm``).

    Raises:
        NonFiniteStep: A step's loss or gradients are not finite and ``runtime.nonfinite`` is ``stop``.
    """
    config = job.config
    # the model as the user trains it: the module itself (a sequence of cells: nn.Sequential of them)
    model = unwrapped(build_model(config.model.factory, config.model.kwargs, config.data.seed))
    source = build_data(config.data.factory, config.data.kwargs, config.data.seed)
    loss_fn = build_loss(config.loss.factory, config.loss.kwargs)
    params = list(model.parameters())
    optimizer = make_optimizer(job.optimizer, params)
    section = config.optimizer
    scheduler = _scheduler(section.scheduler, optimizer)
    sampler = job.sampler()
    randomness = ModelRandomness(model, config.data.seed)
    losses: list[float] = []
    evals: list[EvalRecord] = []
    every = config.eval.every_steps if config.eval is not None else None
    norms: list[float | None] = []
    # -- mixed precision (plan.precision): autocast, and fp16's GradScaler
    precision, device = config.plan.precision, device_type(params)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for a in range(section.accumulate):
            batch = sampler.indices(step * section.accumulate + a)
            inputs, targets = source.load(batch)
            with autocast(precision, device), randomness.forward(step, batch):
                loss = loss_fn(call_model(model, inputs), targets) / section.accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()  # type: ignore[no-untyped-call]
            value += float(loss.detach())
        if scaler is not None:
            scaler.unscale_(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        grads_finite = all(bool(torch.isfinite(g).all()) for g in grads)
        finite = math.isfinite(value) and grads_finite
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if finite and section.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, section.clip_grad_norm)
        if scaler is not None and (finite or not grads_finite):
            scaler.step(optimizer)  # skips the step when the gradients overflowed
        elif finite:
            optimizer.step()
        if scheduler is not None:
            with warnings.catch_warnings():  # a skipped first update: torch warns of the order
                warnings.simplefilter("ignore")
                scheduler.step()
        overflow = scaler is not None and not grads_finite  # fp16: the scaler's to handle, not a failure
        if not finite and not overflow and config.runtime.nonfinite == "stop":
            good = [x for x in losses if math.isfinite(x)]
            raise NonFiniteStep(f"step {step + 1}: the loss ({value}) or the gradients are not finite",
                                step=step, stage=0, last_good_loss=good[-1] if good else None)
        if scaler is not None:
            scaler.update()
        losses.append(value)
        if config.eval is not None and (step + 1 == steps or (every is not None and (step + 1) % every == 0)):
            evals.append(evaluate_reference(config, model, loss_fn, step + 1))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return FitResult(losses=losses, state_dict=state, evals=evals, grad_norms=norms)


def evaluate_reference(config: JobConfig, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                       step: int) -> EvalRecord:
    """``model`` on ``config``'s whole held-out set in one forward (``model.eval()``, ``no_grad``, then
    ``model.train()``): the loss, and the mean of the metric's per-sample values (or its one value)."""
    section = config.eval
    assert section is not None
    source = build_data(section.factory, section.kwargs, config.data.seed, section="eval")
    n = section.num_samples or source.num_samples
    assert n is not None, "a loader needs eval.num_samples"
    inputs, targets = source.load(list(range(n)))
    model.eval()
    with torch.no_grad():
        output = call_model(model, inputs)
        loss = float(loss_fn(output, targets))
        metric = None
        if section.metric is not None:
            value = build_metric(section.metric)(output, targets).double()
            metric = float(value.mean())
    model.train()
    return EvalRecord(step=step, loss=loss, metric=metric, num_samples=n)


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
