"""Models, data and losses the compute-service tests name as factories (workers and references import them).

All float64, so a pipeline and a single process agree to rounding. Sample counts and
widths are small: the tests are about plumbing, not speed.
"""

from __future__ import annotations

import torch
from torch import nn

from services.compute.cell import Cell

__all__ = ["IN", "NUM_SAMPLES", "OUT", "mlp", "mse", "regression", "skip_model"]

IN, HIDDEN, OUT = 6, 10, 3
NUM_SAMPLES = 32


def mlp() -> list[nn.Module]:
    """Five plain modules (cells ``cell0``..``cell4``); a tensor crosses any cut."""
    return [nn.Linear(IN, HIDDEN).double(), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN).double(), nn.Tanh(),
            nn.Linear(HIDDEN, OUT).double()]


class Stem(nn.Module):
    """x -> (h, skip): a tuple of two tensors that both need gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN).double()
        self.b = nn.Linear(IN, HIDDEN).double()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.a(x)), self.b(x)


class Mix(nn.Module):
    """(h, skip) -> {"h", "skip", "pos"}: ``pos`` is an int64 mask, no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(HIDDEN, HIDDEN).double()

    def forward(self, hs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, skip = hs
        return {"h": torch.tanh(self.c(h)), "skip": skip, "pos": (h > 0).long()}


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Linear(HIDDEN, HIDDEN).double()

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(self.d(x["h"] * x["pos"] + x["skip"]))


def skip_model() -> list[Cell]:
    """Four named cells; cut 1 crosses a tuple, cut 2 a dict with an integer tensor."""
    return [Cell("stem", Stem()), Cell("mix", Mix()), Cell("merge", Merge()),
            Cell("head", nn.Linear(HIDDEN, OUT).double())]


def regression(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets (the caller seeds)."""
    return (torch.randn(num_samples, IN, dtype=torch.float64),
            torch.randn(num_samples, OUT, dtype=torch.float64))


def mse() -> nn.Module:
    return nn.MSELoss()
