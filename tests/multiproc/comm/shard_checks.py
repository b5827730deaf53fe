"""Conformance checks of the sharding collectives on sub-groups, run inside rank processes (as ``checks.py``).

Hybrid sharding reduce-scatters inside groups of F ranks and all-reduces across them, on different groups
at the same time. These checks run that, on uneven, non-contiguous and reordered groups, against
references every rank computes itself from the seeded inputs of every rank (``checks._input``); they
check that a timeout on a sub-group names the operation and the group's ranks, and that async
reduce-scatters and all-gathers in flight together complete in order and correctly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from comm.base import Communicator, ReduceOp, Work
from comm.errors import CommTimeoutError
from tests.multiproc.comm.checks import (
    _attempt,
    _cases,
    _device,
    _empty,
    _exact,
    _input,
    _label,
    _reference,
    _Strided,
)


def _groups(comm: Communicator, layouts: Sequence[Sequence[int]]) -> list[Communicator | None]:
    """``new_group`` for every layout in order (every rank calls each, as the contract asks)."""
    return [comm.new_group(list(ranks)) for ranks in layouts]


def _shards_in(group: Communicator, members: list[int], seed: int, label: str,
               ops: Sequence[str] = ("sum", "max")) -> list[str]:
    """reduce_scatter_tensor and all_gather_into_tensor over ``group`` (global ``members``), every case."""
    failures: list[str] = []
    dev, size, me = _device(group), group.world_size, group.rank
    for op_name in ops:
        op = ReduceOp(op_name)
        for index, dname, dtype, n, layout in _cases():
            what = _label(f"{label} reduce_scatter_tensor[{op_name}]", dname, n, layout)
            case_seed = seed * 1000 + index
            inputs = [_input(case_seed, g, size * n, dtype) for g in members]
            check = _reference(op, [t[me * n:(me + 1) * n] for t in inputs], dtype)
            src = _Strided(inputs[me], layout, dev)
            out = _empty(n, dtype, layout, dev)
            _attempt(failures, what, group.reduce_scatter_tensor, out.view, src.view, op)
            for problem in (check(what, out.view), _exact(f"{what} (input modified)", src.view, inputs[me])):
                if problem:
                    failures.append(problem)
            if not out.neighbours_intact():
                failures.append(f"{what}: wrote outside the strided output")
    for index, dname, dtype, n, layout in _cases():
        what = _label(f"{label} all_gather_into_tensor", dname, n, layout)
        parts = [_input(seed * 1000 + 500 + index, g, n, dtype) for g in members]
        src = _Strided(parts[me], layout, dev)
        out = _empty(size * n, dtype, layout, dev)
        _attempt(failures, what, group.all_gather_into_tensor, out.view, src.view)
        problem = _exact(what, out.view, torch.cat(parts))
        if problem:
            failures.append(problem)
        if not out.neighbours_intact():
            failures.append(f"{what}: wrote outside the strided output")
    return failures


def _uneven(world: int) -> list[list[int]]:
    """Two groups covering the world, not contiguous and not in rank order: [w-1, 0, 2, 3, ...] and [1]."""
    if world < 3:
        return [[world - 1, *range(world - 1)]]
    return [[world - 1, *[r for r in range(world - 1) if r != 1]], [1]]


def check_uneven_groups(comm: Communicator, *, seed: int) -> list[str]:
    """Every case of reduce-scatter and all-gather on each rank's group of :func:`_uneven`, the groups
    running at the same time (a group of one rank too)."""
    layouts = _uneven(comm.world_size)
    groups = _groups(comm, layouts)
    failures: list[str] = []
    for members, group in zip(layouts, groups, strict=True):
        if (group is None) == (comm.rank in members):
            failures.append(f"rank {comm.rank}: new_group({members}) returned {group!r}")
        elif group is not None:
            if group.rank != members.index(comm.rank):
                failures.append(f"group {members}: rank {comm.rank} has group rank {group.rank}")
            failures += _shards_in(group, members, seed, f"group {members}")
    for group in groups:
        if group is not None:
            group.close()
    comm.barrier()
    return failures


def _hybrid(world: int) -> tuple[list[list[int]], list[list[int]]]:
    """Shard groups of F = world / 2 ranks taken with stride 2 ({0, 2, ..}, {1, 3, ..}), and the
    replicate groups across them ({0, 1}, {2, 3}, ..): each rank is in one of each."""
    shards = [list(range(k, world, 2)) for k in range(2)]
    replicas = [[2 * i, 2 * i + 1] for i in range(world // 2)]
    return shards, replicas


def check_hybrid_sharding(comm: Communicator, *, seed: int, steps: int = 4) -> list[str]:
    """Hybrid sharding on an even world: reduce-scatter in the shard group, all-reduce of the shard across
    the replicate group, all-gather in the shard group, giving every rank the sum over all ranks; while a
    step's all-reduce runs, the next step's reduce-scatter is already in flight on the other group."""
    world, me, dev = comm.world_size, comm.rank, _device(comm)
    if world % 2:
        return []
    shard_layouts, replica_layouts = _hybrid(world)
    shard_groups, replica_groups = _groups(comm, shard_layouts), _groups(comm, replica_layouts)
    shard = next(g for g in shard_groups if g is not None)
    replica = next(g for g in replica_groups if g is not None)
    f = shard.world_size
    failures: list[str] = []
    for dtype in (torch.float64, torch.int64):
        numel = f * 1031
        grads = [[_input(seed * 100 + s, r, numel, dtype) for r in range(world)] for s in range(steps)]
        outs = [torch.empty(numel // f, dtype=dtype, device=dev) for _ in range(steps)]
        pending = shard.reduce_scatter_tensor(outs[0], grads[0][me].to(dev), async_op=True)
        for s in range(steps):
            pending.wait()
            if s + 1 < steps:  # the next step's reduce-scatter overlaps this step's all-reduce
                pending = shard.reduce_scatter_tensor(outs[s + 1], grads[s + 1][me].to(dev), async_op=True)
            replica.all_reduce(outs[s])
            full = torch.empty(numel, dtype=dtype, device=dev)
            shard.all_gather_into_tensor(full, outs[s])
            problem = _reference(ReduceOp.SUM, grads[s], dtype)(f"hybrid step {s} {dtype}", full)
            if problem:
                failures.append(problem)
    for group in (*shard_groups, *replica_groups):
        if group is not None:
            group.close()
    comm.barrier()
    return failures


def _expect_timeout(failures: list[str], what: str, members: list[int], call: Callable[[], object],
                    timeout_s: float) -> None:
    start = time.monotonic()
    try:
        call()
        failures.append(f"{what} with a silent peer returned instead of raising CommTimeoutError")
    except CommTimeoutError as exc:
        took = time.monotonic() - start
        if not timeout_s * 0.9 <= took <= timeout_s + 3.0:
            failures.append(f"{what}: CommTimeoutError after {took:.2f}s for a {timeout_s}s timeout")
        op = what.split("(")[0]
        if exc.op != op or op not in str(exc):
            failures.append(f"{what}: CommTimeoutError names op {exc.op!r}, want {op!r}: {exc}")
        if str(members) not in str(exc):
            failures.append(f"{what}: CommTimeoutError does not name the group's ranks {members}: {exc}")
    except Exception as exc:
        failures.append(f"{what}: raised {type(exc).__name__} instead of CommTimeoutError: {exc}")


def check_subgroup_timeouts(comm: Communicator, *, timeout_s: float = 0.5) -> list[str]:
    """On a fresh group [w-1, 0] (so no other group is harmed), its rank 0 calls a reduce-scatter, then on
    another one an all-gather, that its other member never calls: CommTimeoutError naming the call and
    the group's ranks, after about the timeout."""
    failures: list[str] = []
    members = [comm.world_size - 1, 0]
    dev, limit = _device(comm), timedelta(seconds=timeout_s)
    calls = {
        "reduce_scatter_tensor": lambda g: g.reduce_scatter_tensor(
            torch.zeros(3, device=dev), torch.ones(6, device=dev), timeout=limit),
        "all_gather_into_tensor": lambda g: g.all_gather_into_tensor(
            torch.zeros(6, device=dev), torch.ones(3, device=dev), timeout=limit),
    }
    for name, call in calls.items():
        group = comm.new_group(members)
        if group is not None and group.rank == 0:
            _expect_timeout(failures, f"{name}(group {members})", members,
                            lambda g=group, c=call: c(g), timeout_s)  # type: ignore[misc]
        comm.barrier()  # the silent member keeps the group open until the caller gave up
        if group is not None:
            group.close()
    return failures


