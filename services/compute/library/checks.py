"""Argument checks shared by the ready-made cells: each refusal names the cell, the argument and the fix.

A cell is built in the user's process (the coordinator's, the one-process reference's) and
on every worker from the same factory call, so a bad argument must fail at construction,
before anything trains, with a message that points at the call: ``"TransformerBlock
'block0': heads=3 does not divide width=10"``. The checks raise :class:`ValueError` for every
bad value, a wrong type included (a YAML spec can hand ``"64"`` where an int belongs).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["choice", "label", "positive", "probability", "require"]


def label(kind: str, name: str) -> str:
    """How errors name a cell: its class and its name, ``"LMHead 'head'"``."""
    return f"{kind} {name!r}"


def require(ok: bool, cell: str, message: str) -> None:
    """Raise ``ValueError("{cell}: {message}")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{cell}: {message}")


def positive(cell: str, **values: object) -> None:
    """Every value is an int >= 1 (a bool is not an int here)."""
    for arg, value in values.items():
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        require(ok, cell, f"{arg} must be a positive integer, got {value!r}")


def probability(cell: str, **values: object) -> None:
    """Every value is a number in ``[0, 1)``: a dropout probability (1 would drop everything)."""
    for arg, value in values.items():
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value < 1.0
        require(ok, cell, f"{arg} must be a probability in [0, 1), got {value!r}")


def choice(cell: str, arg: str, value: object, options: Iterable[str]) -> None:
    """``value`` is one of ``options``."""
    names = sorted(options)
    require(value in names, cell, f"{arg} must be one of {', '.join(map(repr, names))}, got {value!r}")
