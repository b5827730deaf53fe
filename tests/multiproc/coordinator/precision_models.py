"""Factories of the mixed-precision tests: ``models.py``'s regression data with a step whose targets are huge.

The models are ``models.py``'s, built in float32 (autocast's master weights).
"""

from __future__ import annotations

import torch

from tests.multiproc.coordinator.models import regression


def spiky(indices: list[int], factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 regression samples whose targets at ``indices`` are multiplied by ``factor``.

    A target of ~1e4 makes the gradient of the loss with respect to the model's float16 outputs
    about ``1e4 * loss scale / samples``, far beyond float16's 65504: the step overflows on any plan.
    """
    x, y = regression("float32")
    y[indices] *= factor
    return x, y
