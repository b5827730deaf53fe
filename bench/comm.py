"""Collective bandwidth of cellmesh's zmq backend against torch.distributed gloo, side by side.

Two processes on loopback. For 1, 16 and 64 MiB float32 tensors: all_reduce, broadcast,
all_gather and reduce_scatter, reported as algorithm and bus bandwidth (the nccl-tests
convention: busbw = algbw * 2(n-1)/n for all_reduce, * (n-1)/n for all_gather and
reduce_scatter, * 1 for broadcast; sizes are the per-rank input for all_reduce/broadcast,
the gathered output for all_gather and the reduce_scatter input). As the ceiling, raw
one-way ZeroMQ throughput between two processes: zero-copy 1 MiB frames copied into a
preallocated tensor.

The peers run in one invocation, interleaved round by round (``--rounds``), so CPU steal
hits them alike; the table shows the median and the spread over rounds.

    python bench/comm.py [--rounds 3] [--reps 5] [--markdown]
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20
SIZES_MIB = tuple(int(x) for x in os.environ.get("CELLMESH_BENCH_SIZES_MIB", "1,16,64").split(","))
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
WORLD = 2


def _busbw_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def _buffers(buffers: dict[int, dict[str, torch.Tensor]], numel: int) -> dict[str, torch.Tensor]:
    """The tensors of one size, made once (allocating them inside the timed loop would time the
    allocator and the page faults of fresh memory, not the collective)."""
    buffers[numel] = {"x": torch.ones(numel), "out": torch.empty(numel), "rs": torch.empty(numel // WORLD)}
    return buffers[numel]


def _time_ops(run: Any, barrier: Any, reps: int) -> dict[tuple[str, int], float]:
    """Seconds per call for every (op, size), measured by the caller's run(op, tensor...)."""
    out: dict[tuple[str, int], float] = {}
    for mib in SIZES_MIB:
        numel = mib * MIB // 4
        for op in OPS:
            run(op, numel)  # warm-up (allocations, connections)
            barrier()
            start = time.perf_counter()
            for _ in range(reps):
                run(op, numel)
            barrier()
            out[(op, mib)] = (time.perf_counter() - start) / reps
    return out


