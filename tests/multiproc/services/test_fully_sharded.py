"""Fully sharded parameters (ZeRO-3): ranks training a model sharded over them match one process in float64,
and each holds 1/N of the parameters, gradients and optimizer state between steps.

The ranks are threads of this process over zmq (``tests/harness/threads.py``), and processes over gloo.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from comm.registry.memory import MemoryRegistry
from comm.zmq.communicator import ZmqCommunicator
from services.params.fully_sharded import FullyShard
from services.params.layout import chunk_rows, row_range, rows_of
from tests.harness.procs import RankGroup
from tests.harness.threads import run_ranks
from tests.multiproc.services import zero3_checks

STEPS = 5
SEED = 7
TIMEOUT = timedelta(seconds=30)
_prefixes = itertools.count()


@contextmanager
def zmq_world(n: int) -> Iterator[list[ZmqCommunicator]]:
    """``n`` zmq ranks as threads of this process, closed on the way out."""
    registry = MemoryRegistry()
    comms: list[ZmqCommunicator] = []
    prefix = f"/t/zero3/{next(_prefixes)}"

    def make(rank: int) -> Callable[[], None]:
        return lambda: comms.append(ZmqCommunicator.create(rank=rank, world_size=n, registry=registry,
                                                           prefix=prefix, timeout=TIMEOUT))

    try:
        run_ranks([make(r) for r in range(n)])
        comms.sort(key=lambda c: c.rank)
        yield comms
    finally:
        for c in comms:
            c.close()
        registry.close()


def _train_threads(n: int, **kwargs: Any) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    with zmq_world(n) as comms:
        def rank(c: ZmqCommunicator) -> Callable[[], None]:
            return lambda: results.__setitem__(c.rank, zero3_checks.train(c, steps=STEPS, seed=SEED,
                                                                          **kwargs))
        run_ranks([rank(c) for c in comms], timeout=120)
    return [results[r] for r in range(n)]


def _check_parity(results: list[dict[str, Any]], optimizer: str) -> None:
    ref = zero3_checks.reference(optimizer, STEPS, SEED)
    for r, result in enumerate(results):
        assert set(result["params"]) == set(ref)
        for name, expected in ref.items():
            got = torch.frombuffer(bytearray(result["params"][name]), dtype=torch.float64)
            diff = (got - expected.reshape(-1)).abs().max().item()
            assert diff < 1e-9, f"rank {r} {name}: max abs diff {diff:.3g}"
    start = dict(zero3_checks.make_cells(SEED))
    moved = [(ref[f"{c}.{n}"] - p.detach()).abs().max().item()
             for c, m in start.items() for n, p in m.named_parameters()]
    assert min(moved) > 1e-4, "every parameter moved: the comparison is not between untouched models"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_ranks_match_one_process(ranks: int, optimizer: str) -> None:
    _check_parity(_train_threads(ranks, optimizer=optimizer), optimizer)


@pytest.mark.parametrize("defer", [False, True])
def test_microbatches_accumulate_unsharded_then_reduce_scatter_once(defer: bool) -> None:
    """GPipe's order over 3 microbatches; ``defer``: the linear layers' weight gradients come in one flush
    after the last backward (the executor's GPipe), and their units wait for it."""
    _check_parity(_train_threads(2, optimizer="adamw", microbatches=3, defer=defer), "adamw")


@pytest.mark.parametrize("early_stop", [True, False])
def test_recomputed_cells_regather_in_the_backward(early_stop: bool) -> None:
    """Each cell under activation checkpointing; without early stop its forward hooks run again inside the
    backward, where the unit must stay gathered."""
    _check_parity(_train_threads(2, optimizer="sgd", microbatches=2, recompute=True, early_stop=early_stop),
                  "sgd")


# the cells' parameter bytes: embed 336, mix 200, act none, norm 48, head 64
UNITS = {300: ["embed", "mix..norm", "head"],  # embed is larger than 300 B: a unit alone
         400: ["embed", "mix..head"]}  # three cells (and act, without parameters, between them)


@pytest.mark.parametrize(("unit_bytes", "optimizer", "options"), [
    (300, "adamw", dict(microbatches=3, defer=True)), (400, "sgd", dict(microbatches=2)),
    (400, "adamw", dict(microbatches=2, recompute=True, early_stop=False))])
def test_units_of_several_cells_match_one_process(unit_bytes: int, optimizer: str,
                                                  options: dict[str, Any]) -> None:
    """Consecutive cells share a unit up to ``unit_bytes``: one all-gather and one reduce-scatter for them,
    freed after the last cell's forward and once every cell's backward is done (per microbatch)."""
    results = _train_threads(2, optimizer=optimizer, unit_bytes=unit_bytes, **options)
    _check_parity(results, optimizer)
    for r, result in enumerate(results):
        assert [name for name, _ in result["units"]] == UNITS[unit_bytes], f"rank {r}: {result['units']}"
        # each unit gathered once per microbatch for its forward and once for its backward, not per cell
        expected = STEPS * 2 * options["microbatches"] * len(UNITS[unit_bytes])
        assert result["gathers"] == expected, f"rank {r}: {result['gathers']} all-gathers, not {expected}"
        held = result["held"]
        assert held["full_parameters"] == 0 and held["full_gradients"] == 0, f"rank {r}: {held}"


def test_hybrid_shards_in_groups_and_averages_across_them() -> None:
    results = _train_threads(4, optimizer="adamw", hybrid=2)
    _check_parity(results, "adamw")
    units = dict(results[0]["units"])
    # embed's weight [7, IN] and bias [7]: 4 of the 7 rows each on a rank of a group of 2 (2 in a group of 4)
    assert units["embed"] == chunk_rows(7, 2) * (zero3_checks.IN + 1), "sharded over groups of 2, not over 4"


def _row_numel(p: torch.Tensor) -> int:
    return p[0].numel() if p.dim() else 1


def _shard_numel(p: torch.Tensor, ranks: int, rank: int) -> int:
    start, stop = row_range(rows_of(p.shape), ranks, rank)
    return (stop - start) * _row_numel(p)


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_holds_a_shard_of_parameters_gradients_and_optimizer_state(ranks: int) -> None:
    results = _train_threads(ranks, optimizer="adamw")
    cells = zero3_checks.make_cells(SEED)
    params = [p for _, m in cells for p in m.parameters()]
    full = sum(p.numel() for p in params) * 8
    # the padding: each parameter's rows rounded up to a multiple of the ranks
    padded = sum(chunk_rows(rows_of(p.shape), ranks) * ranks * _row_numel(p) for p in params) * 8
    unit_bytes = {name: sum(p.numel() for p in m.parameters()) * 8 for name, m in cells}
    packed = {name: ranks * s * 8 for name, s in results[0]["units"]}  # a unit's all-gather buffer
    order = [name for name, m in cells if unit_bytes[name]]
    # computing unit a, unit b's all-gather in flight (the prefetch)
    in_flight = max(unit_bytes[a] + packed[b] for a, b in itertools.pairwise(order))
    for r, result in enumerate(results):
        held = result["held"]
        assert held["full_parameters"] == 0, f"rank {r}: full parameters left gathered after the step"
        assert held["full_gradients"] == 0, f"rank {r}: full gradients left after the step"
        shards = held["shards"]
        assert shards == padded // ranks, f"rank {r}: {shards} B of shards, expected {padded // ranks}"
        assert held["shard_gradients"] == shards
        exact = sum(_shard_numel(p, ranks, r) for p in params) * 8
        assert result["optimizer_state"] == 2 * exact  # AdamW's two moments of this rank's rows
        assert shards < full / ranks + (padded - full), f"rank {r}: more than 1/{ranks} of {full} B"
        assert result["peak_gathered"] == in_flight, (
            f"rank {r}: {result['peak_gathered']} B of full parameters at once in the forward, not a "
            f"unit and its successor's all-gather ({in_flight} B)")


def test_a_parameter_tied_across_units_is_refused() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with zmq_world(1) as (comm,), pytest.raises(ValueError, match="tied across cells"):
        FullyShard([("a", a), ("b", b)], comm)


def test_a_lost_peer_times_out_naming_the_unit() -> None:
    with zmq_world(2) as (c0, _):
        lin = nn.Linear(3, 3)
        FullyShard([("lonely", lin)], c0, timeout=timedelta(seconds=0.5))
        with pytest.raises(TimeoutError, match=r"unit 'lonely'.*all-gathering its parameters"):
            lin(torch.zeros(1, 3))  # rank 1 never gathers


@pytest.fixture(scope="module")
def gloo_pair() -> Iterator[RankGroup]:
    with RankGroup(world_size=2, backend="gloo") as group:
        yield group


def test_gloo_processes_match_one_process(gloo_pair: RankGroup) -> None:
    results = gloo_pair.run("tests.multiproc.services.zero3_checks:train", optimizer="adamw", steps=STEPS,
                            seed=SEED, microbatches=2, defer=True)
    _check_parity(results, "adamw")


def test_a_step_abandoned_midway_then_a_new_group_continues_exactly() -> None:
    """What the path's reconnect does: the step's forward and backward ran, the reduce-scatters did not
    finish; ``abandon`` drops it, the same ranks form a new group, and training goes on from the shards."""
    per_rank = zero3_checks.GLOBAL_BATCH // 2
    results: dict[int, dict[str, torch.Tensor]] = {}

    def train(first: ZmqCommunicator, second: ZmqCommunicator) -> None:
        units = zero3_checks.make_cells(SEED)
        model = nn.Sequential(*(m for _, m in units))
        fs = FullyShard(units, first, timeout=TIMEOUT)
        opt = torch.optim.AdamW([p for _, p in fs.named_shards()], lr=0.01, weight_decay=0.1)
        lo = first.rank * per_rank
        for step in range(STEPS):
            x, y = zero3_checks.batch(step, SEED)
            if step == 2:  # a step that fails after its backward (other samples): abandoned, run again anew
                bad_x, bad_y = zero3_checks.batch(100, SEED)
                fs.armed = True
                nn.functional.mse_loss(model(bad_x[lo:lo + per_rank]), bad_y[lo:lo + per_rank]).backward()
                fs.abandon()
                fs.comm = second
            opt.zero_grad()
            fs.armed = True
            nn.functional.mse_loss(model(x[lo:lo + per_rank]), y[lo:lo + per_rank]).backward()
            fs.finish()
            opt.step()
        results[first.rank] = fs.full_parameters()

    with zmq_world(2) as first, zmq_world(2) as second:
        run_ranks([lambda r=r: train(first[r], second[r]) for r in range(2)], timeout=120)
    ref = zero3_checks.reference("adamw", STEPS, SEED)
    for r, got in results.items():
        for name, expected in ref.items():
            diff = (got[name] - expected).abs().max().item()
            assert diff < 1e-9, f"rank {r} {name}: max abs diff {diff:.3g}"


class _Branches(nn.Module):
    """``head(tanh(left(h)) * right(h))`` with ``h = tanh(embed(x))``: left and right read the same input,
    so their backwards end in either order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.left, self.right = nn.Linear(zero3_checks.IN, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.head = nn.Linear(3, zero3_checks.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        out: torch.Tensor = self.head(torch.tanh(self.left(h)) * self.right(h))
        return out


def _branches() -> _Branches:
    with zero3_checks._SEEDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return _Branches().double()


def test_a_unit_of_two_branches_is_freed_once_both_backwards_ended() -> None:
    """embed 384 B, left and right 216 B each, head 64 B: units of 450 B put left and right in one; freed
    early, the unit would be gathered again in the backward (one all-gather more per step)."""
    per_rank = zero3_checks.GLOBAL_BATCH // 2
    results: dict[int, tuple[dict[str, torch.Tensor], int, list[str]]] = {}

    def train(comm: ZmqCommunicator) -> None:
        model = _branches()
        cells = [(n, getattr(model, n)) for n in ("embed", "left", "right", "head")]
        fs = FullyShard(cells, comm, timeout=TIMEOUT, unit_bytes=450)
        opt = torch.optim.AdamW([p for _, p in fs.named_shards()], lr=0.01, weight_decay=0.1)
        lo = comm.rank * per_rank
        for step in range(STEPS):
            x, y = zero3_checks.batch(step, SEED)
            opt.zero_grad()
            fs.armed = True
            nn.functional.mse_loss(model(x[lo:lo + per_rank]), y[lo:lo + per_rank]).backward()
            fs.finish()
            opt.step()
        results[comm.rank] = (fs.full_parameters(), fs.gathers, [u.name for u in fs.units])

    with zmq_world(2) as comms:
        run_ranks([lambda c=c: train(c) for c in comms], timeout=120)
    ref = _branches()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        x, y = zero3_checks.batch(step, SEED)
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for r, (params, gathers, units) in results.items():
        assert units == ["embed", "left..right", "head"], units
        assert gathers == STEPS * 2 * len(units), f"rank {r}: {gathers} all-gathers"
        for name, expected in ref.named_parameters():
            diff = (params[name] - expected.detach()).abs().max().item()
            assert diff < 1e-9, f"rank {r} {name}: max abs diff {diff:.3g}"
