"""A cell: one named piece of a user's model (an embedding, an encoder block, a head).

A model given to cellmesh as a sequence of cells is cut only *between* cells: a cell is
the unit the coordinator profiles, places on a pipeline stage and runs. This module keeps
the wrapper minimal (a name, the wrapped module, a forward that calls it); the compute
service grows around it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Cell"]


class Cell(nn.Module):
    """Wraps a user's module under a name; calling the cell calls the module.

    Args:
        name: A non-empty identifier, unique within one model; it names the cell in
            profiles, plans and logs.
        module: The wrapped module; its parameters become the cell's parameters.

    Raises:
        ValueError: If ``name`` is empty or contains whitespace.

    Example::

        model = [Cell("embed", nn.Embedding(100, 16)), Cell("block", Block()), Cell("head", Head())]
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        if not name or any(ch.isspace() for ch in name):
            raise ValueError(f"a cell name must be non-empty and without whitespace, got {name!r}")
        self.name = name
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"
