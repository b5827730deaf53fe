"""The common cells (MLP, Norm, Dropout): equal to torch's layers written by hand, named by cell, and
refusing bad arguments by naming the cell and the argument; the facade exports the whole library."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import cellmesh
from services.compute import library
from services.compute.cell import cell_parameters
from services.compute.library import MLP, Dropout, Norm


def test_mlp_matches_the_layers_it_names() -> None:
    torch.manual_seed(1)
    cell = MLP("mlp", [4, 16, 2])
    torch.manual_seed(1)
    reference = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))
    x = torch.randn(5, 4)
    torch.testing.assert_close(cell(x), reference(x), rtol=0, atol=0)


def test_a_deeper_mlp_with_another_activation_and_no_bias_matches_torch() -> None:
    torch.manual_seed(2)
    cell = MLP("mlp", [3, 8, 8, 5], activation="relu", bias=False)
    torch.manual_seed(2)
    reference = nn.Sequential(nn.Linear(3, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False), nn.ReLU(),
                              nn.Linear(8, 5, bias=False))
    x = torch.randn(2, 7, 3)
    torch.testing.assert_close(cell(x), reference(x), rtol=0, atol=0)
    assert [n for n, _ in cell_parameters([cell])] == ["mlp.layers.0.weight", "mlp.layers.1.weight",
                                                       "mlp.layers.2.weight"]


def test_mlp_dropout_acts_while_training_only() -> None:
    torch.manual_seed(3)
    cell = MLP("mlp", [4, 64, 4], dropout=0.5)
    torch.manual_seed(3)
    plain = MLP("plain", [4, 64, 4])
    x = torch.randn(8, 4)
    assert not torch.allclose(cell(x), plain(x))  # a training cell drops hidden units
    cell.eval()
    torch.testing.assert_close(cell(x), plain(x), rtol=0, atol=0)


def test_no_dropout_draws_no_random_numbers() -> None:
    """``dropout=0`` keeps the RNG untouched: a plan and one process stay in step."""
    cell = MLP("mlp", [4, 8, 4])
    before = torch.get_rng_state()
    cell(torch.ones(2, 4))
    assert torch.equal(before, torch.get_rng_state())


def test_layernorm_is_torchs() -> None:
    torch.manual_seed(0)
    cell = Norm("norm", 6)
    nn.init.normal_(cell.module.weight)
    nn.init.normal_(cell.module.bias)
    reference = nn.LayerNorm(6)
    reference.load_state_dict(cell.module.state_dict())
    x = torch.randn(3, 6)
    torch.testing.assert_close(cell(x), reference(x), rtol=0, atol=0)
    assert [n for n, _ in cell_parameters([cell])] == ["norm.weight", "norm.bias"]


def test_rmsnorm_divides_by_the_root_mean_square() -> None:
    cell = Norm("rms", 5, kind="rmsnorm", eps=1e-6).double()
    with torch.no_grad():
        cell.module.weight.copy_(torch.arange(1.0, 6.0))
    x = torch.randn(4, 5, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.arange(1.0, 6.0)
    torch.testing.assert_close(cell(x), expected, rtol=1e-12, atol=1e-12)
    assert [n for n, _ in cell_parameters([cell])] == ["rms.weight"]


def test_dropout_scales_what_it_keeps_and_is_the_identity_in_eval() -> None:
    cell = Dropout("drop", 0.25)
    x = torch.ones(20000)
    y = cell(x)
    kept = y != 0
    assert 0.72 < float(kept.double().mean()) < 0.78
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))
    cell.eval()
    assert torch.equal(cell(x), x) and not list(cell.parameters())


@pytest.mark.parametrize(("build", "message"), [
    (lambda: MLP("m", [4]), "MLP 'm': an MLP needs at least an input and an output size"),
    (lambda: MLP("m", [4, 0, 2]), r"MLP 'm': sizes\[1\] must be a positive integer, got 0"),
    (lambda: MLP("m", [4, 2], activation="swish"), "MLP 'm': activation must be one of 'gelu', 'relu'"),
    (lambda: MLP("m", [4, 2], dropout=1.0), r"MLP 'm': dropout must be a probability in \[0, 1\), got 1.0"),
    (lambda: Norm("n", 8, kind="batch"), "Norm 'n': norm must be one of 'layernorm', 'rmsnorm', got 'batch'"),
    (lambda: Norm("n", 8, eps=0.0), "Norm 'n': eps must be a positive number"),
    (lambda: Norm("n", True), "Norm 'n': width must be a positive integer, got True"),
    (lambda: Dropout("d", -0.1), r"Dropout 'd': p must be a probability in \[0, 1\)"),
])
def test_bad_arguments_are_refused_naming_the_cell_and_the_argument(build: Callable[[], object],
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_the_public_package_gives_the_whole_library() -> None:
    assert library.__all__
    for name in library.__all__:
        assert getattr(cellmesh, name) is getattr(library, name), name
        assert name in cellmesh.__all__, name
