"""Functions the rank processes run for the data-parallel tests (see tests/harness/procs.py).

The model, the data and the optimizers are defined here once and used both by the ranks
and by the single-process reference in the tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comm.base import Communicator
from services.params.grad_sync import GradSync

GLOBAL_BATCH = 16
IN, HIDDEN, OUT = 8, 16, 4
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT)).double()


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g, dtype=torch.float64)
    return x, y


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(model.parameters(), **kwargs)


def reference(optimizer: str, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """One process training on the whole global batch."""
    model = make_model(seed)
    opt = make_optimizer(optimizer, model)
    for step in range(steps):
        x, y = batch(step, seed)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_replica(comm: Communicator, *, optimizer: str, steps: int, seed: int, bucket_bytes: int,
                  microbatches: int = 1, set_to_none: bool = True) -> dict[str, Any]:
    """Train on this rank's contiguous share of every global batch, gradients averaged by GradSync.

    With several ``microbatches`` the share is split and their gradients accumulate, the
    hooks disarmed for every backward but the last (as a pipeline stage does).
    """
    torch.set_num_threads(1)
    model = make_model(seed)
    opt = make_optimizer(optimizer, model)
    sync = GradSync(model, comm, bucket_bytes=bucket_bytes)
    share = GLOBAL_BATCH // comm.world_size
    chunk = share // microbatches
    views = True
    for step in range(steps):
        x, y = batch(step, seed)
        opt.zero_grad(set_to_none=set_to_none)
        for m in range(microbatches):
            sync.armed = m == microbatches - 1
            mine = slice(comm.rank * share + m * chunk, comm.rank * share + (m + 1) * chunk)
            (nn.functional.mse_loss(model(x[mine]), y[mine]) / microbatches).backward()
        sync.finish()
        views = views and all(  # zero-copy: every gradient is a view into its bucket
            p.grad is not None and p.grad.data_ptr() == b.buffer[off:].data_ptr()
            for b in sync.buckets for p, off in zip(b.params, b.offsets, strict=True))
        opt.step()
    sync.close()
    return {"buckets": len(sync.buckets), "views": views,
            "params": {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}}


def reduce_scatter_grads(comm: Communicator, *, seed: int, bucket_bytes: int,
                         direct_bytes: int = 1 << 40) -> dict[str, Any]:
    """One backward in reduce_scatter mode: this rank's rows of every averaged gradient; no ``.grad`` left."""
    model = make_model(seed)
    sync = GradSync(model, comm, bucket_bytes=bucket_bytes, mode="reduce_scatter", direct_bytes=direct_bytes)
    share = GLOBAL_BATCH // comm.world_size
    mine = slice(comm.rank * share, (comm.rank + 1) * share)
    x, y = batch(0, seed)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    shards = sync.finish()
    return {"left": [n for n, p in model.named_parameters() if p.grad is not None],
            "direct": [n for b in sync.buckets if b.direct for n in b.names],
            "shards": {n: [list(g.shape), g.numpy().tobytes()] for s in shards for n, g in s.grads.items()}}