def _cellmesh_rank(rank: int, address: str, prefix: str, reps: int, backend: str, q: Any) -> None:
    torch.set_num_threads(1)
    if backend == "zmq-sockets":  # the zmq backend without shared-memory bodies (comm/zmq/shm.py)
        os.environ["CELLMESH_SHM"] = "0"
        backend = "zmq"
    from comm.allocator import tune_malloc

    tune_malloc()
    from comm.factory import init_communicator
    from comm.registry import RemoteRegistry

    registry = RemoteRegistry(address)
    comm = init_communicator(backend, rank=rank, world_size=WORLD, registry=registry, prefix=prefix,
                             timeout=timedelta(seconds=120))
    buffers: dict[int, dict[str, torch.Tensor]] = {}

    def run(op: str, numel: int) -> None:
        b = buffers.get(numel) or _buffers(buffers, numel)
        if op == "all_reduce":
            comm.all_reduce(b["x"])
        elif op == "broadcast":
            comm.broadcast(b["x"], src=0)
        elif op == "all_gather":
            comm.all_gather_into_tensor(b["out"], b["x"][: numel // WORLD])
        else:
            comm.reduce_scatter_tensor(b["rs"], b["x"])

    times = _time_ops(run, comm.barrier, reps)
    comm.close()
    registry.close()
    if rank == 0:
        q.put({f"{op}:{mib}": t for (op, mib), t in times.items()})


def _gloo_rank(rank: int, port: int, reps: int, q: Any) -> None:
    """The peer: plain torch.distributed with the gloo backend, as a user would run it."""
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    buffers: dict[int, dict[str, torch.Tensor]] = {}

    def run(op: str, numel: int) -> None:
        b = buffers.get(numel) or _buffers(buffers, numel)
        if op == "all_reduce":
            dist.all_reduce(b["x"])
        elif op == "broadcast":
            dist.broadcast(b["x"], src=0)
        elif op == "all_gather":
            dist.all_gather_into_tensor(b["out"], b["x"][: numel // WORLD])
        else:
            dist.reduce_scatter_tensor(b["rs"], b["x"])

    times = _time_ops(run, dist.barrier, reps)
    dist.destroy_process_group()
    if rank == 0:
        q.put({f"{op}:{mib}": t for (op, mib), t in times.items()})


def _raw_receiver(address_q: Any, q: Any, reps: int, nbytes: int) -> None:
    import zmq

    from comm.allocator import tune_malloc

    tune_malloc()  # the ceiling gets the same allocator settings as cellmesh

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    address_q.put(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        got = 0
        while got < nbytes:
            frame = sock.recv(copy=False)
            n = len(frame.buffer)
            dst[got:got + n].copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
            got += n
        times.append(time.perf_counter() - start)
    q.put(statistics.median(times[1:]))
    sock.close()
    ctx.term()


def _raw_sender(address: str, reps: int, nbytes: int) -> None:
    import zmq

    from comm.allocator import tune_malloc

    tune_malloc()  # the ceiling gets the same allocator settings as cellmesh

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    src = torch.ones(nbytes, dtype=torch.uint8)
    view = src.numpy()
    for _ in range(reps + 1):
        trackers = [sock.send(view[o:o + MIB], copy=False, track=True) for o in range(0, nbytes, MIB)]
        for t in trackers:
            t.wait()
    sock.close()
    ctx.term()


def _spawn(ctx: Any, targets: list[tuple[Any, tuple[Any, ...]]], timeout: float = 600) -> None:
    procs = [ctx.Process(target=fn, args=args) for fn, args in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.exitcode != 0:
            for other in procs:
                other.kill()
            raise RuntimeError(f"benchmark process failed (exit code {p.exitcode})")


def raw_ceiling(ctx: Any, reps: int, nbytes: int = 64 * MIB) -> float:
    q, address_q = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_raw_receiver, args=(address_q, q, reps, nbytes))
    receiver.start()
    sender = ctx.Process(target=_raw_sender, args=(address_q.get(timeout=30), reps, nbytes))
    sender.start()
    seconds = q.get(timeout=300)
    for p in (sender, receiver):
        p.join(30)
    return float(nbytes / seconds / 1e9)


def run_round(ctx: Any, reps: int, index: int) -> dict[str, dict[str, float]]:
    from comm.registry import RegistryServer
    from comm.sockets import free_port

    results: dict[str, dict[str, float]] = {}
    q = ctx.Queue()
    server = RegistryServer()
    server.start()
    try:
        for name in ("zmq", "zmq-sockets", "gloo"):
            prefix = f"/bench/{index}/{name}"
            _spawn(ctx, [(_cellmesh_rank, (r, server.address, prefix, reps, name, q)) for r in range(WORLD)])
            results[f"cellmesh-{name}"] = q.get(timeout=10)
    finally:
        server.shutdown(timeout=timedelta(seconds=5))
    port = free_port()
    _spawn(ctx, [(_gloo_rank, (r, port, reps, q)) for r in range(WORLD)])
    results["torch-gloo"] = q.get(timeout=10)
    results["raw-zmq"] = {"one_way:64": raw_ceiling(ctx, reps)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    rounds = [run_round(ctx, args.reps, i) for i in range(args.rounds)]

    def gbps(system: str, op: str, mib: int) -> list[float]:
        return [mib * MIB / r[system][f"{op}:{mib}"] / 1e9 for r in rounds]

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    ceiling = [r["raw-zmq"]["one_way:64"] for r in rounds]
    print(f"# cellmesh comm benchmark, {WORLD} processes on loopback")
    print(f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.reps} reps; median (min-max) over rounds, GB/s")
    print(f"\nraw ZeroMQ one-way ceiling, 64 MiB in 1 MiB zero-copy frames: {cell(ceiling)} GB/s\n")
    print("| op | MiB | zmq algbw | zmq busbw | zmq sockets-only algbw | torch gloo algbw | torch gloo busbw "
          "| cellmesh gloo algbw | zmq / gloo | zmq / ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for op in OPS:
        for mib in SIZES_MIB:
            z, g = gbps("cellmesh-zmq", op, mib), gbps("torch-gloo", op, mib)
            cg = gbps("cellmesh-gloo", op, mib)
            zs = gbps("cellmesh-zmq-sockets", op, mib)
            f = _busbw_factor(op, WORLD)
            ratio = [a / b for a, b in zip(z, g, strict=True)]
            ceil_ratio = [a / c for a, c in zip(z, ceiling, strict=True)]
            print(f"| {op} | {mib} | {cell(z)} | {cell([v * f for v in z])} | {cell(zs)} | {cell(g)} | "
                  f"{cell([v * f for v in g])} | {cell(cg)} | {cell(ratio)} | {cell(ceil_ratio)} |")


if __name__ == "__main__":
    main()
