"""cellmesh's own ZeroMQ backend: communicator, collectives, group framing, work handles, transport, shm."""

__all__: list[str] = []
