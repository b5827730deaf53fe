"""cellmesh services: stateless handlers hosted in worker processes."""

from services.cell import Cell, as_cells

__all__ = ["Cell", "as_cells"]
