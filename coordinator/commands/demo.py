"""`cellmesh demo`: two local processes meet through the embedded registry and exercise the front end.

Until the coordinator drives training, this is the main job: it shows discovery, point to
point, every collective and their bandwidth on the chosen backend, and checks each result
against what the ranks can compute on their own.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch

from comm.allocator import tune_malloc
from comm.base import ReduceOp
from comm.factory import init_communicator
from comm.registry import RegistryServer, RemoteRegistry

__all__ = ["run_demo"]

log = logging.getLogger(__name__)


def _rank_main(rank: int, world_size: int, address: str, backend: str) -> None:
    tune_malloc()
    torch.set_num_threads(1)

    def say(msg: str) -> None:
        print(f"[rank {rank}] {msg}", flush=True)

    registry = RemoteRegistry(address)
    comm = init_communicator(
        backend, rank=rank, world_size=world_size, registry=registry,
        prefix="/cellmesh/demo/comm/world", timeout=timedelta(seconds=60),
    )
    try:
        say(f"joined a {backend} communicator of {world_size} ranks via {address}")
        x = torch.full((4,), float(rank + 1))
        comm.all_reduce(x)
        expect = sum(range(1, world_size + 1))
        assert torch.equal(x, torch.full((4,), float(expect))), x
        say(f"all_reduce(sum) of [rank+1]*4 -> {x.tolist()}")

        y = torch.arange(3.0) if rank == 0 else torch.zeros(3)
        comm.broadcast(y, src=0)
        assert torch.equal(y, torch.arange(3.0)), y
        say(f"broadcast from rank 0 -> {y.tolist()}")

        gathered = torch.empty(world_size, 2)
        comm.all_gather_into_tensor(gathered, torch.tensor([rank, rank * 10.0]))
        say(f"all_gather -> {gathered.tolist()}")

        if world_size > 1:
            peer = 1 - rank if world_size == 2 else (rank + 1) % world_size
            token = torch.tensor([rank * 100 + 7])
            got = torch.empty(1, dtype=torch.int64)
            send = comm.isend(token, dst=peer)
            comm.recv(got, src=(rank - 1) % world_size)
            send.wait()
            say(f"sent {token.item()} to rank {peer}, received {got.item()}")

        for mib in (1, 16, 64):
            t = torch.ones(mib << 18)
            comm.all_reduce(t)  # warm-up
            comm.barrier()
            start = time.perf_counter()
            reps = 3
            for _ in range(reps):
                comm.all_reduce(t, ReduceOp.SUM)
            dt = (time.perf_counter() - start) / reps
            if rank == 0:
                say(f"all_reduce {mib:>2} MiB float32: {dt * 1e3:7.1f} ms, {t.nbytes / dt / 1e9:.2f} GB/s")
        comm.barrier()
        say("done")
    finally:
        comm.close()
        registry.close()


def run_demo(backend: str = "zmq", world_size: int = 2, timeout: float = 120.0) -> int:
    """Run the demo; returns a process exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server = RegistryServer()
    server.start()
    print(f"cellmesh demo: embedded registry at {server.address}; starting {world_size} ranks "
          f"on backend {backend!r}", flush=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, server.address, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    code = 0
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                print(f"cellmesh demo: a rank did not finish within {timeout:.0f}s", file=sys.stderr)
                code = 1
            elif p.exitcode != 0:
                code = 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        server.shutdown(timeout=timedelta(seconds=5))
    print("cellmesh demo: " + ("ok" if code == 0 else "FAILED"), flush=True)
    return code
