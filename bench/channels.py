"""What a ZeroMQ communicator of N ranks costs each rank to hold: descriptors, sockets, card bytes.

All N ranks run as threads of this process over one in-memory registry (so the descriptors are the
process's, divided by N), each rank a ``ZmqCommunicator.create``; measured after the ranks met, then after
a ring all-reduce of 64 KiB + 1 float64 values (each rank sends to its next rank and hears its previous
one), then after recursive doubling (log2 N partners), then after every rank sent one message to every
other (the full mesh, the most a rank can ever hold). Card bytes: the msgpack of one rank's card, which
every rank reads at the rendezvous.

    python bench/channels.py [--ranks 16 64 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[1])
if __name__ == "__main__":  # run as a script: the repository, not bench/, first on the path
    sys.path[0] = ROOT

import msgpack  # noqa: E402
import torch  # noqa: E402

from comm.registry.memory import MemoryRegistry  # noqa: E402
from comm.zmq.communicator import ZmqCommunicator  # noqa: E402

TIMEOUT = timedelta(seconds=300)  # also the leases: 256 ranks in one process keep theirs slowly


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _in_threads(items: list[Any], fn: Any) -> float:
    """Run ``fn(item)`` on a thread per item (the tests' ``run_ranks``); the wall seconds it took."""
    from tests.harness.threads import run_ranks

    start = time.perf_counter()
    run_ranks([functools.partial(fn, item) for item in items], timeout=TIMEOUT.total_seconds())
    return time.perf_counter() - start


def measure(n: int, mesh_up_to: int) -> dict[str, Any]:
    registry = MemoryRegistry()
    comms: list[ZmqCommunicator] = [None] * n  # type: ignore[list-item]
    base = _fds()

    def make(rank: int) -> None:
        comms[rank] = ZmqCommunicator.create(rank=rank, world_size=n, registry=registry,
                                             prefix=f"/bench/ch{n}", timeout=TIMEOUT, liveness_ttl=TIMEOUT)

    met_s = _in_threads(list(range(n)), make)
    row: dict[str, Any] = {"ranks": n, "meet_s": met_s,
                           "card_bytes": len(msgpack.packb(comms[0]._transport._cards[0], use_bin_type=True))}

    def per_rank() -> float:
        return (_fds() - base) / n

    def channels() -> tuple[float, float]:
        ts = [c._transport for c in comms]
        return (sum(sum(ch.pull is not None for ch in t.channels.values()) for t in ts) / n,
                sum(sum(ch.push is not None for ch in t.channels.values()) for t in ts) / n)

    row["fds_met"] = per_rank()
    x = [torch.full((8193,), float(r), dtype=torch.float64) for r in range(n)]

    def ring(c: ZmqCommunicator) -> None:
        c.all_reduce_algorithm = "ring"
        c.all_reduce(x[c.rank])

    def doubling(c: ZmqCommunicator) -> None:
        c.all_reduce_algorithm = "doubling"
        c.all_reduce(x[c.rank])

    def mesh(c: ZmqCommunicator) -> None:
        one = torch.zeros(1)
        works = [c.isend(torch.ones(1), dst=p, tag=9) for p in range(n) if p != c.rank]
        for p in range(n):
            if p != c.rank:
                c.recv(one, src=p, tag=9)
        for w in works:
            w.wait(TIMEOUT)

    for name, fn in (("ring", ring), ("doubling", doubling), ("mesh", mesh)):
        if name == "mesh" and n > mesh_up_to:  # one process's descriptors would not hold N^2 sockets
            row.update({"mesh_s": None, "fds_mesh": None, "bound_mesh": None, "connected_mesh": None})
            continue
        row[f"{name}_s"] = _in_threads(comms, fn)
        row[f"fds_{name}"] = per_rank()
        row[f"bound_{name}"], row[f"connected_{name}"] = channels()
    _in_threads(comms, lambda c: c.close())
    registry.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--mesh-up-to", type=int, default=32, help="the full mesh only up to this many")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| ranks | card bytes | meet s | descriptors a rank: met / ring / doubling / full mesh "
          "| channels bound a rank: ring / doubling / mesh |")
    print("|---|---|---|---|---|")
    for n in args.ranks:
        row = measure(n, args.mesh_up_to)
        rows.append(row)
        def cell(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        print(f"| {n} | {row['card_bytes']} | {row['meet_s']:.2f} | {cell(row['fds_met'])} / "
              f"{cell(row['fds_ring'])} / {cell(row['fds_doubling'])} / {cell(row['fds_mesh'])} | "
              f"{cell(row['bound_ring'])} / {cell(row['bound_doubling'])} / {cell(row['bound_mesh'])} |",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
