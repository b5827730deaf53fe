"""The ready-made cells: shapes, causality, parameter names, and their refusals of bad sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cellmesh
from services.compute.cell import cell_parameters
from services.compute.cells import MLP, LMHead, TokenEmbedding, TransformerBlock


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [TokenEmbedding("embed", 11, 8, 6), TransformerBlock("block0", 8, 2), LMHead("head", 8, 11)]


def test_a_small_language_model_maps_ids_to_logits() -> None:
    net = nn.Sequential(*_model())
    ids = torch.randint(0, 11, (3, 5))
    assert net(ids).shape == (3, 5, 11)


def test_the_block_is_causal() -> None:
    """Changing a later token leaves every earlier position's output unchanged (and changes its own)."""
    net = nn.Sequential(*_model()).double()
    ids = torch.randint(0, 11, (2, 6))
    later = ids.clone()
    later[:, 4] = (later[:, 4] + 1) % 11
    a, b = net(ids), net(later)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=0)
    assert not torch.allclose(a[:, 4], b[:, 4])


def test_parameters_are_named_by_cell() -> None:
    names = [name for name, _ in cell_parameters(_model())]
    assert names[:2] == ["embed.pos", "embed.tok.weight"]  # own parameters first, as torch
    assert "block0.qkv.weight" in names and names[-1] == "head.out.bias"


def test_mlp_matches_the_layers_it_names() -> None:
    torch.manual_seed(1)
    cell = MLP("mlp", [4, 16, 2])
    torch.manual_seed(1)
    reference = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))
    x = torch.randn(5, 4)
    torch.testing.assert_close(cell(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TransformerBlock("b", 10, 3), "does not divide into 3 heads"),
    (lambda: TokenEmbedding("e", 0, 8, 4), "vocab"),
    (lambda: MLP("m", [4]), "at least an input and an output"),
    (lambda: LMHead("h", 8, -1), "vocab"),
])
def test_bad_sizes_are_refused_naming_them(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_a_sequence_longer_than_max_seq_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than max_seq=6"):
        _model()[0](torch.zeros(1, 7, dtype=torch.long))


def test_the_public_package_gives_them() -> None:
    assert cellmesh.TransformerBlock is TransformerBlock and cellmesh.MLP is MLP
