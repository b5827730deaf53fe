"""Kubernetes: the manifests of a job (``render``) and the checks a schema cannot make (``lint``)."""
