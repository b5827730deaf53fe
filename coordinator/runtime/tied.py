"""Which parameters a plan ties across its stages: one Parameter that the cells of several stages hold.

A model ties weights by using one ``nn.Parameter`` object in two places (GPT's token embedding
and output head). :func:`shared_parameters` finds them in the model's cells by identity (the
coordinator's copy may be on the meta device: identity is all it needs); :func:`tied_per_stage`
says, for a plan's stages, which of them each stage holds with which others, under the names
the stage itself gives them (``Stage.parameters()``: a cell-qualified name, the first of the
stage's cells in order). A parameter shared by cells of one stage only is not tied across
stages: that stage holds one copy and autograd sums its uses. What the stages then do is
[Note: tied parameters] in ``services/params/tied.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from services.compute.cell import Cell
from services.protocol import TiedParam

__all__ = ["Holders", "shared_parameters", "tied_per_stage"]

Holders = list[tuple[str, str]]  # (cell name, cell-qualified parameter name), in cell order


def shared_parameters(cells: Sequence[Cell]) -> dict[str, Holders]:
    """Each parameter that more than one cell holds, by its first cell-qualified name: every holding
    cell and its name of it, in cell order (the first is the name ``cell_parameters`` lists)."""
    holders: dict[int, Holders] = {}
    for cell in cells:
        for name, param in cell.named_cell_parameters():  # a cell lists a parameter once
            holders.setdefault(id(param), []).append((cell.name, name))
    return {held[0][1]: held for held in holders.values() if len(held) > 1}


def tied_per_stage(shared: Mapping[str, Holders], stages: Sequence[Collection[str]]) -> list[list[TiedParam]]:
    """For each stage (given as the names of its cells), the parameters it holds together with other stages.

    Raises:
        ValueError: A holding cell is in no stage (``stages`` does not cover the model).
    """
    stage_of = {cell: s for s, names in enumerate(stages) for cell in names}
    out: list[list[TiedParam]] = [[] for _ in stages]
    for key, held in shared.items():
        names: dict[int, str] = {}  # stage -> its name of the parameter (its first holding cell's)
        for cell, name in held:
            if cell not in stage_of:
                raise ValueError(f"cell {cell!r} (holding {name!r}) is in none of the stages {list(stages)}")
            names.setdefault(stage_of[cell], name)
        if len(names) > 1:
            holding = sorted(names)
            for s in holding:
                out[s].append(TiedParam(name=names[s], key=key, stages=holding))
    return out
