"""Push+pull throughput of the parameter service against raw ZeroMQ, side by side on loopback.

One replica (this process, one torch thread) trains against a synchronous parameter
service of 1 and of 2 shards, each shard in its own worker process (``python -m
services.host.worker``): a parameter set of ``--mib`` MiB float32 in ``--tensors`` equal
tensors, SGD on the shards. A step is ``push(grads, step)`` then ``pull(params,
min_version=step + 1)`` (two calls), or the same as one ``push_pull`` (every request sent
before any reply is awaited). Throughput is (bytes pushed + bytes pulled) / step time, so
it includes the shards' optimizer step. As the ceiling, raw one-way ZeroMQ throughput
between two processes (``bench/comm.py``'s: zero-copy 1 MiB frames copied into a
preallocated tensor), measured in every round.

Rounds interleave the ceiling and every configuration, so CPU steal hits them alike; the
table shows the median over rounds and the spread (min-max).

    python bench/pushpull.py [--rounds 5] [--reps 5] [--mib 64] [--tensors 16] [--part-mib 4]

With glibc's defaults every step pays thousands of page faults for libzmq's fresh 1 MiB
frame buffers; every process here (replica, shards, the ceiling's two) applies
``comm.allocator.tune_malloc`` as cellmesh's entry points do (``CELLMESH_MALLOC_TUNE=0``
measures without it).
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

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from services.params.client import PushPullClient

MIB = 1 << 20
SHARDS = (1, 2)


class _Stepper:
    """One configuration: a client and its step counter."""

    def __init__(self, client: PushPullClient, params: dict[str, torch.Tensor],
                 grads: dict[str, torch.Tensor]) -> None:
        self.client, self.params, self.grads, self.step = client, params, grads, 0

    def separate(self) -> tuple[float, float]:
        """Seconds of one push and of the pull after it."""
        t0 = time.perf_counter()
        self.client.push(self.grads, self.step)
        t1 = time.perf_counter()
        version = self.client.pull(self.params, min_version=self.step + 1)
        t2 = time.perf_counter()
        self.step += 1
        assert version == self.step, (version, self.step)
        return t1 - t0, t2 - t1

    def fused(self) -> float:
        t0 = time.perf_counter()
        version = self.client.push_pull(self.grads, self.step, self.params, self.step + 1)
        self.step += 1
        assert version == self.step, (version, self.step)
        return time.perf_counter() - t0


def _local_sgd_ms(params: dict[str, torch.Tensor]) -> float:
    """One SGD step over the whole set in this process: the shards' share of a step's work."""
    values = [p.clone() for p in params.values()]
    for v in values:
        v.grad = torch.ones_like(v)
    opt = torch.optim.SGD(values, lr=1e-9)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--part-mib", type=float, default=4.0, help="bytes per message of a push/pull")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()

    from bench.comm import raw_ceiling
    from comm.rpc import RpcClient
    from services.params.client import ShardRef, setup_shards
    from services.protocol import Assignment, AssignmentReply, Empty, OptimizerSpec, ShardInfo
    from tests.harness.workers import registry_server, start_worker

    numel = args.mib * MIB // 4 // args.tensors
    params = {f"p{i:02d}": torch.randn(numel) for i in range(args.tensors)}
    grads = {n: torch.full_like(t, 1e-3) for n, t in params.items()}
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    ctx = mp.get_context("spawn")
    wait = timedelta(seconds=120)
    results: list[dict[str, float]] = []
    moved = 0
    with registry_server() as server:
        workers = [start_worker(server.address, "bench-pushpull", f"w{i}") for i in range(max(SHARDS))]
        steppers: dict[int, _Stepper] = {}
        try:
            for num_shards in SHARDS:
                shards = []
                for i in range(num_shards):
                    name = f"pp{num_shards}-{i}"
                    with RpcClient(workers[i].address, timeout=wait) as c:
                        c.call("worker", "assign", Assignment(service=name, kind="param_server"),
                               AssignmentReply)
                    shards.append(ShardRef(workers[i].address, name))
                setup_shards(shards, params, mode="sync", replicas=1,
                             optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1e-9}), timeout=wait)
                client = PushPullClient(shards, 0, timeout=wait, part_bytes=int(args.part_mib * MIB))
                steppers[num_shards] = _Stepper(client, params, grads)
            for stepper in steppers.values():  # warm-up: connections, first allocations
                stepper.separate()
                stepper.fused()
            for _ in range(args.rounds):
                row = {"ceiling": raw_ceiling(ctx, args.reps, nbytes)}
                for n, stepper in steppers.items():
                    separate = [stepper.separate() for _ in range(args.reps)]
                    fused = [stepper.fused() for _ in range(args.reps)]
                    row[f"push{n}"] = statistics.median(p for p, _ in separate) * 1000
                    row[f"pull{n}"] = statistics.median(p for _, p in separate) * 1000
                    row[f"separate{n}"] = 2 * nbytes / statistics.median(a + b for a, b in separate) / 1e9
                    row[f"fused{n}"] = 2 * nbytes / statistics.median(fused) / 1e9
                    for kind in ("separate", "fused"):
                        row[f"{kind}{n}/ceiling"] = row[f"{kind}{n}"] / row["ceiling"]
                results.append(row)
            for stepper in steppers.values():
                for shard in stepper.client.shards:
                    with RpcClient(shard.address, timeout=wait) as c:
                        moved += c.call(shard.service, "info", Empty(), ShardInfo)[0].moved
        finally:
            for stepper in steppers.values():
                stepper.client.close()
            for w in workers:
                w.stop()
    _report(args, results, nbytes, _local_sgd_ms(params), moved)


def _report(args: argparse.Namespace, results: list[dict[str, float]], nbytes: int, sgd_ms: float,
            moved: int) -> None:
    def cell(key: str, digits: int = 2) -> str:
        values = [r[key] for r in results]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    print("# cellmesh push/pull benchmark, one replica and 1 or 2 shards on loopback")
    print(f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.reps} steps; {nbytes / MIB:.0f} MiB float32 in {args.tensors} "
          f"tensors, {args.part_mib:g} MiB parts; median (min-max) over rounds")
    print(f"\nraw ZeroMQ one-way ceiling, {nbytes / MIB:.0f} MiB in 1 MiB zero-copy frames: "
          f"{cell('ceiling')} GB/s")
    from comm.allocator import MALLOC_TUNE_ENV

    tuned = os.environ.get(MALLOC_TUNE_ENV, "1") != "0"
    print("allocator: " + ("comm.allocator.tune_malloc in every process (32 MiB mmap, 1 GiB trim thresholds)"
                           if tuned else f"glibc defaults ({MALLOC_TUNE_ENV}=0)"))
    print(f"one SGD step over the whole set in one process: {sgd_ms:.1f} ms")
    print(f"parameters moved by copy-on-write (a pull reply still in flight at update time): {moved}\n")
    print("| shards | step | push+pull GB/s | / ceiling | push ms | pull ms |")
    print("|---|---|---|---|---|---|")
    for n in SHARDS:
        print(f"| {n} | push, then pull | {cell(f'separate{n}')} | {cell(f'separate{n}/ceiling')} | "
              f"{cell(f'push{n}', 1)} | {cell(f'pull{n}', 1)} |")
        print(f"| {n} | push_pull | {cell(f'fused{n}')} | {cell(f'fused{n}/ceiling')} | | |")


if __name__ == "__main__":
    main()
