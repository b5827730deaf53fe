"""gloo and NCCL through torch.distributed process groups."""
