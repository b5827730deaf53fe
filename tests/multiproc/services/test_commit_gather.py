"""ZeRO-1's all-gather of the updated rows, bucket by bucket behind the next forward: two ranks (threads over
zmq) train a traced model of many buckets to the parameters one process reaches (float64), with at most
two buckets of buffers held at once, and each bucket gathered only as the forward reaches it.
"""

from __future__ import annotations

import copy
import itertools
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import fx, nn

from comm.base import Communicator, ReduceOp
from services.params.commit_gather import IN_FLIGHT, CommitGather
from services.params.layout import ShardLayout
from tests.harness.threads import run_ranks, zmq_pair

STEPS = 4
SEED = 11
LAYERS = 10
WIDTH = 7  # dim 0 of 7 rows: a short chunk on rank 1
BATCH = 8
TIMEOUT = timedelta(seconds=30)
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 8
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
_SEEDING = threading.Lock()
_prefixes = itertools.count()


def model(width: int = WIDTH) -> fx.GraphModule:
    with _SEEDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(width, width), nn.Tanh()]
        traced = fx.symbolic_trace(nn.Sequential(*layers).double(), concrete_args=None)
    return traced


def batch(step: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 100 + step)
    return (torch.randn(BATCH, width, generator=g, dtype=torch.float64),
            torch.randn(BATCH, width, generator=g, dtype=torch.float64))


def reference(optimizer: str, width: int = WIDTH) -> dict[str, torch.Tensor]:
    m = model(width)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(m.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = batch(step, width)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def train(comm: Communicator, template: fx.GraphModule, optimizer: str, gather_bytes: int) -> dict[str, Any]:
    """ZeRO-1 as the path runs it: forward (gathering), backward, all-reduce MEAN, settle, step the rows."""
    with _SEEDING:
        m = copy.deepcopy(template)
    params = list(m.parameters())
    rows = {id(p): ShardLayout([p.shape], comm.world_size) for p in params}
    shards = {id(p): rows[id(p)].shard_of(p.detach(), 0, comm.rank) for p in params}
    gather = CommitGather(m, params, shards, comm.world_size, comm.rank, gather_bytes)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls([shards[id(p)] for p in params], **kwargs)
    seen: list[list[str]] = []
    first = next(mod for mod in m.modules() if isinstance(mod, nn.Linear))
    first.register_forward_pre_hook(lambda *_: seen.append([b.state for b in gather.buckets]))
    per = BATCH // comm.world_size
    width = params[0].shape[1]
    for step in range(STEPS):
        x, y = batch(step, width)
        gather.start(comm, TIMEOUT)
        for p in params:
            p.grad = None
        nn.functional.mse_loss(m(x[comm.rank * per:(comm.rank + 1) * per]),
                               y[comm.rank * per:(comm.rank + 1) * per]).backward()
        for p in params:
            assert p.grad is not None
            comm.all_reduce(p.grad, ReduceOp.MEAN, timeout=TIMEOUT)
        gather.settle(comm, TIMEOUT)  # as the path's finish: nothing left (every bucket was used)
        for p in params:
            shards[id(p)].grad = rows[id(p)].shard_of(p.grad, 0, comm.rank)
        opt.step()
        gather.mark_stale()
    gather.settle(comm, TIMEOUT)  # the job's last commit
    bucket_bytes = [(b.layout.segment_numel + b.layout.numel) * 8 for b in gather.buckets]
    return {"params": {n: p.detach().clone() for n, p in m.named_parameters()}, "peak": gather.peak_bytes,
            "buckets": bucket_bytes, "seen": seen}


def _run(optimizer: str, gather_bytes: int, width: int = WIDTH) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    template = model(width)  # traced here: fx patches module calls while it traces, so not beside a rank
    with zmq_pair(f"/t/commit-gather/{next(_prefixes)}", TIMEOUT) as comms:
        run_ranks([lambda c=c: results.__setitem__(c.rank, train(c, template, optimizer, gather_bytes))
                   for c in comms], timeout=60)
    return [results[0], results[1]]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bucket_by_bucket_gather_matches_one_process(optimizer: str) -> None:
    results = _run(optimizer, LAYER_BYTES)
    ref = reference(optimizer)
    start = dict(model().named_parameters())
    for r, result in enumerate(results):
        for name, expected in ref.items():
            diff = (result["params"][name] - expected).abs().max().item()
            assert diff < 1e-9, f"rank {r} {name}: max abs diff {diff:.3g}"
    moved = [(ref[n] - p.detach()).abs().max().item() for n, p in start.items()]
    assert min(moved) > 1e-6, "every parameter moved"


def test_the_gather_holds_two_buckets_at_most_and_runs_behind_the_forward() -> None:
    results = _run("adamw", LAYER_BYTES)
    for r, result in enumerate(results):
        buckets = result["buckets"]
        assert len(buckets) == LAYERS, buckets  # a layer each
        bound = IN_FLIGHT * max(buckets)
        assert 0 < result["peak"] <= bound, f"rank {r}: {result['peak']} B held at once, more than {bound}"
        assert result["peak"] * 4 < sum(buckets), "every bucket at once is what the commit held before"
        # as the first layer starts a step after an update: its bucket whole, the next in flight, the rest
        # not gathered yet (each is gathered as the forward reaches it)
        for states in result["seen"][1:]:
            assert states == ["whole", "gathering", *["stale"] * (LAYERS - 2)], states
        assert result["seen"][0] == ["whole"] * LAYERS  # nothing to gather before the first update


def test_one_bucket_for_the_whole_model_still_matches() -> None:
    """A bucket larger than the model: the first forward gathers it whole."""
    results = _run("sgd", 1 << 20)
    ref = reference("sgd")
    for result in results:
        assert len(result["buckets"]) == 1
        assert max((result["params"][n] - t).abs().max().item() for n, t in ref.items()) < 1e-9


def test_a_parameter_alone_in_its_bucket_is_gathered_in_place() -> None:
    """Width 8: every weight's and bias's rows split evenly over 2, so a bucket of one parameter packs as the
    parameter itself and is gathered into it ([Note: a bucket gathered in place]): no buffer held at all."""
    results = _run("adamw", 1, width=8)
    ref = reference("adamw", width=8)
    for r, result in enumerate(results):
        assert len(result["buckets"]) == 2 * LAYERS  # a parameter each
        assert result["peak"] == 0, f"rank {r} held {result['peak']} B of gather buffers"
        diff = max((result["params"][n] - t).abs().max().item() for n, t in ref.items())
        assert diff < 1e-9, f"rank {r}: max abs diff {diff:.3g}"
    assert _run("adamw", 1)[0]["peak"] > 0  # width 7: short chunks, padded, through buffers
