"""Functions the rank processes run for the data-parallel tests (see tests/harness/procs.py).

The model, the data and the optimizers are defined here once and used both by the ranks
and by the single-process reference in the tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comm.base import Communicator
from services.params.grad_sync import FIRST_BUCKET_BYTES, GradSync
from services.params.layout import ShardLayout

GLOBAL_BATCH = 16
IN, HIDDEN, OUT = 8, 16, 4
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
ODD = (7, 5)  # hidden widths whose rows do not split evenly over 2 ranks


def make_model(seed: int, odd: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    h1, h2 = ODD if odd else (HIDDEN, HIDDEN)
    return nn.Sequential(nn.Linear(IN, h1), nn.Tanh(), nn.Linear(h1, h2), nn.Tanh(),
                         nn.Linear(h2, OUT)).double()


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g, dtype=torch.float64)
    return x, y


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(model.parameters(), **kwargs)


def reference(optimizer: str, steps: int, seed: int, odd: bool = False) -> dict[str, torch.Tensor]:
    """One process training on the whole global batch."""
    model = make_model(seed, odd)
    opt = make_optimizer(optimizer, model)
    for step in range(steps):
        x, y = batch(step, seed)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_replica(comm: Communicator, *, optimizer: str, steps: int, seed: int, bucket_bytes: int,
                  microbatches: int = 1, set_to_none: bool = True,
                  first_bytes: int = FIRST_BUCKET_BYTES, direct_bytes: int = 1 << 40) -> dict[str, Any]:
    """Train on this rank's contiguous share of every global batch, gradients averaged by GradSync.

    With several ``microbatches`` the share is split and their gradients accumulate, the
    hooks disarmed for every backward but the last (as a pipeline stage does). ``direct_bytes``: a
    parameter this large is all-reduced in its own ``.grad`` (1: every one), not in a bucket view.
    """
    torch.set_num_threads(1)
    model = make_model(seed)
    opt = make_optimizer(optimizer, model)
    sync = GradSync(model, comm, bucket_bytes=bucket_bytes, first_bytes=first_bytes,
                    direct_bytes=direct_bytes)
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
        views = views and all(  # zero-copy: every gradient is a view into its bucket (or its own buffer)
            p.grad is not None and p.grad.data_ptr() == b.buffer[off:].data_ptr()
            for b in sync.buckets if not b.direct for p, off in zip(b.params, b.offsets, strict=True))
        opt.step()
    sync.close()
    return {"buckets": len(sync.buckets), "views": views,
            "direct": [n for b in sync.buckets if b.direct for n in b.names],
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


def train_sharded(comm: Communicator, *, stage: int, optimizer: str, steps: int, seed: int, bucket_bytes: int,
                  first_bytes: int) -> dict[str, Any]:
    """ZeRO-``stage`` (0: plain) as ``services/params/zero.py`` runs it, on the odd model: gradients
    averaged by GradSync (stage 2: reduce-scattered), the optimizer over this rank's rows of each
    parameter (stage 1, 2), then every parameter all-gathered. Returns the parameters and the buckets'
    parameter names, in launch order."""
    torch.set_num_threads(1)
    model = make_model(seed, odd=True)
    named = list(model.named_parameters())
    rank, world = comm.rank, comm.world_size
    rows = {n: ShardLayout([p.shape], world) for n, p in named}
    shards = {n: rows[n].shard_of(p.detach(), 0, rank) if stage else p for n, p in named}
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(list(shards.values()), **kwargs)
    sync = GradSync(model, comm, bucket_bytes=bucket_bytes, first_bytes=first_bytes,
                    mode="reduce_scatter" if stage == 2 else "all_reduce", direct_bytes=1 << 40)
    share = GLOBAL_BATCH // world
    mine = slice(rank * share, (rank + 1) * share)
    for step in range(steps):
        x, y = batch(step, seed)
        opt.zero_grad()
        model.zero_grad()  # the shards' .grad are views of the parameters' (stage 1) or apart (stage 2)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        got = {n: g for s in sync.finish() for n, g in s.grads.items()}
        for n, p in named:
            if stage == 1:
                assert p.grad is not None
                shards[n].grad = rows[n].shard_of(p.grad, 0, rank)
            elif stage == 2:
                assert p.grad is None, f"{n}: the full gradient was kept"
                shards[n].grad = got[n]
        opt.step()
        if stage:
            with torch.no_grad():
                for n, p in named:
                    one = rows[n]
                    segment = torch.zeros(one.segment_numel, dtype=p.dtype)
                    segment[:shards[n].numel()].copy_(shards[n].reshape(-1))
                    full = torch.empty(one.numel, dtype=p.dtype)
                    comm.all_gather_into_tensor(full, segment)
                    one.unpack(full, [p.detach()])
    sync.close()
    return {"buckets": [b.names for b in sync.buckets],
            "params": {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}}
