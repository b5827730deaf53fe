"""The zmq backend's all-reduce algorithms (direct, recursive doubling, ring) against each other and a
reference.

The ranks run as threads of this process (each its own sockets and shared-memory inboxes), world sizes
2 to 8 so recursive doubling's fold (3, 5, 6, 7) and plain rounds (2, 4, 8) both run. Checks:

* every algorithm's result is within float rounding of the float64 sum of the inputs, computed here;
* every rank ends with bitwise the same tensor (replicas stay identical);
* doubling equals the ring bit for bit where [Note: recursive doubling for any n] says the order allows
  (MAX, MIN, int64 SUM on any world; float SUM on 2 ranks), and the expected tree ``(x0 + x1) + (x2 + x3)``
  on 4 ranks, computed here, bit for bit;
* sizes that take several parts (over CHUNK_BYTES) and that go zero-copy, and a dtype mismatch is named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import msgpack
import pytest
import torch

from comm.base import ReduceOp
from comm.errors import CommError
from comm.registry.memory import MemoryRegistry
from comm.sockets import CHUNK_BYTES
from comm.zmq import collectives, doubling
from comm.zmq.communicator import ZmqCommunicator
from tests.harness.threads import run_ranks

TIMEOUT = timedelta(seconds=30)


@contextmanager
def zmq_world(n: int, prefix: str) -> Iterator[list[ZmqCommunicator]]:
    """``n`` zmq ranks of one world as threads of this process, closed on the way out."""
    registry = MemoryRegistry()
    comms: list[ZmqCommunicator] = []

    def make(rank: int) -> Callable[[], None]:
        return lambda: comms.append(ZmqCommunicator.create(rank=rank, world_size=n, registry=registry,
                                                           prefix=prefix, timeout=TIMEOUT))

    try:
        run_ranks([make(r) for r in range(n)], timeout=60)
        comms.sort(key=lambda c: c.rank)
        yield comms
    finally:
        for c in comms:
            c.close()
        registry.close()


def _inputs(n: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype) for _ in range(n)]
    return [torch.randint(-(1 << 40), 1 << 40, (numel,), generator=gen, dtype=dtype) for _ in range(n)]


def _run(comms: list[ZmqCommunicator], algorithm: str, inputs: list[torch.Tensor],
         op: ReduceOp = ReduceOp.SUM) -> list[torch.Tensor]:
    """Every rank all-reduces its input with ``algorithm``; the ranks' results, by rank."""
    outs = [x.clone() for x in inputs]

    def rank(r: int) -> Callable[[], None]:
        def go() -> None:
            comms[r].all_reduce_algorithm = algorithm  # type: ignore[assignment]
            comms[r].all_reduce(outs[r], op)
        return go

    run_ranks([rank(r) for r in range(len(comms))], timeout=60)
    return outs


def _replicas_identical(outs: list[torch.Tensor], what: str) -> None:
    for r, out in enumerate(outs[1:], start=1):
        assert torch.equal(out, outs[0]), f"{what}: rank {r}'s result differs from rank 0's"


@pytest.fixture(scope="module", params=[2, 3, 4, 5, 6, 8], ids=lambda n: f"w{n}")
def world(request: pytest.FixtureRequest) -> Iterator[list[ZmqCommunicator]]:
    with zmq_world(request.param, f"/t/allreduce{request.param}") as comms:
        yield comms


@pytest.mark.parametrize("algorithm", ["direct", "doubling", "ring"])
@pytest.mark.parametrize("numel", [1, 7, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sum_and_mean_against_float64(world: list[ZmqCommunicator], algorithm: str, numel: int,
                                      dtype: torch.dtype) -> None:
    n = len(world)
    inputs = _inputs(n, numel, dtype, seed=numel * 31 + n)
    stacked = torch.stack([x.double() for x in inputs])
    bound = torch.finfo(dtype).eps * (n + 2) * stacked.abs().sum(0) + torch.finfo(torch.float64).tiny
    for op, want in ((ReduceOp.SUM, stacked.sum(0)), (ReduceOp.MEAN, stacked.sum(0) / n)):
        outs = _run(world, algorithm, inputs, op)
        scale = n if op is ReduceOp.MEAN else 1
        err = (outs[0].double() - want).abs()
        worst = err.max().item()
        assert bool((err <= bound / scale).all()), f"{algorithm} {op.value} w{n}: max error {worst:.3g}"
        _replicas_identical(outs, f"{algorithm} {op.value} {dtype} w{n}")


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN])
def test_doubling_equals_the_ring_where_the_order_allows(world: list[ZmqCommunicator], op: ReduceOp) -> None:
    n = len(world)
    for dtype in (torch.int64, torch.float32):
        inputs = _inputs(n, 4097, dtype, seed=7 + n)
        by_ring = _run(world, "ring", inputs, op)
        by_doubling = _run(world, "doubling", inputs, op)
        _replicas_identical(by_doubling, f"doubling {op.value} {dtype} w{n}")
        exact = dtype == torch.int64 or op is not ReduceOp.SUM or n == 2
        if exact:
            assert torch.equal(by_doubling[0], by_ring[0]), f"{op.value} {dtype} w{n}: doubling != ring"
        if op is ReduceOp.MAX:
            assert torch.equal(by_doubling[0], torch.stack(inputs).max(0).values)


