"""A model whose forward sleeps on the worker told to (``ASYNC_TEST_DELAY_S``): a slow replica on demand.

The data and loss are ``models.py``'s (``regression``, ``mse``).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from tests.multiproc.coordinator.models import mlp

__all__ = ["DELAY_ENV", "slowed_mlp"]

DELAY_ENV = "ASYNC_TEST_DELAY_S"


class EnvSleep(nn.Module):
    """Identity that sleeps ``ASYNC_TEST_DELAY_S`` seconds per forward (0 where it is not set)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(float(os.environ.get(DELAY_ENV, "0")))
        return x


def slowed_mlp(dtype: str = "float64") -> list[nn.Module]:
    """``models.mlp`` with an :class:`EnvSleep` cell after its first layer."""
    cells = mlp(dtype)
    return [cells[0], EnvSleep(), *cells[1:]]
