"""The vision cells: a small ResNet of cells equals the same layers written by hand in torch with the same
seed, shapes follow the strides, parameters are named by cell, and bad arguments name the cell."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from services.compute.cell import cell_parameters
from services.compute.library import ClassifierHead, ConvBlock, ResidualBlock


def _names(cell: nn.Module) -> list[str]:
    return [n for n, _ in cell_parameters([cell])]  # type: ignore[list-item]


def test_conv_block_is_conv_groupnorm_relu() -> None:
    torch.manual_seed(0)
    cell = ConvBlock("stem", 3, 12, stride=2)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 12, 3, 2, 1, bias=False), nn.GroupNorm(4, 12), nn.ReLU())
    x = torch.randn(2, 3, 9, 9)
    out = cell(x)
    assert out.shape == (2, 12, 5, 5)  # ceil(9 / 2)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert _names(cell) == ["stem.conv.weight", "stem.norm.weight", "stem.norm.bias"]


def test_conv_block_norm_choices() -> None:
    plain = ConvBlock("c", 2, 4, kernel_size=5, norm="none", activation="gelu")
    assert _names(plain) == ["c.conv.weight", "c.conv.bias"]
    assert plain(torch.randn(1, 2, 6, 6)).shape == (1, 4, 6, 6)
    assert isinstance(ConvBlock("c", 2, 4, norm="batch").module.norm, nn.BatchNorm2d)
    grouped = ConvBlock("c", 2, 8, norm_groups=2).module.norm
    assert isinstance(grouped, nn.GroupNorm) and grouped.num_groups == 2


def _hand_residual(cin: int, cout: int, stride: int) -> tuple[nn.Module, ...]:
    """conv1 (conv, norm), conv2 (conv, norm), and the projection (conv, norm) if the shape changes."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(8, cout),
                               nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.GroupNorm(8, cout)]
    if stride != 1 or cin != cout:
        layers += [nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.GroupNorm(8, cout)]
    return tuple(layers)


def _run_hand_residual(layers: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    c1, n1, c2, n2, *proj = layers
    skip = proj[1](proj[0](x)) if proj else x
    out: torch.Tensor = torch.relu(n2(c2(torch.relu(n1(c1(x))))) + skip)
    return out


@pytest.mark.parametrize(("cin", "cout", "stride"), [(8, 8, 1), (8, 16, 2), (8, 16, 1)])
def test_residual_block_equals_the_layers_written_by_hand(cin: int, cout: int, stride: int) -> None:
    torch.manual_seed(1)
    cell = ResidualBlock("block", cin, cout, stride=stride)
    torch.manual_seed(1)
    layers = _hand_residual(cin, cout, stride)
    x = torch.randn(2, cin, 7, 7)
    out = cell(x)
    assert out.shape == (2, cout, -(-7 // stride), -(-7 // stride))
    torch.testing.assert_close(out, _run_hand_residual(layers, x), rtol=0, atol=0)
    projected = len(layers) == 6
    assert ("block.skip.conv.weight" in _names(cell)) == projected
    assert _names(cell)[:3] == ["block.conv1.conv.weight", "block.conv1.norm.weight", "block.conv1.norm.bias"]


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_classifier_head_pools_then_maps_to_classes(pool: str) -> None:
    torch.manual_seed(2)
    cell = ClassifierHead("head", 6, 3, pool=pool)
    torch.manual_seed(2)
    linear = nn.Linear(6, 3)
    x = torch.randn(4, 6, 5, 5)
    pooled = x.mean((2, 3)) if pool == "avg" else x.amax((2, 3))
    torch.testing.assert_close(cell(x), linear(pooled), rtol=1e-6, atol=1e-6)
    assert _names(cell) == ["head.out.weight", "head.out.bias"]


def test_a_resnet_of_cells_equals_the_same_layers_written_by_hand() -> None:
    torch.manual_seed(3)
    cells = [ConvBlock("stem", 3, 8), ResidualBlock("block0", 8, 8), ResidualBlock("block1", 8, 16, stride=2),
             ClassifierHead("head", 16, 5)]
    torch.manual_seed(3)
    stem = (nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.GroupNorm(8, 8))
    block0, block1 = _hand_residual(8, 8, 1), _hand_residual(8, 16, 2)
    head = nn.Linear(16, 5)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    net = nn.Sequential(*cells).double()
    for m in (*stem, *block0, *block1, head):
        m.double()
    h = torch.relu(stem[1](stem[0](x)))
    h = _run_hand_residual(block1, _run_hand_residual(block0, h))
    torch.testing.assert_close(net(x), head(h.mean((2, 3))), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: ConvBlock("c", 3, 8, kernel_size=4), "ConvBlock 'c': kernel_size must be odd"),
    (lambda: ConvBlock("c", 3, 8, norm="layer"), "ConvBlock 'c': norm must be one of 'batch', 'group', 'n"),
    (lambda: ConvBlock("c", 3, 8, norm_groups=3), "ConvBlock 'c': norm_groups=3 does not divide 8 channels"),
    (lambda: ConvBlock("c", 0, 8), "ConvBlock 'c': in_channels must be a positive integer, got 0"),
    (lambda: ResidualBlock("r", 8, 8, stride=0), "ResidualBlock 'r': stride must be a positive integer"),
    (lambda: ResidualBlock("r", 8, 8, activation="elu"), "ResidualBlock 'r': activation must be one of"),
    (lambda: ClassifierHead("h", 8, 0), "ClassifierHead 'h': classes must be a positive integer, got 0"),
    (lambda: ClassifierHead("h", 8, 2, pool="min"), "ClassifierHead 'h': pool must be one of 'avg', 'max'"),
])
def test_bad_arguments_are_refused_naming_the_cell_and_the_argument(build: Callable[[], object],
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
