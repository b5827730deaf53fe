"""cellmesh communication front end: one Communicator over gloo, NCCL and ZeroMQ, plus discovery."""