def check_async_shards(comm: Communicator, *, seed: int, late_s: float = 0.3) -> list[str]:
    """Two reduce-scatters and two all-gathers in flight at once on one communicator (the last rank
    issues them ``late_s`` late): each call returns before the late rank joined; the handles complete
    in the order issued (zmq reports completion by polling; gloo's reduce-scatter only in ``wait``, so
    there the order is checked through the waits); results all correct, waited last-first."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    m = 4099
    full = [[_input(seed * 10 + k, r, world * m, torch.float64) for r in range(world)] for k in range(2)]
    parts = [[_input(seed * 10 + 5 + k, r, m, torch.float64) for r in range(world)] for k in range(2)]
    scattered = [torch.zeros(m, dtype=torch.float64, device=dev) for _ in range(2)]
    gathered = [torch.zeros(world * m, dtype=torch.float64, device=dev) for _ in range(2)]
    mine_full = [full[k][me].to(dev) for k in range(2)]
    mine_parts = [parts[k][me].to(dev) for k in range(2)]
    late = me == world - 1 and world > 1
    comm.barrier()
    if late:
        time.sleep(late_s)
    start = time.monotonic()
    works: list[Work] = [
        comm.reduce_scatter_tensor(scattered[0], mine_full[0], async_op=True),
        comm.all_gather_into_tensor(gathered[0], mine_parts[0], async_op=True),
        comm.reduce_scatter_tensor(scattered[1], mine_full[1], async_op=True),
        comm.all_gather_into_tensor(gathered[1], mine_parts[1], async_op=True),
    ]
    issued = time.monotonic() - start
    if world > 1 and not late and issued > late_s / 2:
        failures.append(f"async: issuing four collectives took {issued:.3f}s; they waited for the late rank")
    if comm.backend == "zmq":
        deadline = time.monotonic() + 30
        while not works[-1].is_completed() and time.monotonic() < deadline:
            done = [w.is_completed() for w in works]
            if any(later and not earlier for earlier, later in itertools.pairwise(done)):
                failures.append(f"async: completed out of order: {done}")
                break
            time.sleep(0.0005)
    for work in reversed(works):
        work.wait()
    for k in range(2):
        problem = _reference(ReduceOp.SUM, [t[me * m:(me + 1) * m] for t in full[k]], torch.float64)(
            f"async reduce_scatter_tensor #{k}", scattered[k])
        if problem:
            failures.append(problem)
        problem = _exact(f"async all_gather_into_tensor #{k}", gathered[k], torch.cat(parts[k]))
        if problem:
            failures.append(problem)
    comm.barrier()
    return failures
