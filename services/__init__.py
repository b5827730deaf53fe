"""cellmesh services: stateless handlers hosted in worker processes."""
