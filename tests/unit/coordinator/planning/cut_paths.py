"""The min-max cutter's two paths (the band, the compiled programme), for tests holding both to one answer."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

from coordinator.planning import compiled_cut
from coordinator.planning.cutting import CutProblem

PATHS = ("band", "compiled")
T = TypeVar("T")


@contextlib.contextmanager
def on_path(path: str) -> Iterator[None]:
    """``cut_min_max`` takes ``path`` for every chain: the band, or the compiled programme (from one node
    and two stages on; one stage has nothing to cut)."""
    assert path in PATHS
    if path == "compiled":
        assert compiled_cut.available(), "numba is a dependency of cellmesh: the compiled path must be there"
    saved = compiled_cut.COMPILED_FROM, compiled_cut.BAND_BUDGET_S
    compiled_cut.COMPILED_FROM = 0 if path == "compiled" else sys.maxsize
    compiled_cut.BAND_BUDGET_S = 0.0
    try:
        yield
    finally:
        compiled_cut.COMPILED_FROM, compiled_cut.BAND_BUDGET_S = saved


def on_each_path(call: Callable[[], T]) -> list[T]:
    """``call()`` on each path, in :data:`PATHS` order."""
    out = []
    for path in PATHS:
        with on_path(path):
            out.append(call())
    return out


def compiled_at(problem: CutProblem, limit: float) -> tuple[int, ...] | None:
    """The compiled programme's boundaries under the bound ``limit`` (None where its answer passed it): the
    band's ``_banded(problem, limit)[0]``."""
    return compiled_cut.programme_under(problem, limit)
