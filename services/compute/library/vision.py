"""Cells of a convolutional image classifier: conv block, residual block, pooling classifier head.

A small ResNet is written as::

    model = [ConvBlock("stem", 3, 16),
             ResidualBlock("block0", 16, 16),
             ResidualBlock("block1", 16, 32, stride=2),
             ClassifierHead("head", 32, classes)]

Shapes: images ``(batch, channels, height, width)``; every convolution pads by
``kernel_size // 2``, so a stride-1 cell keeps the height and width and a stride-``s`` cell
makes them ``ceil(size / s)``; the head pools them away: ``(batch, classes)``.

Norms: ``"group"`` (``nn.GroupNorm``, the default: it normalizes each sample on its own, so
a microbatch computes what the whole batch computes), ``"batch"`` (``nn.BatchNorm2d``: its
statistics are the batch's, so what it computes depends on how the runtime splits a batch;
see the runtime's BatchNorm semantics) or ``"none"``. A convolution followed by a norm has no
bias (the norm's shift replaces it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from services.compute.cell import Cell
from services.compute.library.checks import choice, label, positive, probability, require
from services.compute.library.common import activation_layer

__all__ = ["NORMS_2D", "ClassifierHead", "ConvBlock", "ResidualBlock"]

NORMS_2D = ("group", "batch", "none")
GROUPS = 8  # GroupNorm's default group count: gcd(8, channels) groups


def _norm2d(cell: str, kind: str, channels: int, groups: int | None) -> nn.Module:
    if kind == "group":
        groups = math.gcd(GROUPS, channels) if groups is None else groups
        require(channels % groups == 0, cell, f"norm_groups={groups} does not divide {channels} channels")
        return nn.GroupNorm(groups, channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.Identity()


class _ConvNormAct(nn.Module):
    """Conv2d (``conv``, padding ``kernel_size // 2``), norm (``norm``), activation (``act``; None: none)."""

    def __init__(self, cell: str, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 norm: str, groups: int | None, act: nn.Module | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2,
                              bias=norm == "none")
        self.norm = _norm2d(cell, norm, out_channels, groups)
        self.act = act if act is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.norm(self.conv(x)))
        return out


class _Residual(nn.Module):
    def __init__(self, cell: str, in_channels: int, out_channels: int, stride: int, norm: str,
                 groups: int | None, activation: str) -> None:
        super().__init__()
        self.conv1 = _ConvNormAct(cell, in_channels, out_channels, 3, stride, norm, groups,
                                 activation_layer(cell, activation))
        self.conv2 = _ConvNormAct(cell, out_channels, out_channels, 3, 1, norm, groups, None)
        project = stride != 1 or in_channels != out_channels
        self.skip: nn.Module = (_ConvNormAct(cell, in_channels, out_channels, 1, stride, norm, groups, None)
                                if project else nn.Identity())
        self.act = activation_layer(cell, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.conv2(self.conv1(x)) + self.skip(x))
        return out


class _Classifier(nn.Module):
    def __init__(self, channels: int, classes: int, pool: str, dropout: float) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1) if pool == "avg" else nn.AdaptiveMaxPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.drop(self.pool(x).flatten(1)))
        return logits


def _check_conv(cell: str, norm: str, norm_groups: int | None, **sizes: int) -> None:
    positive(cell, **sizes)
    choice(cell, "norm", norm, NORMS_2D)
    if norm_groups is not None:
        positive(cell, norm_groups=norm_groups)


