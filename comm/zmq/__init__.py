"""cellmesh's own ZeroMQ transport: point to point, collectives, shared-memory bodies."""
