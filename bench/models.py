"""Factories ``bench/train.py`` names: its models as cell sequences, their data.

The workers of a cellmesh job import these by name (``bench.models:mlp``), and the torch
peers build the same modules from the same functions (seeded alike, see
``coordinator.runtime.factories.build_model``), so every configuration of the benchmark trains the
same model from the same initial parameters on the same samples.
"""

from __future__ import annotations

import torch
from torch import nn

from services.compute.cell import Cell

__all__ = ["UNEVEN_LAYERS", "WIDTH", "block", "mlp", "regression", "uneven"]

WIDTH = 1024
# Linear+GELU layers per cell of the uneven model: 12 layers in 8 cells, the heavy ones last.
# An even split by cells ([4, 4]) gives the stages 4 and 8 layers; the best cut ([6, 2]) 6 and 6.
UNEVEN_LAYERS = (1, 1, 1, 1, 1, 1, 3, 3)


def block(num_layers: int = 1, width: int = WIDTH) -> nn.Sequential:
    """``num_layers`` x (Linear(width, width) + GELU)."""
    layers: list[nn.Module] = []
    for _ in range(num_layers):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def mlp(num_cells: int = 8, width: int = WIDTH) -> list[Cell]:
    """The benchmarks' baseline: 8 cells of Linear(1024, 1024) + GELU (8.4 M parameters)."""
    return [Cell(f"block{i}", block(1, width)) for i in range(num_cells)]


def uneven(layers: tuple[int, ...] | list[int] = UNEVEN_LAYERS, width: int = WIDTH) -> list[Cell]:
    """Cells of unequal cost: cell ``i`` is ``layers[i]`` x (Linear + GELU); ``[B, width]`` crosses cuts."""
    return [Cell(f"block{i}", block(n, width)) for i, n in enumerate(layers)]


def regression(num_samples: int = 256, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets, ``[num_samples, width]`` each (float32)."""
    return torch.randn(num_samples, width), torch.randn(num_samples, width)
