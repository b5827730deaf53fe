"""Running a plan: the event loop, the step driver, local and cluster workers, the Job API."""
