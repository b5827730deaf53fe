"""Module names as the user's model has them, whatever a stage wraps its modules in.

A random draw is keyed by the qualified name of the module drawing it
(``services/compute/randomness/keys.py``), and that name must be the same wherever the module
runs: in a stage (``nn.Sequential`` of some of the model's cells, each cell perhaps a wrapper
:func:`~services.compute.cell.as_cells` made), in the one-process reference (all the cells) and
in a user's own loop (the model itself). The name is the module's qualified name in the
*unwrapped* model (the model factory's module, or ``nn.Sequential`` of its list: what
``Job.build_model`` returns and a ``fit`` result's ``state_dict`` loads into); its root is
``""``.

:func:`module_names` gets it from the cells' record of their place in that model
(:attr:`Cell.model_path`): below a cell at ``p``, a module at ``rel`` within the cell is
``p.rel``; below a wrapper cell (one ``as_cells`` made around the model's module at ``p``),
``module.rel`` is ``p.rel``. A module outside every recorded cell keeps its name under the
root it is walked from, which is right when that root is the unwrapped model itself (a user's
loop; a stage module whose names are the model's own, as a traced one's are). A module shared
by two places is named by the first, in ``named_modules`` order.
"""

from __future__ import annotations

from torch import nn

from services.compute.cell import Cell

__all__ = ["cell_name", "module_names"]


def _join(prefix: str, rest: str) -> str:
    return f"{prefix}.{rest}" if prefix and rest else prefix or rest


def cell_name(cell: Cell, rel: str) -> str:
    """The model's name for the module at ``rel`` within ``cell`` (``""``: the cell itself).

    Raises:
        ValueError: ``cell`` has no recorded place (it never went through ``as_cells``).
    """
    if cell.model_path is None:
        raise ValueError(f"cell {cell.name!r} has no place in a model: make cells with as_cells")
    if not cell.wrapper:
        return _join(cell.model_path, rel)
    inner = rel.removeprefix("module")  # a wrapper holds only the model's module, as "module"
    return _join(cell.model_path, inner.removeprefix("."))


def module_names(root: nn.Module) -> dict[int, str]:
    """``id(module) -> its name in the unwrapped model`` for each module under ``root`` (module docstring)."""
    names: dict[int, str] = {}
    cells: list[Cell] = []
    for name, module in root.named_modules():
        names.setdefault(id(module), name)
        if isinstance(module, Cell) and module.model_path is not None:
            cells.append(module)
    owner: dict[int, Cell] = {}  # module -> the recorded cell that named it
    members: dict[int, set[int]] = {id(c): {id(m) for m in c.modules()} for c in cells}
    for cell in cells:  # pre-order: a recorded cell inside another renames its own subtree
        for rel, module in cell.named_modules():
            first = owner.get(id(module))
            if first is None or id(cell) in members[id(first)]:
                names[id(module)] = cell_name(cell, rel)
                owner[id(module)] = cell
    return names
