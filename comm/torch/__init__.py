"""gloo and NCCL through torch.distributed process groups (``gloo.py``, ``nccl.py``; ``communicator.py``)."""

__all__: list[str] = []
