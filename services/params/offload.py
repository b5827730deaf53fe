"""CPU offload of a stage's optimizer (``plan.offload``): the state and a master copy live in host memory.

:class:`HostCopy` holds, for each tensor the stage's optimizer would step (the parameters, or under
ZeRO this replica's rows of them: ``optimizer_params`` of ``services/params/zero.py`` and
``services/params/sharded_path.py``), a *master* copy in host memory; the optimizer is built over
the masters, so its state (Adam's moments, SGD's momentum) is allocated there too and the device
holds parameters and gradients only. Per commit::

    device grads (final: all-reduced, or reduce-scattered rows) --copy--> the masters' .grad
    grad_scale on the masters' gradients; optimizer.step() on the masters (the host's cores)
    the masters that got a gradient --copy--> the device tensors  (ZeRO-1/2: then the all-gather)

[Note: the master copy]
A master is the tensor's dtype when it is float32 or float64 (cellmesh's mixed precision keeps the
parameters themselves in float32, so they are the master weights already), float32 for a 16-bit
parameter (the step then rounds once, on the way back, as DeepSpeed's fp32 masters do). So an
offloaded step computes what the device's would: the same optimizer over the same values, only
elsewhere, and the parity tests hold to 1e-9 in float64. The masters are made from the device
tensors when the optimizer is built (the first commit, after any checkpoint was loaded into the
stage) and are the truth from then on: nothing else writes a stage's trainable parameters between
commits (evaluation does not; a recovery builds a new stage). On a CUDA stage the masters and their
gradient buffers are pinned, so the two copies run at the link's speed (``non_blocking``, one
synchronisation after each direction).

[Note: offload on a CPU worker]
There the device is the host: the masters are a second copy in the same memory, so offload costs
the parameters' bytes (of this replica's rows) once more and saves nothing (the gradients are read
where they are, not copied). It still runs (the
driver warns; the tests use it to check the path), since a job written for GPUs should run where
there are none.

Checkpoints hold the optimizer state by parameter name, as every plan's: :meth:`HostCopy.device_state`
keys the masters' state by the device tensors the stage's snapshot (or ZeRO's gather of whole state)
looks up, and a restore is applied to the optimizer over the masters by name, as to any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.checkpoint.stage_state import FullState, OptimizerState

__all__ = ["HostCopy", "master_dtype"]


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's master copy: its own for float32/float64 (and non-float), else float32."""
    return torch.float32 if dtype.is_floating_point and torch.finfo(dtype).bits < 32 else dtype


class HostCopy:
    """Host-memory masters of the tensors a stage's optimizer steps, and the copies between them.

    Args:
        params: ``(name, tensor)`` the optimizer would step on the device (parameters or their shards).
    """

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._device = [(n, t) for n, t in params]
        self._cuda = sorted({t.device for _, t in params if t.device.type == "cuda"}, key=str)
        self._pinned = bool(self._cuda) and torch.cuda.is_available()
        self._masters: list[torch.Tensor] = []
        self._grads: list[torch.Tensor | None] = [None] * len(self._device)  # reused host buffers
        for _, t in self._device:
            master = torch.empty(t.shape, dtype=master_dtype(t.dtype), device="cpu", pin_memory=self._pinned)
            master.copy_(t.detach())
            self._masters.append(master)

    @property
    def on_cuda(self) -> bool:
        """Whether the device tensors are on a GPU (offload then frees device memory)."""
        return self._pinned

    def masters(self) -> list[tuple[str, torch.Tensor]]:
        """What the optimizer steps: one host tensor per device tensor, by the same name, in order."""
        return [(n, m) for (n, _), m in zip(self._device, self._masters, strict=True)]

    def pull_grads(self) -> None:
        """Each master's ``.grad`` := its device tensor's (None where that has none): the step's gradients,
        copied to host buffers (read where they are if they are in host memory in the master's dtype)."""
        for i, ((_, t), master) in enumerate(zip(self._device, self._masters, strict=True)):
            grad = t.grad
            if grad is None or (grad.device.type == "cpu" and grad.dtype == master.dtype):
                master.grad = None if grad is None else grad.detach()
                continue
            buf = self._grads[i]
            if buf is None:
                buf = torch.empty(master.shape, dtype=master.dtype, device="cpu", pin_memory=self._pinned)
                self._grads[i] = buf
            buf.copy_(grad.detach(), non_blocking=self._pinned)
            master.grad = buf
        self._sync()

    def push_params(self) -> None:
        """Copy every master that got a gradient back into its device tensor (the others did not change)."""
        with torch.no_grad():
            for (_, t), master in zip(self._device, self._masters, strict=True):
                if master.grad is not None:
                    t.copy_(master, non_blocking=self._pinned)
        self._sync()

    def _sync(self) -> None:
        """Wait for the ``non_blocking`` copies (each GPU's; nothing to wait for on the CPU)."""
        for device in self._cuda if self._pinned else ():
            torch.cuda.synchronize(device)

    def device_state(self, optimizer: OptimizerState) -> FullState:
        """The optimizer's per-tensor state keyed by the device tensors (what a snapshot or ZeRO's
        ``full_state`` looks up), the values left in host memory."""
        state: dict[Any, Any] = {}
        for (_, t), master in zip(self._device, self._masters, strict=True):
            entries = optimizer.state.get(master)
            if entries:
                state[t] = entries
        return FullState(state)

    def host_bytes(self) -> int:
        """Bytes of the masters and their gradient buffers (the optimizer's state not included)."""
        tensors = [*self._masters, *(g for g in self._grads if g is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)
