"""A model of mixed parameter shapes for the sharding tests: a 0-dim scale, biases and matrices whose
dim 0 (7, 5, 3) no group of 2 or 4 replicas divides."""

from __future__ import annotations

import torch
from torch import nn

from tests.multiproc.coordinator.models import IN, OUT


class Scale(nn.Module):
    """``x * s * g`` with a learnable 0-dim ``s`` and a frozen parameter ``g``."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.9))
        self.g = nn.Parameter(torch.tensor(1.1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s * self.g


class Cast(nn.Module):
    """Its input in ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def mixed(dtype: str = "float64") -> list[nn.Module]:
    """Six cells: Linear(6, 7), tanh, a scalar scale (and a frozen one), Linear(7, 5), tanh, Linear(5, 3)."""
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    return [m.to(dt) for m in (nn.Linear(IN, 7), nn.Tanh(), Scale(), nn.Linear(7, 5), nn.Tanh(),
                               nn.Linear(5, OUT))]


def mixed_dtypes(dtype: str = "float64") -> list[nn.Module]:
    """float64 layers around a float32 one: Linear(6, 7), tanh, to float32, Linear(7, 5) in float32,
    to float64, Linear(5, 3). ``dtype`` is the outer layers'."""
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    return [nn.Linear(IN, 7).to(dt), nn.Tanh(), Cast(torch.float32), nn.Linear(7, 5), Cast(dt),
            nn.Linear(5, OUT).to(dt)]


def wide(dtype: str = "float64") -> list[nn.Module]:
    """Linear(6, 128), tanh, Linear(128, 1024), tanh, Linear(1024, 3): the middle weight is 1 MiB in
    float64 with rows that split evenly over 2 and 4, so ZeRO-2 reduce-scatters its gradient as it is and
    ZeRO-1/2 gather it in place (the notes in ``services/params/grad_sync.py`` and ``commit_gather.py``)."""
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    return [m.to(dt) for m in (nn.Linear(IN, 128), nn.Tanh(), nn.Linear(128, 1024), nn.Tanh(),
                               nn.Linear(1024, OUT))]


class OwnParams(nn.Module):
    """A plain module (traced) whose forward uses parameters no one leaf module holds: a gain and a 0-dim
    temperature of its own, a weight two layers share, and a layer's weight read again by the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, 8)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.mid = nn.Linear(8, 8)
        self.again = nn.Linear(8, 8)
        self.again.weight = self.mid.weight  # tied: two leaf modules, one parameter
        self.down = nn.Linear(8, OUT)
        self.temp = nn.Parameter(torch.tensor(1.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x)) * self.gain
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.again(h))
        return self.down(h) * self.temp + 0.01 * self.down.weight.sum()


def own_params(dtype: str = "float64") -> nn.Module:
    """:class:`OwnParams` in ``dtype``: its nodes up, gain, mid, again, down and the forward's own ops."""
    return OwnParams().to({"float64": torch.float64, "float32": torch.float32}[dtype])