def test_doubling_sums_in_its_documented_tree_on_four_ranks() -> None:
    with zmq_world(4, "/t/tree4") as comms:
        inputs = _inputs(4, 10000, torch.float32, seed=3)
        x0, x1, x2, x3 = inputs
        outs = _run(comms, "doubling", inputs)
        assert torch.equal(outs[0], (x0 + x1) + (x2 + x3))
        # and it is not the direct path's left-to-right order on these inputs (the check can fail)
        assert not torch.equal(outs[0], ((x0 + x1) + x2) + x3)
    with zmq_world(3, "/t/tree3") as comms:
        x0, x1, x2 = inputs[:3]
        outs = _run(comms, "doubling", inputs[:3])
        assert torch.equal(outs[2], (x1 + x0) + x2)


def test_a_rank_connects_only_to_the_peers_it_sends_to_and_binds_only_for_those_it_hears() -> None:
    """[Note: connecting at the first message] in comm/zmq/transport.py and [Note: one door per rank,
    channels on demand] in comm/zmq/door.py: a ring all-reduce over 8 ranks connects each rank to its next
    rank alone and binds a channel for its previous rank alone, recursive doubling adds its log2 8
    partners; nothing at the start but the door, the card the same size for 8 ranks as for 2, and the
    results as before."""
    with zmq_world(8, "/t/lazy8") as comms:
        def connected(c: ZmqCommunicator) -> set[int]:
            return {peer for peer, ch in c._transport.channels.items() if ch.push is not None}

        def bound(c: ZmqCommunicator) -> set[int]:
            return {peer for peer, ch in c._transport.channels.items() if ch.pull is not None}

        assert all(connected(c) == set() and bound(c) == set() for c in comms)
        assert {len(msgpack.packb(c._transport._cards[c.rank])) for c in comms} <= set(range(250))
        inputs = _inputs(8, 4097, torch.float64, seed=11)
        outs = _run(comms, "ring", inputs)
        assert torch.allclose(outs[0], torch.stack(inputs).sum(0), rtol=1e-12, atol=1e-12)
        assert [connected(c) for c in comms] == [{(r + 1) % 8} for r in range(8)]
        assert [bound(c) for c in comms] == [{(r - 1) % 8} for r in range(8)]
        _run(comms, "doubling", inputs)
        assert [connected(c) for c in comms] == [{(r + 1) % 8, r ^ 1, r ^ 2, r ^ 4} for r in range(8)]
        assert [bound(c) for c in comms] == [{(r - 1) % 8, r ^ 1, r ^ 2, r ^ 4} for r in range(8)]


def test_doubling_of_several_parts_and_zero_copy_bodies() -> None:
    """Over CHUNK_BYTES a tensor travels in parts; over 64 KiB a body goes zero-copy (sockets only)."""
    numel = CHUNK_BYTES // 8 + 1000  # float64: two parts
    with zmq_world(3, "/t/parts") as comms:
        inputs = _inputs(3, numel, torch.int64, seed=5)
        outs = _run(comms, "doubling", inputs)
        _replicas_identical(outs, "doubling of two parts")
        assert torch.equal(outs[0], inputs[0] + inputs[1] + inputs[2])


def test_a_dtype_mismatch_is_named() -> None:
    with zmq_world(2, "/t/mismatch") as comms:
        errors: list[BaseException] = []
        tensors = [torch.ones(16, dtype=torch.float32), torch.ones(16, dtype=torch.float64)]

        def rank(r: int) -> Callable[[], None]:
            def go() -> None:
                comms[r].all_reduce_algorithm = "doubling"
                try:
                    comms[r].all_reduce(tensors[r], timeout=timedelta(seconds=3))
                except CommError as exc:
                    errors.append(exc)
            return go

        run_ranks([rank(0), rank(1)], timeout=30)
        assert errors, "a float32/float64 mismatch went unnoticed"
        assert any("same dtype and size" in str(e) and "all_reduce" in str(e) for e in errors), errors


def test_rounds() -> None:
    assert [doubling.rounds(n) for n in (2, 3, 4, 5, 6, 8)] == [1, 3, 2, 4, 4, 3]


def test_choose_is_by_size() -> None:
    for n in (2, 3, 4, 6):
        assert collectives.choose(n, 4) == "doubling"
        assert collectives.choose(n, collectives.DOUBLING_MAX_BYTES) == "doubling"
        assert collectives.choose(n, collectives.DOUBLING_MAX_BYTES + 1) == "ring"
