"""The fully sharded (ZeRO-3) training the tests run on each rank, and its single-process reference.

The model is a sequence of cells of mixed shapes: a dim 0 that does not divide the group (7 rows
over 2 or 4 ranks), a weight of 3 rows (a rank of 4 holds none of it), biases, a 0-dim parameter,
a cell without parameters and a LayerNorm. Each rank trains on its slice of the global batch in
``microbatches`` pieces (GPipe's order: every forward, then every backward, the last one armed),
each piece's loss weighted by its share of the rank's samples, as the executor weighs them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from comm.base import Communicator
from services.compute.weight_grads import WeightGradStore
from services.params.fully_sharded import FullyShard, storage_bytes

_SEEDING = threading.Lock()
GLOBAL_BATCH = 16
IN, OUT = 5, 2
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


class Mix(nn.Module):
    """A weight of 3 rows, a bias and a 0-dim scale."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 7))
        self.bias = nn.Parameter(torch.randn(3))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * nn.functional.linear(x, self.weight, self.bias)


class Recomputed(nn.Module):
    """Runs ``inner`` under activation checkpointing (its forward runs again in the backward)."""

    def __init__(self, inner: nn.Module, early_stop: bool) -> None:
        super().__init__()
        self.inner = inner
        self.early_stop = early_stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # early stop (torch's default) ends the recomputation at the last saved tensor, before the inner
        # module's forward hooks; without it they run inside the backward
        with set_checkpoint_early_stop(self.early_stop):
            out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def make_cells(seed: int) -> list[tuple[str, nn.Module]]:
    """The model, initialised from ``seed`` (under a lock: ranks that are threads share torch's generator)."""
    with _SEEDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _cells()


def _cells() -> list[tuple[str, nn.Module]]:
    cells: list[tuple[str, nn.Module]] = [
        ("embed", nn.Linear(IN, 7)), ("mix", Mix()), ("act", nn.Tanh()), ("norm", nn.LayerNorm(3)),
        ("head", nn.Linear(3, OUT)),
    ]
    return [(name, m.double()) for name, m in cells]


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g, dtype=torch.float64)
    return x, y


def reference(optimizer: str, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """One process training the same model on the whole global batch."""
    cells = make_cells(seed)
    model = nn.Sequential(*(m for _, m in cells))
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    for step in range(steps):
        x, y = batch(step, seed)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {f"{name}.{n}": p.detach().clone() for name, m in cells for n, p in m.named_parameters()}


def train(comm: Communicator, *, optimizer: str, steps: int, seed: int, microbatches: int = 1,
          defer: bool = False, recompute: bool = False, early_stop: bool = True,
          hybrid: int = 0, unit_bytes: int = 0) -> dict[str, Any]:
    """Train the model fully sharded over ``comm`` (or, with ``hybrid`` = F, over groups of F ranks,
    replicated across the groups), consecutive cells in units of up to ``unit_bytes``; return the full
    parameters (float64 bytes by name) and the bytes this rank held after the last step."""
    cells = make_cells(seed)
    shard_comm, replicate = comm, None
    if hybrid:
        n = comm.world_size
        groups = [comm.new_group(range(g, g + hybrid)) for g in range(0, n, hybrid)]
        across = [comm.new_group(range(i, n, hybrid)) for i in range(hybrid)]
        shard = next(g for g in groups if g is not None)
        shard_comm, replicate = shard, next(g for g in across if g is not None)
    units = [(name, m) for name, m in cells]
    run = [Recomputed(m, early_stop) if recompute and any(True for _ in m.parameters()) else m
           for _, m in cells]
    model = nn.Sequential(*run)
    fs = FullyShard(units, shard_comm, replicate=replicate, unit_bytes=unit_bytes)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls([p for _, p in fs.named_shards()], **kwargs)
    store = WeightGradStore(model) if defer else None
    peak_gathered = [0]

    def watch(module: nn.Module, args: Any) -> None:  # runs after the unit's own pre-hook gathered it
        held = fs.held_bytes()
        peak_gathered[0] = max(peak_gathered[0], held["full_parameters"] + held["gathering"])

    for _, m in units:
        m.register_forward_pre_hook(watch)
    per_rank = GLOBAL_BATCH // comm.world_size
    for step in range(steps):
        x, y = batch(step, seed)
        lo = comm.rank * per_rank
        xs, ys = x[lo:lo + per_rank].chunk(microbatches), y[lo:lo + per_rank].chunk(microbatches)
        opt.zero_grad()
        with store.deferring() if store is not None else _nothing():
            losses = []
            for m, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
                if store is not None:
                    store.microbatch = m
                losses.append(nn.functional.mse_loss(model(xm), ym) * (len(xm) / per_rank))
            for m in reversed(range(microbatches)):
                if m == 0:
                    fs.armed = True
                losses[m].backward()
            if store is not None:
                store.flush(None, final=True)
        fs.finish()
        opt.step()
    held = fs.held_bytes()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    full = fs.full_parameters()
    return {
        "params": {k: v.numpy().tobytes() for k, v in full.items()},
        "held": held, "optimizer_state": storage_bytes(state), "peak_gathered": peak_gathered[0],
        "units": [(u.name, u.layout.segment_numel) for u in fs.units], "gathers": fs.gathers,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
