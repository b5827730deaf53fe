"""Point-to-point transfers: cellmesh's zmq backend against raw ZeroMQ and torch.distributed gloo.

Two processes on one host. Every system lives in the same two processes at once and they
take turns size by size, round by round (the order rotates each round), so CPU steal hits
them alike. For 32 KiB, 256 KiB and 4 MiB of uint8 (a pipeline's activations are 32 KiB in
``bench/train.py``), three figures per system, medians in microseconds:

* ``transfer``: one send and its matching receive, end to end: half a ping-pong round
  trip (rank 0 sends and waits for the reply, rank 1 receives and sends it back), with
  the receiver already waiting when the data lands;
* ``post send``: the sender's cost of one ``isend`` (rank 0 posts a burst of them, the
  receiver drains them afterwards);
* ``recv ready``: the receiver's cost of ``irecv`` + ``wait`` for a message that arrived
  already (the burst above, received after the sender finished posting and a short sleep).

Systems: ``raw zmq ipc`` and ``raw zmq tcp`` (PAIR sockets, the body sent by copy below
64 KiB and zero-copy above, received zero-copy and copied into a preallocated tensor: what a
hand-written transfer costs), ``gloo`` (``torch.distributed`` isend/irecv over a TCPStore on
loopback), ``cellmesh`` (the zmq backend, shared memory between the two processes) and
``cellmesh sockets`` (the same backend with ``CELLMESH_SHM=0``: every body through the Unix
socket). No job keys are installed: this is the transport itself (docs/benchmarks.md's
security section has what the keys cost).

    python bench/p2p.py [--rounds 5] [--reps 200] [--only cellmesh,raw zmq ipc]
    python bench/p2p.py --spin cellmesh --seconds 20   # a long ping-pong of one system, for py-spy
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
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep the bench folder from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KIB = 1 << 10
SIZES = (32 * KIB, 256 * KIB, 4096 * KIB)
SYSTEMS = ("raw zmq ipc", "raw zmq tcp", "gloo", "cellmesh", "cellmesh sockets")
COPY_BELOW = 64 * KIB  # raw zmq: bodies below this are copied into the message (as cellmesh does)
TIMEOUT = timedelta(seconds=60)


class Endpoint:
    """One system's point-to-point calls in one rank: ``send`` returns a handle with ``wait``."""

    def __init__(self, send: Callable[[torch.Tensor, int], Any], recv: Callable[[torch.Tensor, int], None],
                 close: Callable[[], None]) -> None:
        self.send, self.recv, self.close = send, recv, close


class _Done:
    def wait(self) -> None:
        pass


def _raw_zmq(rank: int, kind: str, exchange: Any) -> Endpoint:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    if rank == 0:
        sock.bind("tcp://127.0.0.1:*" if kind == "tcp" else f"ipc:///tmp/cm-bench-p2p-{os.getpid()}.sock")
        exchange(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    else:
        sock.connect(exchange(None))

    def send(t: torch.Tensor, peer: int) -> Any:
        view = t.numpy()
        if view.nbytes < COPY_BELOW:
            sock.send(view, copy=True)
            return _Done()
        return _Tracked(sock.send(view, copy=False, track=True))

    def recv(t: torch.Tensor, peer: int) -> None:
        frame = sock.recv(copy=False)
        t.numpy()[:] = memoryview(frame.buffer)

    def close() -> None:
        sock.close()
        ctx.term()

    return Endpoint(send, recv, close)


class _Tracked:
    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def wait(self) -> None:
        self.tracker.wait()


def _gloo(rank: int, exchange: Any) -> Endpoint:
    import torch.distributed as dist

    from comm.sockets import free_port

    port = exchange(free_port() if rank == 0 else None)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)

    def recv(t: torch.Tensor, peer: int) -> None:
        dist.irecv(t, peer).wait()

    return Endpoint(lambda t, peer: dist.isend(t, peer), recv, dist.destroy_process_group)


def _cellmesh(rank: int, shm: bool, registry: Any, prefix: str) -> Endpoint:
    from comm.zmq.communicator import ZmqCommunicator

    if not shm:
        os.environ["CELLMESH_SHM"] = "0"  # read when the transport binds and connects
    try:
        comm = ZmqCommunicator.create(rank=rank, world_size=2, registry=registry, prefix=prefix,
                                      timeout=TIMEOUT)
    finally:
        os.environ.pop("CELLMESH_SHM", None)

    def recv(t: torch.Tensor, peer: int) -> None:
        comm.irecv(t, peer).wait()

    return Endpoint(lambda t, peer: comm.isend(t, peer), recv, comm.close)


def _endpoints(rank: int, systems: list[str], registry_address: str, pipe: Any) -> dict[str, Endpoint]:
    from comm.registry import RemoteRegistry

    def exchange(value: Any) -> Any:
        """Rank 0 hands ``value`` to rank 1 (which passes None and gets it)."""
        if rank == 0:
            pipe.send(value)
            return value
        return pipe.recv()

    registry = RemoteRegistry(registry_address)
    out: dict[str, Endpoint] = {}
    for name in systems:
        if name.startswith("raw zmq"):
            out[name] = _raw_zmq(rank, name.rsplit(" ", 1)[1], exchange)
        elif name == "gloo":
            out[name] = _gloo(rank, exchange)
        else:
            out[name] = _cellmesh(rank, name == "cellmesh", registry, f"/bench/p2p/{name.replace(' ', '-')}")
    return out


