"""Learning-rate schedulers: a ``torch.optim.lr_scheduler`` class by name, built next to its optimizer.

Whoever holds an optimizer holds its scheduler: a compute stage in collective mode
(``services/compute/service.py``), a parameter shard in parameter-server mode
(``services/params/store.py``). Both build it with :func:`build_scheduler` from the
:class:`~services.protocol.SchedulerSpec` inside the job's ``OptimizerSpec``; the coordinator
builds one on a throwaway optimizer before any worker starts, so a bad name or argument is
one error then (``coordinator/runtime/preflight.py``).

[Note: a scheduler's position]
A scheduler is stepped exactly once per training step, after the optimizer step, as torch's
recipe says; a step whose update is dropped (not finite, ``runtime.nonfinite: skip``) still
steps it, as torch's AMP recipe does (``GradScaler`` skips ``optimizer.step()``, the loop
still calls ``scheduler.step()``): the learning rate is a function of the step count alone.
Every update therefore carries its training step (``CommitStep.train_step``,
``PushRequest.train_step``, ``ApplyRound.train_step``: counted from the job's start) and the
holder first :func:`advance` s its scheduler to it: a no-op in a run without skipped steps,
one ``step()`` per step skipped since the last update, and after a resume or a recovery
(a fresh scheduler at position 0) the replay of every step before the restored one. For
every stepwise scheduler of ``torch.optim.lr_scheduler`` that replay reproduces the state an
uninterrupted run reaches (their state evolves by ``step()`` alone, from the optimizer's
initial rate, which a checkpoint does not change: it restores per-parameter state only), so
no scheduler state is saved. The replay costs a few microseconds a step.

Refused, with the reason (:data:`REFUSED`): ``ReduceLROnPlateau`` (its state follows a
metric, so it is no function of the step count and would not survive a resume by replay;
its metric would be the training loss, rarely what it is meant for), the schedulers that
take callables or other schedulers (``LambdaLR``, ``MultiplicativeLR``, ``SequentialLR``,
``ChainedScheduler``: a job spec holds plain values only) and the abstract base classes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import lr_scheduler

from services.protocol import SchedulerSpec

__all__ = ["REFUSED", "Scheduler", "advance", "build_scheduler", "step"]

Scheduler = lr_scheduler.LRScheduler

REFUSED: dict[str, str] = {
    "ReduceLROnPlateau": "it follows a metric, not the step count, so its state would not survive a resume; "
                         "use a stepwise scheduler (StepLR, CosineAnnealingLR, OneCycleLR...)",
    "LambdaLR": "it takes a Python callable, and a job spec holds plain values only",
    "MultiplicativeLR": "it takes a Python callable, and a job spec holds plain values only",
    "SequentialLR": "it takes other scheduler objects, and a job spec holds plain values only",
    "ChainedScheduler": "it takes other scheduler objects, and a job spec holds plain values only",
    "LRScheduler": "it is the abstract base class",
    "_LRScheduler": "it is the abstract base class",
}


def _stepwise() -> list[str]:
    classes = {n: getattr(lr_scheduler, n) for n in dir(lr_scheduler) if not n.startswith("_")}
    return sorted(n for n, c in classes.items()
                  if n not in REFUSED and isinstance(c, type) and issubclass(c, Scheduler))


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> Scheduler:
    """The scheduler ``spec`` names over ``optimizer`` (built with its initial rate), at position 0.

    Raises:
        ValueError: Not a usable ``torch.optim.lr_scheduler`` class (the message says why and lists
            the usable ones), or the class refused ``spec.kwargs`` (the message quotes torch).
    """
    if spec.name in REFUSED:
        raise ValueError(f"scheduler {spec.name} is not supported: {REFUSED[spec.name]}")
    cls = None if spec.name.startswith("_") else getattr(lr_scheduler, spec.name, None)
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ValueError(f"unknown scheduler {spec.name!r}: name a torch.optim.lr_scheduler class, one of "
                         f"{', '.join(_stepwise())}")
    make: Callable[..., Scheduler] = cls
    kwargs: dict[str, Any] = dict(spec.kwargs)
    try:
        with warnings.catch_warnings():  # a deprecated argument's warning would repeat on every worker
            warnings.simplefilter("ignore")
            return make(optimizer, **kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"scheduler {spec.name}({_args(spec.kwargs)}): {exc}") from None


def advance(scheduler: Scheduler, position: int) -> int:
    """Step ``scheduler`` until it stands at ``position`` (training steps done before the next update);
    how many steps that took. See [Note: a scheduler's position].

    Raises:
        ValueError: The scheduler is already past ``position`` (an update of an earlier step arrived
            late), or a step refused (OneCycleLR past its ``total_steps``: the message says so).
    """
    at = scheduler.last_epoch
    if position < at:
        raise ValueError(f"the {type(scheduler).__name__} scheduler is at step {at}, past the update of step "
                         f"{position} (updates must come in step order)")
    with warnings.catch_warnings():  # steps replayed before the first optimizer.step() warn in torch
        warnings.simplefilter("ignore")
        for _ in range(position - at):
            step(scheduler)
    return position - at


def step(scheduler: Scheduler) -> None:
    """One ``scheduler.step()``; torch's error names what ran out (OneCycleLR past ``total_steps``).

    Raises:
        ValueError: The scheduler refused to step.
    """
    at = scheduler.last_epoch
    try:
        scheduler.step()
    except ValueError as exc:
        raise ValueError(f"the {type(scheduler).__name__} scheduler cannot step after {at} steps: {exc} (its "
                         "arguments must cover every step of the job)") from None


def _args(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
