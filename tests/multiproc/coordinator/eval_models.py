"""Factories the evaluation tests name: held-out data, metrics, and a model with BatchNorm and dropout.

The held-out samples are drawn apart from the training data (``models.regression``) so an
evaluation cannot pass by reading the training samples. The dropout of :func:`bn_model` draws
its masks from a generator of its own, seeded when the model is built, so every process that
builds the model (a worker's stage, the one-process reference) draws the same masks in training,
and a dropout run in training mode during an evaluation would shift every later mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.compute.cell import Cell
from tests.multiproc.coordinator.models import HIDDEN, IN, OUT, _dt

HELD_OUT = 37  # uneven: batches of 16 leave 5


def heldout(dtype: str = "float64", num_samples: int = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets unlike the training data's (shifted and scaled)."""
    x = torch.randn(num_samples, IN, dtype=_dt(dtype)) * 1.5 + 0.3
    return x, torch.randn(num_samples, OUT, dtype=_dt(dtype)) * 0.5


def heldout_loader(num_samples: int = HELD_OUT) -> Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`heldout`'s samples behind ``load(indices)`` (the job gives ``eval.num_samples``)."""
    x, y = heldout(num_samples=num_samples)

    def load(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(indices)
        return x[index], y[index]

    return load


def raising_heldout() -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("the held-out file is missing (injected)")


def misfit_heldout() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs two features wider than the models take."""
    return torch.randn(8, IN + 2, dtype=torch.float64), torch.randn(8, OUT, dtype=torch.float64)


def abs_error() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The metric as one value per sample: its mean absolute error over the outputs."""
    def metric(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (output - targets).abs().mean(dim=1)

    return metric


def whole_batch_metric() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A metric returning a [2] tensor whatever the samples: neither per sample nor one value."""
    return lambda output, targets: output.new_zeros(2)


def failing_metric() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A metric that raises on any output."""
    def metric(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise ValueError("the metric cannot handle these outputs (injected)")

    return metric


class SeededDropout(nn.Module):
    """Dropout whose masks come from its own generator (seeded when built); the identity in eval mode."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p = p
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = torch.rand(x.shape, generator=self.generator, dtype=x.dtype) >= self.p
        return x * keep / (1 - self.p)


def bn_model(dtype: str = "float64") -> list[nn.Module]:
    """Linear, BatchNorm, tanh, dropout, linear: five cells, whose statistics and masks depend on the mode."""
    cells = [Cell("lin", nn.Linear(IN, HIDDEN)), Cell("bn", nn.BatchNorm1d(HIDDEN)), Cell("act", nn.Tanh()),
             Cell("drop", SeededDropout(0.3, seed=11)), Cell("head", nn.Linear(HIDDEN, OUT))]
    return [c.to(_dt(dtype)) for c in cells]
