"""cellmesh coordinator: plans (``planning``), runs (``runtime``) and the command line (``commands``)."""

__all__: list[str] = []
