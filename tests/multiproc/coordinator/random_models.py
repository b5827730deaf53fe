"""Factories of models whose training forward is random (dropout) or batch-coupled (BatchNorm).

The data and loss are ``models.py``'s (``regression``, ``mse``, ``tokens``, ``token_loss``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.compute.cell import Cell
from tests.multiproc.coordinator.models import HIDDEN, IN, OUT, WIDTH, Embed, Head, _dt


class DropBlock(nn.Module):
    """A residual block dropping with ``F.dropout`` inside its forward and with an ``nn.Dropout``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.drop = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.fc(x)), self.p, self.training)
        return self.drop(h) + x


def dropout_mlp(dtype: str = "float64", p: float = 0.3) -> list[nn.Module]:
    """Five cells: in, three dropping blocks, out (the blocks' draws cross every cut)."""
    cells = [nn.Linear(IN, HIDDEN), DropBlock(p), DropBlock(p), DropBlock(p), nn.Linear(HIDDEN, OUT)]
    return [c.to(_dt(dtype)) for c in cells]


def dropout_transformer(dtype: str = "float64", p: float = 0.2) -> list[nn.Module]:
    """Embedding, two encoder blocks with attention and residual dropout, head: four cells."""
    blocks = [nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=p,
                                         batch_first=True) for _ in range(2)]
    cells = [Cell("embed", Embed()), Cell("block0", blocks[0]), Cell("block1", blocks[1]),
             Cell("head", Head())]
    return [c.to(_dt(dtype)) for c in cells]


def bn_net(dtype: str = "float64") -> list[nn.Module]:
    """Conv, BatchNorm2d, tanh, flatten, linear, BatchNorm1d (cumulative average), linear: seven cells."""
    cells = [nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(), nn.Linear(48, HIDDEN),
             nn.BatchNorm1d(HIDDEN, momentum=None), nn.Linear(HIDDEN, OUT)]
    return [c.to(_dt(dtype)) for c in cells]


def images(dtype: str = "float64", num_samples: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 2x4x4 images with a non-zero mean (so the normalisation matters) and random targets."""
    return (torch.randn(num_samples, 2, 4, 4, dtype=_dt(dtype)) * 2 + 1,
            torch.randn(num_samples, OUT, dtype=_dt(dtype)))


class SequenceFirst(nn.Module):
    """Repeats each sample 3 times along a leading sequence dim, drops, averages: dropout on (3, n, h)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x.unsqueeze(0).expand(3, -1, -1)).mean(0)


def sequence_first(dtype: str = "float64") -> list[nn.Module]:
    """Three cells, the middle one dropping with the batch on dim 1 (refused by the preflight)."""
    return [nn.Linear(IN, HIDDEN).to(_dt(dtype)), SequenceFirst(), nn.Linear(HIDDEN, OUT).to(_dt(dtype))]


class PlainDropping(nn.Module):
    """A plain module (no cells) whose residual blocks ``a`` and ``c`` sit on the root, so torch.fx traces
    into them, and draw with ``F.dropout`` there."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.a = DropBlock(p)
        self.c = DropBlock(p)
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.c(self.a(self.inp(x))))


def plain_dropping(dtype: str = "float64", p: float = 0.3) -> nn.Module:
    return PlainDropping(p).to(_dt(dtype))
