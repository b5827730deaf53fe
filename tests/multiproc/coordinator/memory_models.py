"""A wide MLP for the memory tests: ``depth`` tanh blocks of ``width`` (float32 by default)."""

from __future__ import annotations

import torch
from torch import nn

from tests.multiproc.coordinator.models import IN, OUT


def wide_mlp(width: int = 1024, depth: int = 4, dtype: str = "float32") -> list[nn.Module]:
    """An input layer, ``depth`` blocks ``Linear(width, width), Tanh``, a head: ``depth + 2`` cells."""
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    return [m.to(dt) for m in (nn.Linear(IN, width), *blocks, nn.Linear(width, OUT))]
