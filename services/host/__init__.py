"""The worker process: its service host, launcher variables, probes and metrics."""
