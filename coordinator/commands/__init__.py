"""The command line: run, coordinator, worker, demo, plan, k8s render."""
