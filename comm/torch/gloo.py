"""The gloo backend: CPU tensors over ``ProcessGroupGloo``.

[Note: aborting a gloo process group]
gloo has no working abort (``abort()`` and ``shutdown()`` leave an operation that waits
on a frozen peer waiting until gloo's own timeout). But any gloo timeout makes the
context signal an error to every pair ("Application timeout caused pair closure"),
which fails every pending operation of the process group at once and closes its
connections, so peers learn of it immediately too. So a failed communicator (and one
closed while operations are still in flight) posts a receive on a reserved tag and
waits 1 ms for it. No work is left running in a gloo thread that could finish after
the interpreter began to shut down; that matters because a gloo thread completing a
work then touches Python objects (its future's callbacks, a waiting thread's GIL) and
Python 3.11 ends such threads with a forced unwind, which aborts the process
("terminate called after throwing an instance of 'gloo::IoException'"). For the same
reason no Python callback is ever attached to a c10d future here, and an ``atexit``
hook (``comm/torch/communicator.py``) closes every communicator still open.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from comm.torch.communicator import TorchCommunicator
from comm.torch.completion import Completion, SliceCompletion, WaitOnlyCompletion
from comm.torch.group import ABORT_TAG, C10dWork, ProcessGroup

__all__ = ["GlooCommunicator"]


class GlooCommunicator(TorchCommunicator):
    """CPU tensors over ``ProcessGroupGloo``.

    gloo (torch 2.13) runs every collective natively, bfloat16 included; MEAN is SUM
    followed by a division (portable to older gloo builds without AVG).
    """

    backend = "gloo"
    device_type = "cpu"
    other_devices = "use the nccl backend for CUDA tensors"

    @classmethod
    def _make_pg(
        cls, store: Store, rank: int, size: int, timeout: timedelta, host: str
    ) -> ProcessGroup:
        # The stub of ProcessGroupGloo lists only the timeout constructor; the options
        # one (to pin the device to ``host`` instead of resolving the hostname) is real.
        gloo: Any = dist.ProcessGroupGloo
        options = gloo._Options()
        options._timeout = timeout
        options._devices = [gloo.create_device(hostname=host)]
        return cast(ProcessGroup, gloo(store, rank, size, options))

    def _collective_completion(self, work: C10dWork, timeout: timedelta, name: str) -> Completion:
        try:
            work.get_future()  # gloo's asynchronous works have one; only looked at, no callback
        except RuntimeError:
            # reduce_scatter is a wrapper in gloo (an all_reduce underneath, the slice
            # copied out inside wait()): no future, and is_completed() stays False.
            return WaitOnlyCompletion(work, timeout, name)
        return SliceCompletion(work)

    def _p2p_completion(self, work: C10dWork, timeout: timedelta, name: str) -> Completion:
        return WaitOnlyCompletion(work, timeout, name)

    def _abort(self, pg: ProcessGroup) -> None:
        # [Note: aborting a gloo process group]: a receive nobody sends, timed out at once.
        peer = (self._rank + 1) % self.world_size
        with contextlib.suppress(RuntimeError):  # expected: the timeout is what closes the pairs
            pg.recv([torch.empty(1)], peer, ABORT_TAG).wait(timedelta(milliseconds=1))
