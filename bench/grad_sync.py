"""Bucketed, overlapped gradient all-reduce (services.params.grad_sync) against one flat all-reduce.

Two processes on loopback, one thread each; the project's baseline model (8 x Linear(1024,1024) +
GELU, 8.4 M parameters, 34 MB of float32 gradients), local batch 32. Per step and per
backend (zmq, gloo), the median over steps of:

* backward alone (no synchronisation): the floor;
* backward, then one all-reduce of the whole flat gradient (copy in, reduce, copy out);
* backward with GradSync (25 MiB buckets and 4 MiB buckets), whose all-reduces overlap it.

    python bench/grad_sync.py [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from torch import nn

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*layers)


def _rank(rank: int, address: str, prefix: str, backend: str, steps: int, q: Any) -> None:
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    from comm.base import ReduceOp
    from comm.factory import init_communicator
    from comm.registry import RemoteRegistry
    from services.params.grad_sync import GradSync

    registry = RemoteRegistry(address)
    comm = init_communicator(backend, rank=rank, world_size=WORLD, registry=registry, prefix=prefix,
                             timeout=timedelta(seconds=120))
    model = _model()
    x = torch.randn(32, 1024)
    params = [p for p in model.parameters()]
    flat = torch.zeros(sum(p.numel() for p in params))

    def backward() -> None:
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    def flat_sync() -> None:
        backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=flat)  # type: ignore[union-attr]
        comm.all_reduce(flat, ReduceOp.MEAN)
        o = 0
        for p in params:
            p.grad.copy_(flat[o:o + p.numel()].view_as(p))  # type: ignore[union-attr]
            o += p.numel()

    results: dict[str, float] = {}
    for name, bucket in (("backward only", 0), ("flat all-reduce", -1), ("GradSync 25 MiB", 25 << 20),
                         ("GradSync 4 MiB", 4 << 20)):
        sync = GradSync(model, comm, bucket_bytes=bucket) if bucket > 0 else None

        def step(sync: GradSync | None = sync, bucket: int = bucket) -> None:
            if bucket == -1:
                flat_sync()
            else:
                backward()
                if sync is not None:
                    sync.finish()

        step()
        comm.barrier()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        comm.barrier()
        if sync is not None:
            sync.close()
        results[name] = statistics.median(times)
    comm.close()
    registry.close()
    if rank == 0:
        q.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from comm.registry import RegistryServer

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rows: dict[tuple[str, str], list[float]] = {}
    server = RegistryServer()
    server.start()
    try:
        for i in range(args.rounds):
            for backend in ("zmq", "gloo"):
                procs = [ctx.Process(target=_rank, args=(r, server.address, f"/bench/gs/{i}/{backend}",
                                                         backend, args.steps, q)) for r in range(WORLD)]
                for p in procs:
                    p.start()
                result = q.get(timeout=600)
                for p in procs:
                    p.join(60)
                for name, seconds in result.items():
                    rows.setdefault((backend, name), []).append(seconds * 1e3)
    finally:
        server.shutdown(timeout=timedelta(seconds=5))
    print(f"# gradient sync, {WORLD} processes, 8 x Linear(1024)+GELU (34 MB of gradients), batch 32/rank")
    print(f"{args.rounds} rounds x {args.steps} steps; ms per step, median (min-max) over rounds\n")
    print("| backend | step | ms/step |")
    print("|---|---|---|")
    for (backend, name), values in rows.items():
        spread = f"({min(values):.1f}-{max(values):.1f})"
        print(f"| {backend} | {name} | {statistics.median(values):.1f} {spread} |")


if __name__ == "__main__":
    main()
