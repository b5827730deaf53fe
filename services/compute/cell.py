"""A cell: one named piece of a user's model (an embedding, an encoder block, a head).

A model given to cellmesh as a sequence of cells is cut only *between* cells: a cell is
the unit the coordinator profiles, places on a pipeline stage and runs. The cells of a
model run one after the other exactly as ``nn.Sequential(*cells)`` runs them: each cell
receives the previous cell's output as its single argument (a tensor, a tuple or a dict
of tensors), and the first cell receives the samples' inputs. So the model a user trains
on one process and the pipeline cellmesh runs are the same function.

Parameters are named by cell: ``"{cell.name}.{name within the wrapped module}"`` (see
:meth:`Cell.named_cell_parameters`), so a parameter keeps its name whichever stage or
worker holds it.

:func:`as_cells` also records where each cell sits in the model it was given
(:attr:`Cell.model_path`, :attr:`Cell.wrapper`), so a stage that runs only some cells can
still name its modules as the whole model names them (``services/compute/randomness/names.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

__all__ = ["Cell", "as_cells", "cell_parameters"]


class Cell(nn.Module):
    """Wraps a user's module under a name; calling the cell calls the module.

    Args:
        name: A non-empty identifier, unique within one model; it names the cell in
            profiles, plans, logs and parameter names.
        module: The wrapped module; its parameters become the cell's parameters.

    Raises:
        ValueError: If ``name`` is empty or contains whitespace.

    Example::

        model = [Cell("embed", nn.Embedding(100, 16)), Cell("block", Block()), Cell("head", Head())]
        # on one process, the same model is nn.Sequential(*model)
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        if not name or any(ch.isspace() for ch in name):
            raise ValueError(f"a cell name must be non-empty and without whitespace, got {name!r}")
        self.name = name
        self.module = module
        # set by as_cells: the qualified name in the model it was given of what this cell stands
        # for (a cell of the user's: the cell itself; else the module it wraps), and whether
        # as_cells made this cell around a module of the model (then the cell is not in the model)
        self.model_path: str | None = None
        self.wrapper = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_cell_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters, named ``"{cell name}.{parameter name}"``."""
        for name, param in self.module.named_parameters():
            yield f"{self.name}.{name}", param

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


def as_cells(model: nn.Module | Sequence[nn.Module]) -> list[Cell]:
    """A model as its list of cells, in order.

    ``model`` is a sequence of modules, an ``nn.Sequential`` or ``nn.ModuleList`` (its
    children, in order), or any other module (one cell). Cells pass through as they are; any
    other module becomes a cell named after its key in an ``nn.Sequential`` with named
    children (``OrderedDict`` keys), else ``"cell{i}"`` for position ``i``. Each cell records
    its place in ``model`` (:attr:`Cell.model_path`; ``""`` for a model that is one cell).

    Raises:
        ValueError: If the model has no cells, or two cells share a name.
    """
    if isinstance(model, nn.Sequential | nn.ModuleList):
        items = [(key, key, m) for key, m in model.named_children()]
    elif isinstance(model, nn.Module):
        items = [("0", "", model)]  # the model is its own one cell, at the root
    else:
        items = [(str(i), str(i), m) for i, m in enumerate(model)]  # as nn.Sequential(*model) names them
    cells: list[Cell] = []
    for i, (key, path, module) in enumerate(items):
        if isinstance(module, Cell):
            cell = module
        elif not isinstance(module, nn.Module):
            raise ValueError(f"model entry {i} is a {type(module).__name__}, not an nn.Module")
        else:
            cell = Cell(f"cell{i}" if key.isdigit() else key, module)
            cell.wrapper = True
        cell.model_path = path
        cells.append(cell)
    if not cells:
        raise ValueError("the model has no cells")
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        raise ValueError(f"cell names must be unique within a model, got {names}")
    return cells


def cell_parameters(cells: Sequence[Cell]) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of ``cells`` with its cell-qualified name, in cell order.

    A parameter shared by two cells (tied weights) is listed once, under its first name.
    """
    seen: set[int] = set()
    out: list[tuple[str, nn.Parameter]] = []
    for cell in cells:
        for name, param in cell.named_cell_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((name, param))
    return out