class ConvBlock(Cell):
    """Convolution, norm, activation: ``(batch, in_channels, h, w)`` -> ``(batch, out_channels, h', w')``.

    ``h' = ceil(h / stride)`` (padding ``kernel_size // 2``, an odd kernel). A network's stem,
    or a plain (non-residual) layer.

    Args:
        name: The cell's name.
        in_channels: The input's channels.
        out_channels: The output's channels.
        kernel_size: The (square, odd) kernel's side.
        stride: The convolution's stride.
        norm: ``"group"`` (default), ``"batch"`` or ``"none"`` (see the module docstring).
        norm_groups: GroupNorm's groups (default ``gcd(8, out_channels)``); must divide ``out_channels``.
        activation: ``"relu"`` (default), ``"gelu"``, ``"silu"`` or ``"tanh"``.

    Parameters: ``{name}.conv.weight`` (``{name}.conv.bias`` with ``norm="none"``),
    ``{name}.norm.weight`` and ``.bias``.

    Raises:
        ValueError: A size below 1, an even kernel, an unknown norm or activation, or groups
            not dividing the channels.
    """

    def __init__(self, name: str, in_channels: int, out_channels: int, *, kernel_size: int = 3,
                 stride: int = 1, norm: str = "group", norm_groups: int | None = None,
                 activation: str = "relu") -> None:
        cell = label("ConvBlock", name)
        _check_conv(cell, norm, norm_groups, in_channels=in_channels, out_channels=out_channels,
                    kernel_size=kernel_size, stride=stride)
        require(kernel_size % 2 == 1, cell, f"kernel_size must be odd (the padding keeps the size), got "
                f"{kernel_size}")
        super().__init__(name, _ConvNormAct(cell, in_channels, out_channels, kernel_size, stride, norm,
                                           norm_groups, activation_layer(cell, activation)))


class ResidualBlock(Cell):
    """A basic residual block: ``(batch, in_channels, h, w)`` -> ``(batch, out_channels, h', w')``.

    ``h' = ceil(h / stride)``. ``act(conv2(conv1(x)) + skip(x))``: ``conv1`` is 3x3 conv
    (``stride``), norm, activation; ``conv2`` is 3x3 conv, norm. The skip is the identity when
    the shape is kept and a projection (1x1 conv with ``stride``, norm) when the channels or the
    stride change.

    Args:
        name: The cell's name.
        in_channels: The input's channels.
        out_channels: The output's channels.
        stride: The first convolution's (and the projection's) stride.
        norm: ``"group"`` (default), ``"batch"`` or ``"none"``; ``norm_groups`` as in :class:`ConvBlock`.
        activation: ``"relu"`` (default), ``"gelu"``, ``"silu"`` or ``"tanh"``.

    Parameters: ``{name}.conv1.*``, ``{name}.conv2.*`` (each ``conv.weight``, ``norm.*``) and,
    with a projection, ``{name}.skip.*``.

    Raises:
        ValueError: A size below 1, an unknown norm or activation, or groups not dividing the channels.
    """

    def __init__(self, name: str, in_channels: int, out_channels: int, *, stride: int = 1,
                 norm: str = "group", norm_groups: int | None = None, activation: str = "relu") -> None:
        cell = label("ResidualBlock", name)
        _check_conv(cell, norm, norm_groups, in_channels=in_channels, out_channels=out_channels,
                    stride=stride)
        super().__init__(name, _Residual(cell, in_channels, out_channels, stride, norm, norm_groups,
                                         activation))


class ClassifierHead(Cell):
    """Global pooling, dropout, linear: ``(batch, channels, h, w)`` -> logits ``(batch, classes)``.

    Args:
        name: The cell's name.
        channels: The input's channels.
        classes: The number of classes.
        pool: ``"avg"`` (default) or ``"max"`` over each channel's ``h x w``.
        dropout: On the pooled features (training only).

    Parameters: ``{name}.out.weight`` (``classes x channels``) and ``{name}.out.bias``.

    Raises:
        ValueError: A size below 1, an unknown pool or a dropout outside ``[0, 1)``.
    """

    def __init__(self, name: str, channels: int, classes: int, *, pool: str = "avg",
                 dropout: float = 0.0) -> None:
        cell = label("ClassifierHead", name)
        positive(cell, channels=channels, classes=classes)
        choice(cell, "pool", pool, ("avg", "max"))
        probability(cell, dropout=dropout)
        super().__init__(name, _Classifier(channels, classes, pool, dropout))
