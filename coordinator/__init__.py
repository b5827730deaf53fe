"""cellmesh coordinator: plans and drives training."""
