"""Module names as the unwrapped model has them, for a stage's Sequential of some cells."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from services.compute.cell import Cell, as_cells
from services.compute.randomness.names import cell_name, module_names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.drop = nn.Dropout(0.1)
        self.inner = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.2))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 2)
        self.blocks = nn.ModuleList([Block(), Block()])


FORMS: dict[str, Callable[[], Any]] = {
    "plain module": Plain,
    "list of modules": lambda: [Block(), nn.Tanh(), Block()],
    "named Sequential": lambda: nn.Sequential(OrderedDict(a=Block(), b=nn.Tanh(), c=Block())),
    "ModuleList": lambda: nn.ModuleList([Block(), Block()]),
    "list of Cells": lambda: [Cell("embed", Block()), Cell("head", Block())],
    "one Cell": lambda: Cell("all", Block()),
    "Cells and modules": lambda: nn.Sequential(Cell("x", Block()), Block()),
}


def _unwrapped(made: Any) -> nn.Module:
    return made if isinstance(made, nn.Module) else nn.Sequential(*made)


@pytest.mark.parametrize("form", list(FORMS))
def test_every_stage_names_its_modules_as_the_unwrapped_model(form: str) -> None:
    made = FORMS[form]()
    truth = {id(m): name for name, m in _unwrapped(made).named_modules()}
    cells = as_cells(made)
    for start in range(len(cells)):
        for stop in range(start + 1, len(cells) + 1):
            stage = nn.Sequential(*cells[start:stop])  # what services/compute/stage.py runs
            names = module_names(stage)
            for cell in cells[start:stop]:
                for module in cell.modules():
                    if cell.wrapper and module is cell:
                        assert names[id(module)] == names[id(cell.module)]  # a wrapper is named as its module
                    else:
                        assert names[id(module)] == truth[id(module)], (form, start, stop)


def test_the_reference_root_and_a_users_model_agree() -> None:
    made = [Block(), Block()]
    cells = as_cells(made)
    whole = module_names(nn.Sequential(*cells))
    users = module_names(_unwrapped(made))
    for name, module in _unwrapped(made).named_modules():
        if name:
            assert whole[id(module)] == users[id(module)] == name


def test_a_recorded_cell_inside_a_model_names_its_own_subtree() -> None:
    inner = Cell("inner", Block())
    outer = nn.Sequential(Block(), nn.Sequential(inner))
    cells = as_cells(outer)
    names = module_names(nn.Sequential(*cells))
    assert names[id(inner.module.fc)] == "1.0.module.fc"


def test_a_cell_not_made_by_as_cells_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cell 'loose' has no place in a model: make cells with as_cells"):
        cell_name(Cell("loose", nn.Linear(1, 1)), "")


def test_as_cells_records_each_cells_place() -> None:
    made = nn.Sequential(OrderedDict(a=nn.Linear(1, 1), b=Cell("bee", nn.Tanh())))
    a, b = as_cells(made)
    assert (a.name, a.model_path, a.wrapper) == ("a", "a", True)
    assert (b.name, b.model_path, b.wrapper) == ("bee", "b", False)
    (root,) = as_cells(Plain())
    assert (root.name, root.model_path, root.wrapper) == ("cell0", "", True)
