"""Clipping gradients by their global L2 norm, computed in pieces: the arithmetic, written once.

``torch.nn.utils.clip_grad_norm_(params, max_norm)`` in one process computes the L2 norm of
every gradient together, ``total = ||(||g_1||, ..., ||g_n||)||``, and multiplies each gradient by
``min(max_norm / (total + 1e-6), 1)``. cellmesh's gradients are spread over stages and shards,
so each holder reports :func:`squared_norm` of its part (a stage after its all-reduce, a shard
of its averaged round: ``StepReply.grad_sq_norm``, ``RoundNorm.sq_norm``), the coordinator adds
the parts (each parameter counted once: one replica per stage, every shard) and
:func:`clip_coefficient` turns the sum into the factor every holder multiplies its gradients by
before the optimizer step (``CommitStep.grad_scale``, ``ApplyRound.grad_scale``). The sums are
float64 Python floats whatever the gradients' dtype, so a float32 or float16 gradient's square
does not overflow on the way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["CLIP_EPS", "clip_coefficient", "squared_norm", "tensor_norms"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (total_norm + 1e-6)


def tensor_norms(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor as float64, in one read of the tensors.

    A norm is NaN or Inf exactly when its tensor holds a NaN or an Inf: the norm of finite values
    that overflows the tensor's dtype (float32 entries near 3e38) is computed again in float64.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    try:  # one call for the list, as torch's clip_grad_norm_ takes them: 25-30% less than one per tensor
        found = list(torch._foreach_norm(tensors))
    except RuntimeError:  # tensors it does not take together (devices, layouts): one at a time
        found = [torch.linalg.vector_norm(t) for t in tensors]
    same = len({n.dtype for n in found}) == 1
    norms = (torch.stack(found) if same else torch.stack([n.to(torch.float64) for n in found])
             ).to(torch.float64)
    for i in (~norms.isfinite()).nonzero().flatten().tolist():
        if bool(torch.isfinite(tensors[i]).all()):
            norms[i] = torch.linalg.vector_norm(tensors[i].to(torch.float64))
    return norms


def squared_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The sum of the squared L2 norms of ``tensors`` (0.0 for none); NaN or Inf if one holds a NaN or Inf."""
    norms = tensor_norms(tensors)
    return float((norms * norms).sum())


def clip_coefficient(sq_norm: float, max_norm: float) -> float:
    """What multiplies every gradient when their squared norms add up to ``sq_norm``: torch's
    ``min(max_norm / (sqrt(sq_norm) + 1e-6), 1)`` (NaN if ``sq_norm`` is not finite: such a step is
    never committed)."""
    return min(max_norm / (math.sqrt(sq_norm) + CLIP_EPS), 1.0) if math.isfinite(sq_norm) else math.nan
