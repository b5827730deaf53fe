"""Sharding collectives: small all-reduce latency by algorithm, and reduce-scatter / all-gather bandwidth.

Complements ``bench/comm.py`` (large all-reduce and broadcast bandwidth on 2 processes). Here, on 2 and
4 processes of one host:

* all_reduce latency of float32 tensors from 4 B to 4 MiB, cellmesh's zmq backend with each of its
  algorithms pinned (``direct``, ``doubling``, ``ring``; ``comm/zmq/collectives.py``) and with
  ``auto`` (what it picks), against plain torch.distributed gloo;
* reduce_scatter_tensor and all_gather_into_tensor bandwidth at 1 to 64 MiB (the full, unsharded
  tensor), zmq against gloo, as algorithm bandwidth (bytes of the full tensor per second).

Each round runs zmq then gloo at each world size, so CPU steal hits them alike; within a size the
zmq algorithms take turns. Tables show the median over rounds and the spread (min-max).

    python bench/colls.py [--rounds 3] [--reps 30] [--worlds 2,4] [--no-bandwidth]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.comm import _spawn  # after the path fix above

MIB = 1 << 20
LATENCY_BYTES = (*(4 ** k for k in range(1, 9)), *(64 << (10 + k) for k in range(1, 7)))  # 4 B .. 4 MiB
BANDWIDTH_MIB = (1, 4, 16, 64)
ALGORITHMS = ("direct", "doubling", "ring", "auto")
SHARD_OPS = ("reduce_scatter", "all_gather")


def _timed(call: Callable[[], object], barrier: Callable[[], object], reps: int) -> float:
    """Seconds per call of ``reps`` back-to-back calls, after two warm-up calls, between barriers."""
    call()
    call()
    barrier()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    barrier()
    return (time.perf_counter() - start) / reps


def _measure(all_reduce: Callable[[torch.Tensor, str], object], shard: Callable[[str, torch.Tensor,
             torch.Tensor], object], barrier: Callable[[], object], world: int, reps: int,
             algorithms: tuple[str, ...], bandwidth: bool) -> dict[str, float]:
    """Every (algorithm, size) latency and (op, MiB) bandwidth time of one process group."""
    out: dict[str, float] = {}
    for nbytes in LATENCY_BYTES:
        x = torch.ones(nbytes // 4)
        n = reps if nbytes <= 64 << 10 else max(3, reps // 10)
        for alg in algorithms:
            out[f"ar:{alg}:{nbytes}"] = _timed(functools.partial(all_reduce, x, alg), barrier, n)
    for mib in BANDWIDTH_MIB if bandwidth else ():
        part = torch.empty(mib * MIB // 4 // world)
        full = torch.ones(part.numel() * world)
        n = max(2, reps // 6) if mib <= 4 else 2
        for op, a, b in (("reduce_scatter", part, full), ("all_gather", full, part)):
            out[f"{op}:{mib}"] = _timed(functools.partial(shard, op, a, b), barrier, n)
    return out


def _zmq_rank(rank: int, world: int, address: str, prefix: str, reps: int, bandwidth: bool, q: Any) -> None:
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    from comm.registry import RemoteRegistry
    from comm.zmq.communicator import ZmqCommunicator

    registry = RemoteRegistry(address)
    comm = ZmqCommunicator.create(rank=rank, world_size=world, registry=registry, prefix=prefix,
                                  timeout=timedelta(seconds=120))

    def all_reduce(x: torch.Tensor, algorithm: str) -> None:
        comm.all_reduce_algorithm = algorithm  # type: ignore[assignment]
        comm.all_reduce(x)

    def shard(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if op == "reduce_scatter":
            comm.reduce_scatter_tensor(a, b)
        else:
            comm.all_gather_into_tensor(a, b)

    times = _measure(all_reduce, shard, comm.barrier, world, reps, ALGORITHMS, bandwidth)
    comm.close()
    registry.close()
    if rank == 0:
        q.put(times)


def _gloo_rank(rank: int, world: int, port: int, reps: int, bandwidth: bool, q: Any) -> None:
    """The peer: plain torch.distributed with the gloo backend, as a user would run it."""
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    def shard(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if op == "reduce_scatter":
            dist.reduce_scatter_tensor(a, b)
        else:
            dist.all_gather_into_tensor(a, b)

    times = _measure(lambda x, _: dist.all_reduce(x), shard, dist.barrier, world, reps, ("gloo",), bandwidth)
    dist.destroy_process_group()
    if rank == 0:
        q.put(times)


def run_round(ctx: Any, reps: int, index: int, worlds: tuple[int, ...],
              bandwidth: bool) -> dict[int, dict[str, float]]:
    from comm.registry import RegistryServer
    from comm.sockets import free_port

    results: dict[int, dict[str, float]] = {}
    q = ctx.Queue()
    server = RegistryServer()
    server.start()
    try:
        for world in worlds:
            prefix = f"/bench/colls/{index}/{world}"
            args = (world, server.address, prefix, reps, bandwidth, q)
            _spawn(ctx, [(_zmq_rank, (r, *args)) for r in range(world)], timeout=900)
            times = dict(q.get(timeout=10))
            port = free_port()
            gloo = [(_gloo_rank, (r, world, port, reps, bandwidth, q)) for r in range(world)]
            _spawn(ctx, gloo, timeout=900)
            times.update({f"gloo:{k}": v for k, v in q.get(timeout=10).items()})
            results[world] = times
    finally:
        server.shutdown(timeout=timedelta(seconds=5))
    return results


def _cell(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def report(rounds: list[dict[int, dict[str, float]]], worlds: tuple[int, ...], bandwidth: bool) -> None:
    from comm.zmq.collectives import choose

    for world in worlds:
        got = [r[world] for r in rounds]

        def us(key: str, rs: list[dict[str, float]] = got) -> list[float]:
            return [r[key] * 1e6 for r in rs]

        def ratio(a: str, b: str, rs: list[dict[str, float]] = got) -> list[float]:
            return [r[a] / r[b] for r in rs]

        print(f"\n### all_reduce latency, {world} processes (us per call; float32)\n")
        print("| size | direct | doubling | ring | auto (picks) | gloo | ring / doubling | direct / doubling "
              "| gloo / auto |")
        print("|---|---|---|---|---|---|---|---|---|")
        for nbytes in LATENCY_BYTES:
            cells = [_cell(us(f"ar:{alg}:{nbytes}")) for alg in ALGORITHMS]
            cells[3] += f" ({choose(world, nbytes)})"
            print(f"| {_size(nbytes)} | " + " | ".join(cells) + f" | {_cell(us(f'gloo:ar:gloo:{nbytes}'))} | "
                  f"{_cell(ratio(f'ar:ring:{nbytes}', f'ar:doubling:{nbytes}'), '{:.2f}')} | "
                  f"{_cell(ratio(f'ar:direct:{nbytes}', f'ar:doubling:{nbytes}'), '{:.2f}')} | "
                  f"{_cell(ratio(f'gloo:ar:gloo:{nbytes}', f'ar:auto:{nbytes}'), '{:.2f}')} |")
        if not bandwidth:
            continue
        print(f"\n### reduce-scatter and all-gather bandwidth, {world} processes (GB/s of the full tensor)\n")
        print("| op | MiB | zmq | gloo | zmq / gloo |")
        print("|---|---|---|---|---|")
        for op in SHARD_OPS:
            for mib in BANDWIDTH_MIB:
                z = [mib * MIB / r[f"{op}:{mib}"] / 1e9 for r in got]
                g = [mib * MIB / r[f"gloo:{op}:{mib}"] / 1e9 for r in got]
                print(f"| {op} | {mib} | {_cell(z, '{:.2f}')} | {_cell(g, '{:.2f}')} | "
                      f"{_cell([a / b for a, b in zip(z, g, strict=True)], '{:.2f}')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--no-bandwidth", action="store_true", help="all_reduce latency only")
    args = parser.parse_args()
    worlds = tuple(int(w) for w in args.worlds.split(","))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    rounds = [run_round(ctx, args.reps, i, worlds, not args.no_bandwidth) for i in range(args.rounds)]
    print(f"# cellmesh sharding-collectives benchmark, {'/'.join(map(str, worlds))} processes on one host")
    print(f"date {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.rounds} rounds x {args.reps} reps; median (min-max) over rounds")
    report(rounds, worlds, not args.no_bandwidth)


if __name__ == "__main__":
    main()
