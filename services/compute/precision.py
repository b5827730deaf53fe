"""What a plan's precision means for the code that runs a model: the autocast context of its forwards.

[Note: mixed precision]
``fp32`` runs the model as built. ``bf16`` and ``fp16`` follow torch's automatic mixed
precision recipe: parameters, gradients and optimizer state keep the model's dtype (float32
master weights); each forward and the loss run under ``torch.autocast(device_type, dtype)``,
which computes the ops that gain from it (matmuls, convolutions...) in the lower precision;
backwards run outside autocast, as torch requires (their ops take the dtypes the forward's
took). The tensors crossing a cut have the dtype autocast gives them (often the lower one),
so the coordinator records the model's cuts under the same context and the boundary specs
say so; the gradients of those tensors travel back in that dtype.

Autocast casts float32 tensors only: a float64 model would run as is. The coordinator
refuses such a job (``coordinator/runtime/job.py``). ``fp16`` also needs a loss scale, so
that small gradients do not flush to zero: the coordinator holds it
(``coordinator/runtime/scaler.py``), the last stage multiplies its loss by it
(``RunStep.loss_scale``) and the commit divides it out (``CommitStep.grad_scale``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from services.protocol import Precision

__all__ = ["AUTOCAST_DTYPES", "autocast", "device_type"]

AUTOCAST_DTYPES: dict[Precision, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(tensors: Iterable[torch.Tensor]) -> str:
    """The device type autocast is asked for: the first tensor's (``"cpu"`` when there is none)."""
    return next((t.device.type for t in tensors), "cpu")


def autocast(precision: Precision, device: str) -> contextlib.AbstractContextManager[object]:
    """The context a forward and its loss run in under ``precision`` on ``device`` (a device type).

    ``fp32``: no context (not even a disabled autocast: a nested one would switch an outer one off).
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=AUTOCAST_DTYPES[precision])
