"""One process training a job's model on the job's global batches: what every plan must match.

See [Note: what the invariant compares] in ``coordinator/runtime/job.py``. The reference builds
the model, data and loss from the job's factories exactly as the workers do, takes the
sampler's global batch of each step in order, and runs one forward, one backward of the
mean loss and one optimizer step per step. A step whose loss or gradients are not finite is
treated as the job's ``runtime.nonfinite`` says (see [Note: a step that is not finite] in
``coordinator/runtime/nonfinite.py``): ``skip`` drops its optimizer step, ``stop`` raises.
"""

from __future__ import annotations

import math

import torch

from coordinator.runtime.factories import build_data, build_loss, build_model, unwrapped
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.nonfinite import NonFiniteStep
from services.compute.stage import make_optimizer

__all__ = ["max_abs_diff", "train_reference"]


def train_reference(job: Job, steps: int) -> FitResult:
    """Train ``job``'s model for ``steps`` steps in this process; return losses and the final state_dict.

    The losses are each step's loss before its update, as ``Job.fit`` reports them.

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
    sampler = job.sampler()
    losses: list[float] = []
    for step in range(steps):
        inputs, targets = source.load(sampler.indices(step))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]  # torch stub
        value = float(loss.detach())
        finite = math.isfinite(value) and all(bool(torch.isfinite(p.grad).all()) for p in params
                                              if p.grad is not None)
        if finite:
            optimizer.step()
        elif config.runtime.nonfinite == "stop":
            good = [x for x in losses if math.isfinite(x)]
            raise NonFiniteStep(f"step {step + 1}: the loss ({value}) or the gradients are not finite",
                                step=step, stage=0, last_good_loss=good[-1] if good else None)
        losses.append(value)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return FitResult(losses=losses, state_dict=state)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state_dicts with the same keys.

    Raises:
        KeyError: The keys differ.
    """
    if sorted(a) != sorted(b):
        raise KeyError(f"state_dict keys differ: {sorted(set(a) ^ set(b))}")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)
