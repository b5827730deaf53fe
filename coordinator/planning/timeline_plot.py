"""The predicted timeline as a raster or PDF picture (matplotlib), for ``cellmesh plan --timeline``.

The same picture as the SVG of :func:`~coordinator.planning.simulator.draw_timeline` (which
calls this for any suffix but ``.svg``): one row per rank, one box per action, forward blue,
backward green (split: I light green, W orange), transfers grey and thin, gaps idle.
matplotlib is the optional extra ``plot`` (``pip install 'cellmesh[plot]'``); the SVG needs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.planning.simulator import SimResult

__all__ = ["check_drawable", "plot_timeline"]

_COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#f28e2b"}
_TRANSFER = "#bab0ac"


def check_drawable(path: Path) -> None:
    """Refuse now, before any work, a timeline ``path`` that could not be drawn at the end.

    Raises:
        ValueError: Its suffix needs matplotlib, which is not installed (names the extra).
    """
    if path.suffix.lower() != ".svg":
        _pyplot(path)


def _pyplot(path: Path) -> Any:
    """matplotlib's pyplot on the file-only backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        from matplotlib import pyplot
    except ImportError as exc:
        raise ValueError(f"a {path.suffix or 'raster'} timeline needs matplotlib: pip install "
                         f"'cellmesh[plot]' ({exc}); or write an .svg, which needs nothing") from exc
    return pyplot


def plot_timeline(result: SimResult, path: Path, caption: str) -> Path:
    """Draws ``result``'s timeline to ``path`` in the format its suffix names (``.png``, ``.pdf``...).

    Raises:
        ValueError: matplotlib is not installed (names the extra), or it cannot write that format.
    """
    pyplot = _pyplot(path)
    rows = len(result.timeline)
    fig, ax = pyplot.subplots(figsize=(12, 0.6 * rows + 1.2))
    try:
        for s, played in enumerate(result.timeline):
            for t in played:
                compute = t.action.kind in _COLOURS
                y, h = (s - 0.4, 0.8) if compute else (s + 0.15, 0.25)
                ax.broken_barh([(t.start * 1e3, (t.end - t.start) * 1e3)], (y, h),
                               facecolors=_COLOURS.get(t.action.kind, _TRANSFER), edgecolor="white",
                               linewidth=0.5)
                if compute and result.step_time_s > 0 and (t.end - t.start) / result.step_time_s > 0.02:
                    ax.text((t.start + t.end) / 2 * 1e3, s, f"{t.action.kind}{t.action.microbatch}",
                            ha="center", va="center", color="white", fontsize=8)
        ax.set_yticks(range(rows), [result.track(r) for r in range(rows)])
        ax.invert_yaxis()
        ax.set_xlim(0, result.step_time_s * 1e3)
        ax.set_xlabel("ms")
        ax.set_title(caption, fontsize=10)
        fig.tight_layout()
        try:
            fig.savefig(path)
        except ValueError as exc:  # an unknown format
            raise ValueError(f"cannot write the timeline {path}: {exc}; use .png, .pdf or .svg") from exc
    finally:
        pyplot.close(fig)
    return path
