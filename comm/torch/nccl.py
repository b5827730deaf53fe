"""The NCCL backend: CUDA tensors over ``ProcessGroupNCCL``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from comm.errors import CommError
from comm.torch.communicator import TorchCommunicator
from comm.torch.completion import Completion, PollCompletion
from comm.torch.group import C10dWork, ProcessGroup

__all__ = ["NcclCommunicator"]


class NcclCommunicator(TorchCommunicator):
    """CUDA tensors over ``ProcessGroupNCCL``.

    Uses the current CUDA device (call ``torch.cuda.set_device`` first). Completion is
    polled on the host (``is_completed`` queries the op's CUDA event), so a call returns
    once the data has arrived; after a failure the NCCL communicator is aborted so no
    kernel keeps spinning on a lost peer.
    """

    backend = "nccl"
    device_type = "cuda"
    other_devices = "use the gloo backend for CPU tensors"

    @classmethod
    def _make_pg(
        cls, store: Store, rank: int, size: int, timeout: timedelta, host: str
    ) -> ProcessGroup:
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise CommError("the nccl backend needs CUDA and a torch build with NCCL")
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        options = nccl.Options()
        options._timeout = timeout
        return cast(ProcessGroup, nccl(store, rank, size, options))

    def _native_mean(self) -> bool:
        return True

    def _collective_completion(self, work: C10dWork, timeout: timedelta, name: str) -> Completion:
        return PollCompletion(work)

    def _p2p_completion(self, work: C10dWork, timeout: timedelta, name: str) -> Completion:
        return PollCompletion(work)

    def _abort(self, pg: ProcessGroup) -> None:
        pg.abort()  # frees kernels still waiting on a lost peer
