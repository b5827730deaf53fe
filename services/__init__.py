"""cellmesh services: stateless handlers hosted in worker processes (compute, parameters, barrier)."""

__all__: list[str] = []
