"""The gradient path: all-reduce buckets, sharding, and the parameter server."""
