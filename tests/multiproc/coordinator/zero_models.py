"""A model of mixed parameter shapes for the sharding tests: a 0-dim scale, biases and matrices whose
dim 0 (7, 5, 3) no group of 2 or 4 replicas divides."""

from __future__ import annotations

import torch
from torch import nn

from tests.multiproc.coordinator.models import IN, OUT


class Scale(nn.Module):
    """``x * s`` with a learnable 0-dim ``s``."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def mixed(dtype: str = "float64") -> list[nn.Module]:
    """Six cells: Linear(6, 7), tanh, a scalar scale, Linear(7, 5), tanh, Linear(5, 3)."""
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    return [m.to(dt) for m in (nn.Linear(IN, 7), nn.Tanh(), Scale(), nn.Linear(7, 5), nn.Tanh(),
                               nn.Linear(5, OUT))]
