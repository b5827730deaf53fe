"""Cells any model uses: a multilayer perceptron, a normalization chosen by name, dropout.

Also the building blocks the other families share: :func:`activation_layer` and :func:`norm_layer`
(a layer by name, so a YAML spec can choose one) and :class:`Perceptron` (the linear layers
of an MLP, also the feed-forward half of :class:`~services.compute.library.text.TransformerBlock`).

Every layer is torch's own with torch's default initialization, so a cell model built under a
seed equals the same layers written by hand in torch, built in the same order under that seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from services.compute.cell import Cell
from services.compute.library.checks import choice, label, positive, probability, require

__all__ = ["ACTIVATIONS", "MLP", "NORMS", "Dropout", "Norm", "Perceptron", "activation_layer", "norm_layer"]

ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}
NORMS = ("layernorm", "rmsnorm")


def activation_layer(cell: str, name: str) -> nn.Module:
    """The activation called ``name`` (a key of :data:`ACTIVATIONS`); ``cell`` names the caller in errors."""
    choice(cell, "activation", name, ACTIVATIONS)
    return ACTIVATIONS[name]()


def norm_layer(cell: str, kind: str, width: int, eps: float) -> nn.Module:
    """``nn.LayerNorm`` (``"layernorm"``) or ``nn.RMSNorm`` (``"rmsnorm"``) over the last dimension."""
    choice(cell, "norm", kind, NORMS)
    require(isinstance(eps, float | int) and eps > 0, cell, f"eps must be a positive number, got {eps!r}")
    if kind == "layernorm":
        return nn.LayerNorm(width, eps=eps)
    return nn.RMSNorm(width, eps=eps)


class Perceptron(nn.Module):
    """Linear layers of ``sizes`` (parameters ``layers.{i}.weight``/``.bias``), the activation and
    dropout between them: ``(..., sizes[0])`` -> ``(..., sizes[-1])``.

    Dropout follows each hidden activation (none after the last layer). ``nn.Dropout(0.0)``
    returns its input and draws no random numbers, so ``dropout=0`` costs nothing.
    """

    def __init__(self, sizes: Sequence[int], act: nn.Module, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(n_in, n_out, bias=bias)
                                    for n_in, n_out in itertools.pairwise(sizes))
        self.act = act
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                x = self.drop(self.act(x))
            x = layer(x)
        return x


class MLP(Cell):
    """Linear layers with an activation between them: ``(..., sizes[0])`` -> ``(..., sizes[-1])``.

    Args:
        name: The cell's name.
        sizes: The feature sizes, input first: ``[4, 16, 2]`` is Linear(4, 16), act, Linear(16, 2).
        activation: ``"gelu"`` (default), ``"relu"``, ``"silu"`` or ``"tanh"``.
        dropout: The probability of dropping a hidden activation (training only).
        bias: Whether the linear layers have biases.

    Parameters: ``{name}.layers.{i}.weight`` and ``.bias``, layer ``i`` mapping ``sizes[i]`` to
    ``sizes[i + 1]``.

    Raises:
        ValueError: Fewer than two sizes, a size below 1, an unknown activation or a dropout
            outside ``[0, 1)``.
    """

    def __init__(self, name: str, sizes: Sequence[int], *, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True) -> None:
        cell = label("MLP", name)
        require(len(sizes) >= 2, cell,
                f"an MLP needs at least an input and an output size, got sizes={list(sizes)}")
        positive(cell, **{f"sizes[{i}]": s for i, s in enumerate(sizes)})
        probability(cell, dropout=dropout)
        act = activation_layer(cell, activation)
        super().__init__(name, Perceptron(sizes, act, dropout, bias))


class Norm(Cell):
    """A normalization over the last dimension by name: ``(..., width)`` in and out.

    Args:
        name: The cell's name.
        width: The size of the last dimension.
        kind: ``"layernorm"`` (``nn.LayerNorm``: weight and bias) or ``"rmsnorm"``
            (``nn.RMSNorm``: weight only).
        eps: Added to the variance (mean square) for stability.

    Parameters: ``{name}.weight`` (and ``{name}.bias`` for ``"layernorm"``).

    Raises:
        ValueError: ``width`` below 1, an unknown ``kind`` or ``eps`` not positive.
    """

    def __init__(self, name: str, width: int, *, kind: str = "layernorm", eps: float = 1e-5) -> None:
        cell = label("Norm", name)
        positive(cell, width=width)
        super().__init__(name, norm_layer(cell, kind, width, eps))


class Dropout(Cell):
    """Zeroes each element with probability ``p`` while training (and scales the rest by ``1 / (1 - p)``).

    Any shape in, the same shape out; no parameters. In evaluation it returns its input.

    Raises:
        ValueError: ``p`` outside ``[0, 1)``.
    """

    def __init__(self, name: str, p: float) -> None:
        probability(label("Dropout", name), p=p)
        super().__init__(name, nn.Dropout(p))

