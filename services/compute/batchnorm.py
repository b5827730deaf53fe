"""BatchNorm on the statistics of the whole global batch, as one process computes them.

[Note: BatchNorm sees the global batch] A BatchNorm layer in training mode normalises each
channel with the mean and variance of the batch it is given, and updates its running
statistics (and ``num_batches_tracked``) once per forward. One process gives it the whole
global batch once per step; a plan gives each replica's stage its share, split further into
microbatches. So a plan trains like one process only if every forward of a BatchNorm layer
sees the global batch:

* one microbatch per replica: the planner considers only such plans for a model with
  BatchNorm and refuses a fixed ``num_microbatches`` above 1, naming the layer
  (``coordinator/planning/request.py``); a stage refuses a training step of more microbatches;
* replicas share statistics: each replica's stage all-reduces, per channel, the sum, the sum
  of squares and the count over its data-parallel group in forward, and the two gradient sums
  (of ``dy`` and ``dy * (x - mean)``) in backward, as ``torch.nn.SyncBatchNorm`` does on GPUs
  (:class:`BatchNormSync`). Every replica then normalises with the global statistics and
  updates its running statistics and ``num_batches_tracked`` exactly as one process does; the
  weight and bias gradients stay local sums, which the data-parallel mean turns into one
  process's gradient. Parameter-server mode has no data-parallel group: with 2 or more replicas
  it is refused for such models.

The statistics are summed in float64 whatever the layer's dtype (one all-reduce of ``2C + 1``
values per layer and forward, one of ``2C`` per backward). The all-reduces share the stage's
data-parallel communicator with the gradient buckets: every replica issues them in the same
order, its model's.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from comm.base import Communicator, ReduceOp
from services.compute.randomness.names import module_names

__all__ = ["BatchNormSync", "batch_norm_layers"]

GroupFn = Callable[[], Communicator | None]


def batch_norm_layers(root: nn.Module) -> list[str]:
    """The BatchNorm layers under ``root`` in training mode (a frozen one, in eval mode, normalises with
    its running statistics: it couples no samples), as ``"name (BatchNorm2d)"`` with the model's names."""
    names = module_names(root)
    return [f"{names[id(m)] or '<root>'} ({type(m).__name__})" for m in root.modules()
            if isinstance(m, _BatchNorm) and m.training]


class _Synced(torch.autograd.Function):
    """Batch normalisation over the data-parallel group (training mode; see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                layer: _BatchNorm, sync: BatchNormSync) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        channels = x.shape[1]
        local = torch.cat([x.sum(dims, dtype=torch.float64), (x.double() * x).sum(dims),
                           torch.tensor([x.numel() / channels], dtype=torch.float64)])
        sync.all_reduce(local, layer, "forward")
        count = float(local[-1])
        mean64 = local[:channels] / count
        var64 = (local[channels:2 * channels] / count - mean64 * mean64).clamp_(min=0)
        shape = [1, channels] + [1] * (x.dim() - 2)
        mean, invstd = mean64.to(x.dtype), torch.rsqrt(var64 + layer.eps).to(x.dtype)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        y = xhat * weight.view(shape) + bias.view(shape) if weight is not None and bias is not None else xhat
        _update_running(layer, mean64, var64, count)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.layer, ctx.sync = count, layer, sync
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        xmu = x - mean.view(shape)
        sum_dy, sum_dy_xmu = grad.sum(dims), (grad * xmu).sum(dims)
        grad_weight = sum_dy_xmu * invstd if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.clone() if weight is not None and ctx.needs_input_grad[2] else None
        if not ctx.needs_input_grad[0]:  # the same on every replica (one model): all skip the all-reduce
            return None, grad_weight, grad_bias, None, None
        total = torch.cat([sum_dy, sum_dy_xmu]).double()
        ctx.sync.all_reduce(total, ctx.layer, "backward")
        channels = x.shape[1]
        mean_dy = (total[:channels] / ctx.count).to(x.dtype).view(shape)
        mean_dy_xmu = (total[channels:] / ctx.count).to(x.dtype).view(shape)
        scale = invstd.view(shape) * (weight.view(shape) if weight is not None else 1.0)
        grad_x = (grad - mean_dy - xmu * invstd.view(shape) ** 2 * mean_dy_xmu) * scale
        return grad_x, grad_weight, grad_bias, None, None


def _update_running(layer: _BatchNorm, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
    """The running statistics' update ``F.batch_norm`` makes, from the global batch's statistics."""
    if not layer.track_running_stats or layer.running_mean is None or layer.running_var is None:
        return
    with torch.no_grad():
        factor = layer.momentum if layer.momentum is not None else 0.0
        if layer.num_batches_tracked is not None:
            layer.num_batches_tracked.add_(1)
            if layer.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(layer.num_batches_tracked)
        unbiased = var * (count / max(count - 1.0, 1.0))
        layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
        layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)


class BatchNormSync:
    """Makes every BatchNorm layer under ``root`` normalise over its data-parallel group in training.

    Each layer's ``forward`` is replaced on the instance (its type, parameters, buffers and
    name stay); in eval mode, or while the group has one member, it runs torch's own.

    Args:
        root: The stage's module.
        group: Returns the stage's data-parallel communicator (None before the group formed).
    """

    def __init__(self, root: nn.Module, group: GroupFn) -> None:
        self._group = group
        self.deadline: float | None = None  # time.monotonic() by which the step's collectives must end
        self.reduced = False  # an all-reduce was issued since begin(): a failed step leaves the group dirty
        self.layers = [m for m in root.modules() if isinstance(m, _BatchNorm)]
        self._names = module_names(root)
        for layer in self.layers:
            layer.forward = types.MethodType(self._forward_of(layer), layer)  # type: ignore[method-assign]

    def _forward_of(self, layer: _BatchNorm) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        original = type(layer).forward

        def forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
            comm = self._group()
            if not layer.training or comm is None or comm.world_size == 1:
                return original(layer, x)
            layer._check_input_dim(x)  # type: ignore[no-untyped-call]  # torch stub
            out: torch.Tensor = _Synced.apply(x, layer.weight, layer.bias, layer, self)  # type: ignore[no-untyped-call]
            return out

        return forward

    def begin(self, deadline: float) -> None:
        """A step starts: its collectives must end by ``deadline`` (``time.monotonic()``)."""
        self.deadline, self.reduced = deadline, False

    def all_reduce(self, values: torch.Tensor, layer: _BatchNorm, phase: str) -> None:
        """Sum ``values`` over the group, bounded by :attr:`deadline` (None: the communicator's default).

        Raises:
            TimeoutError: The step's time ran out first (naming the layer and the phase).
        """
        comm = self._group()
        assert comm is not None
        timeout = None  # no deadline: the communicator's default bound
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the step's time ran out before the BatchNorm statistics of layer "
                                   f"{self._names.get(id(layer), '?')!r} ({phase})")
            timeout = timedelta(seconds=left)
        self.reduced = True
        comm.all_reduce(values, ReduceOp.SUM, timeout=timeout).wait(timeout)