def _pingpong(ep: Endpoint, rank: int, t: torch.Tensor, reps: int) -> float:
    """Seconds of one transfer: half the median round trip (the median keeps a round trip that another
    process's time slice delayed by milliseconds from counting: on 2 shared cores a few do)."""
    peer = 1 - rank
    trips = []
    for _ in range(reps // 2):
        start = time.perf_counter()
        if rank == 0:
            ep.send(t, peer).wait()
            ep.recv(t, peer)
        else:
            ep.recv(t, peer)
            ep.send(t, peer).wait()
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def _burst(ep: Endpoint, rank: int, t: torch.Tensor, n: int, barrier: Any) -> float:
    """Rank 0: median seconds to post one send; rank 1: median seconds to receive one already there."""
    samples = []
    if rank == 0:
        handles = []
        for _ in range(n):
            start = time.perf_counter()
            handles.append(ep.send(t, 1))
            samples.append(time.perf_counter() - start)
        barrier.wait()
        barrier.wait()
        for h in handles:
            h.wait()
    else:
        barrier.wait()
        time.sleep(0.02)  # let the bytes land
        for _ in range(n):
            start = time.perf_counter()
            ep.recv(t, 0)
            samples.append(time.perf_counter() - start)
        barrier.wait()
    return statistics.median(samples)


def _rank(rank: int, systems: list[str], rounds: int, reps: int, registry_address: str, pipe: Any,
          barrier: Any, q: Any) -> None:
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    eps = _endpoints(rank, systems, registry_address, pipe)
    tensors = {n: torch.full((n,), rank + 1, dtype=torch.uint8) for n in SIZES}
    results: list[dict[str, float]] = []
    for r in range(rounds):
        got: dict[str, float] = {}
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for n in SIZES:
            burst = 50 if n < 1 << 20 else 10
            for name in order:
                ep, t = eps[name], tensors[n]
                barrier.wait()
                _pingpong(ep, rank, t, 20)  # warm-up
                barrier.wait()
                got[f"{name}|{n}|transfer"] = _pingpong(ep, rank, t, reps)
                barrier.wait()
                side = "post send" if rank == 0 else "recv ready"
                got[f"{name}|{n}|{side}"] = _burst(ep, rank, t, burst, barrier)
        results.append(got)
    barrier.wait()
    for ep in eps.values():
        ep.close()
    q.put((rank, results))


def _spin(rank: int, name: str, seconds: float, registry_address: str, pipe: Any, barrier: Any) -> None:
    """Ping-pong 32 KiB on one system for ``seconds`` (attach py-spy to either rank)."""
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    ep = _endpoints(rank, [name], registry_address, pipe)[name]
    t = torch.zeros(32 * KIB, dtype=torch.uint8)
    barrier.wait()
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    end = time.monotonic() + seconds
    trips = 0
    while True:
        _pingpong(ep, rank, t, 10)
        trips += 10
        stop = torch.tensor([time.monotonic() > end], dtype=torch.uint8)
        if rank == 0:
            ep.send(stop, 1).wait()
        else:
            ep.recv(stop, 0)
        if stop.item():
            break
    print(f"rank {rank}: {trips} round trips", flush=True)
    barrier.wait()
    ep.close()


def _start(ctx: Any, target: Any, args: Callable[[int], tuple[Any, ...]]) -> list[Any]:
    procs = [ctx.Process(target=target, args=args(r)) for r in range(2)]
    for p in procs:
        p.start()
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=400, help="ping-pong transfers per size, system, round")
    parser.add_argument("--only", default="", help="comma-separated systems (default: all)")
    parser.add_argument("--spin", default="", help="ping-pong one system for --seconds (for a profiler)")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    systems = [s.strip() for s in args.only.split(",") if s.strip()] or list(SYSTEMS)
    from comm.registry import RegistryServer

    ctx = mp.get_context("spawn")
    server = RegistryServer()
    server.start()
    a, b = ctx.Pipe()
    barrier = ctx.Barrier(2)
    try:
        if args.spin:
            procs = _start(ctx, _spin, lambda r: (r, args.spin, args.seconds, server.address, (a, b)[r],
                                                  barrier))
            for p in procs:
                p.join()
            return
        q = ctx.Queue()
        load = os.getloadavg()[0]
        procs = _start(ctx, _rank, lambda r: (r, systems, args.rounds, args.reps, server.address, (a, b)[r],
                                              barrier, q))
        by_rank = dict(q.get(timeout=1800) for _ in range(2))
        for p in procs:
            p.join(60)
    finally:
        server.shutdown(timeout=timedelta(seconds=5))
    rounds = [{**by_rank[0][i], **by_rank[1][i]} for i in range(args.rounds)]

    def us(key: str) -> list[float]:
        return [r[key] * 1e6 for r in rounds]

    def cell(values: list[float], digits: int = 1) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    print("# cellmesh point-to-point benchmark, 2 processes on one host")
    print(f"date {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; {args.rounds} rounds x {args.reps} ping-pong "
          f"transfers; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; us, median "
          "(min-max) over rounds\n")
    base = "raw zmq ipc" if "raw zmq ipc" in systems else systems[0]
    print(f"| size | system | transfer | post send | recv ready | transfer / {base} |")
    print("|---|---|---|---|---|---|")
    for n in SIZES:
        ref = us(f"{base}|{n}|transfer")
        for name in systems:
            tr = us(f"{name}|{n}|transfer")
            ratio = [x / y for x, y in zip(tr, ref, strict=True)]
            print(f"| {n // KIB} KiB | {name} | {cell(tr)} | {cell(us(f'{name}|{n}|post send'))} | "
                  f"{cell(us(f'{name}|{n}|recv ready'))} | {cell(ratio, 2)} |")


if __name__ == "__main__":
    main()
