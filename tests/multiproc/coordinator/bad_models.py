"""Factories of jobs a new user gets wrong: each must be refused with one clear line (see test_bad_jobs.py).

The good parts are ``models.py``'s (the MLP, its regression data, the MSE loss); each factory
here breaks one thing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.multiproc.coordinator.models import HIDDEN, IN, NUM_SAMPLES, OUT, regression

HUGE_WIDTH = 200_000  # a Linear of 4e10 parameters: 160 GB, more than any test machine has


def raising() -> list[nn.Module]:
    """A model factory with a bug in it."""
    raise RuntimeError("the width must be even")


def misfit() -> list[nn.Module]:
    """Cells whose sizes do not fit: the last Linear takes HIDDEN + 2 features, the Tanh gives HIDDEN."""
    return [nn.Linear(IN, HIDDEN).double(), nn.Tanh(), nn.Linear(HIDDEN + 2, OUT).double()]


def uneven() -> tuple[torch.Tensor, torch.Tensor]:
    """256 inputs but 200 targets."""
    return torch.randn(256, IN, dtype=torch.float64), torch.randn(200, OUT, dtype=torch.float64)


class Plain(nn.Module):
    """A model as a user writes it first: one module with its layers inside."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def plain() -> nn.Module:
    return Plain().double()


class Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


class Gated(Plain):
    """A plain model with an untraceable submodule between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(torch.tanh(self.a(x))))


def gated() -> nn.Module:
    return Gated().double()


def one_linear() -> nn.Module:
    """One cell: a plan has one stage, so only the data-parallel degree can use more workers."""
    return nn.Linear(IN, OUT).double()


def huge() -> list[nn.Module]:
    """Far too big for any worker (1.6e11 parameters); cheap to build on the meta device only."""
    return [nn.Linear(HUGE_WIDTH, HUGE_WIDTH) for _ in range(4)]


def huge_data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(NUM_SAMPLES, 1), torch.zeros(NUM_SAMPLES, 1)


def not_on_meta() -> list[nn.Module]:
    """A model whose factory reads a parameter's value (``.item()``), which the meta device cannot give."""
    first = nn.Linear(IN, HIDDEN).double()
    if first.weight.abs().max().item() > 1e9:
        raise AssertionError("unreachable")
    return [first, nn.Tanh(), nn.Linear(HIDDEN, OUT).double()]


def nan_at(indices: list[int], value: str = "nan") -> tuple[torch.Tensor, torch.Tensor]:
    """``regression()`` with ``float(value)`` (``"nan"``, ``"inf"``) in the inputs at ``indices``."""
    x, y = regression()
    x[indices] = float(value)
    return x, y


def mismatched_loss() -> object:
    """A loss that multiplies the output by the targets as matrices: their shapes do not allow it."""
    return torch.mm


class SqrtAbs(nn.Module):
    """``sqrt(|x|)``: finite at 0, its gradient there is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().sqrt()


def infinite_gradient() -> list[nn.Module]:
    """A finite loss whose gradients are NaN: a Linear of zeros feeds ``sqrt(|x|)`` at 0."""
    first = nn.Linear(IN, HIDDEN).double()
    nn.init.zeros_(first.weight)
    nn.init.zeros_(first.bias)
    return [first, SqrtAbs(), nn.Linear(HIDDEN, OUT).double()]


def sparse_embedding(sparse: bool = True) -> list[nn.Module]:
    """An embedding built with ``sparse=True`` (its gradient a sparse tensor) before a Linear."""
    return [nn.Embedding(10, IN, sparse=sparse).double(), nn.Flatten(), nn.Linear(IN, OUT).double()]


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids for ``sparse_embedding``: one token per sample, and regression targets."""
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, 10, (NUM_SAMPLES, 1), generator=g),
            torch.randn(NUM_SAMPLES, OUT, generator=g, dtype=torch.float64))


class LookedUp(nn.Module):
    """A table looked up with ``F.embedding(..., sparse=True)``: no ``nn.Embedding`` layer to find."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.sparse = sparse
        self.table = nn.Parameter(torch.randn(10, IN, dtype=torch.float64))
        self.out = nn.Linear(IN, OUT).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.embedding(x, self.table, sparse=self.sparse).flatten(1))


def looked_up(sparse: bool = True) -> nn.Module:
    """``LookedUp``: its table's gradient is sparse unless ``sparse=False``."""
    return LookedUp(sparse)


def frozen(everything: bool = True) -> list[nn.Module]:
    """Two Linears, every parameter frozen (``everything``) or only the first layer's."""
    layers = [nn.Linear(IN, HIDDEN).double(), nn.Tanh(), nn.Linear(HIDDEN, OUT).double()]
    for layer in layers[:3 if everything else 1]:
        layer.requires_grad_(False)
    return layers


class Detached(nn.Module):
    """A Linear whose output is detached: the loss depends on no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).detach()


def detached() -> nn.Module:
    """``Detached``."""
    return Detached()


class Rounded(nn.Module):
    """A Linear whose output goes through a custom function whose backward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NoBackward.apply(self.layer(x))


class NoBackward(torch.autograd.Function):
    """The identity forward; its backward raises, as an op without a derivative does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the derivative for 'round_up' is not implemented")


def no_backward() -> nn.Module:
    """``Rounded``."""
    return Rounded()
