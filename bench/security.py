"""What the job's authentication costs: security off against on, side by side in the same processes.

Two measurements, two processes each:

- control round trip: one :class:`~comm.rpc.RpcClient` call of an empty request to a
  :class:`~comm.rpc.ServiceHost` in another process, security off (no keys) and on (CURVE,
  ``comm/auth.py``);
- zmq ``all_reduce`` of 16 and 64 MiB float32, security off, on with the data plane
  ``encrypted`` (CURVE, the default) and on with it ``authenticated`` (PLAIN with the job's
  token; see docs/security.md). Once as a local run does it (same-host bodies through shared
  memory, ``comm/zmq/shm.py``: at most the headers cross the socket) and once with
  ``CELLMESH_SHM=0``, every body through the socket, as between two hosts (loopback TCP
  stands in for the network).

Every setting lives in the same pair of processes at once (a host, a client or a
communicator made while that setting's credentials were installed: sockets take their
security when made), and the settings take turns call by call (round trips: blocks of
``--calls``), so the load of a shared machine hits them alike and each "on" sample has an
"off" neighbour a few milliseconds away. A round starts fresh processes; the table gives the
median over rounds of each round's median, the spread (min-max) over rounds, and the ratio
of each setting to "off" from neighbouring samples.

    python bench/security.py [--rounds 5] [--calls 200] [--blocks 20] [--reps 30]
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: the repository root on the path, not bench/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from comm import auth
from comm.codec import Message
from comm.rpc import Call, ServiceBase

MIB = 1 << 20
SIZES_MIB = (16, 64)
WORLD = 2
# name -> the data plane of its credentials (None: no keys); "off" first: the ratios divide by it
SETTINGS: dict[str, auth.DataPlane | None] = {
    "off": None, "on": "encrypted", "on-authenticated": "authenticated"}
CONTROL_SETTINGS = ("off", "on")  # the control plane is CURVE whatever the data plane's mode
Samples = dict[str, dict[str, list[float]]]  # metric -> setting -> samples


class Ping(Message):
    """The empty request and reply of the round trip."""


class _Echo(ServiceBase):
    def rpc_ping(self, request: Ping, call: Call) -> Ping:
        return request


def _credentials(keys_dir: str, role: auth.Role, setting: str) -> auth.Credentials | None:
    plane = SETTINGS[setting]
    if plane is None:
        return None
    return auth.Credentials(auth.JobKeys.load(Path(keys_dir)), role, data_plane=plane)


def _hosts(keys_dir: str, address_q: Any, stop_q: Any) -> None:
    """The served side of the round trip: one ServiceHost per control setting."""
    from comm.rpc import ServiceHost

    hosts = {}
    for setting in CONTROL_SETTINGS:
        auth.install(_credentials(keys_dir, "worker", setting))
        hosts[setting] = ServiceHost("127.0.0.1")
        hosts[setting].add("echo", _Echo())
        hosts[setting].start()
    address_q.put({s: h.address for s, h in hosts.items()})
    stop_q.get(timeout=600)
    for host in hosts.values():
        host.shutdown(timedelta(seconds=5))


def round_trips(ctx: Any, keys: auth.JobKeys, keys_dir: str, calls: int, blocks: int) -> Samples:
    """Per block and setting: the median seconds of ``calls`` calls, settings taking turns."""
    from comm.rpc import RpcClient

    address_q, stop_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_hosts, args=(keys_dir, address_q, stop_q))
    proc.start()
    samples: dict[str, list[float]] = {s: [] for s in CONTROL_SETTINGS}
    try:
        addresses = address_q.get(timeout=60)
        clients = {}
        for setting in CONTROL_SETTINGS:
            auth.install(auth.Credentials(keys, "coordinator") if SETTINGS[setting] else None)
            clients[setting] = RpcClient(addresses[setting], timeout=timedelta(seconds=30))
        for block in range(blocks + 1):  # block 0 warms up: connections, handshakes, allocations
            order = CONTROL_SETTINGS if block % 2 else CONTROL_SETTINGS[::-1]
            for setting in order:
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    clients[setting].call("echo", "ping", Ping(), Ping)
                    times.append(time.perf_counter() - start)
                if block:
                    samples[setting].append(statistics.median(times))
        for client in clients.values():
            client.close()
    finally:
        auth.install(None)
        stop_q.put(None)
        proc.join(30)
    return {"rpc": samples}


def _rank(rank: int, keys_dir: str, shm: bool, addresses: dict[str, str], prefix: str, reps: int, q: Any
          ) -> None:
    """One rank: a communicator per setting, all_reduce taking turns between them (rank 0 reports)."""
    torch.set_num_threads(1)
    if not shm:
        os.environ["CELLMESH_SHM"] = "0"
    from comm.allocator import tune_malloc
    from comm.base import Communicator
    from comm.factory import init_communicator
    from comm.registry import RemoteRegistry

    tune_malloc()
    comms: dict[str, Communicator] = {}
    registries = []
    for setting in SETTINGS:
        auth.install(_credentials(keys_dir, "worker", setting))  # its sockets are made now, with these
        registry = RemoteRegistry(addresses["off" if SETTINGS[setting] is None else "on"])
        registries.append(registry)
        comms[setting] = init_communicator("zmq", rank=rank, world_size=WORLD, registry=registry,
                                           prefix=f"{prefix}/{setting}", timeout=timedelta(seconds=120))
    samples: Samples = {}
    for mib in SIZES_MIB:
        x = torch.ones(mib * MIB // 4)
        metric = f"all_reduce_{mib}"
        samples[metric] = {s: [] for s in SETTINGS}
        for rep in range(reps + 1):  # rep 0 warms up: connections, shared-memory slots, pages
            order = list(SETTINGS) if rep % 2 else list(SETTINGS)[::-1]
            for setting in order:
                comm = comms[setting]
                comm.barrier()
                start = time.perf_counter()
                comm.all_reduce(x)
                seconds = time.perf_counter() - start
                if rep:
                    samples[metric][setting].append(mib * MIB / seconds / 1e9)
    for comm in comms.values():
        comm.close()
    for registry in registries:
        registry.close()
    if rank == 0:
        q.put(samples)


def all_reduces(ctx: Any, keys: auth.JobKeys, keys_dir: str, shm: bool, prefix: str, reps: int) -> Samples:
    """GB/s of each all_reduce, per setting, in one pair of rank processes."""
    from comm.registry import RegistryServer

    servers = {}
    for name, credentials in (("off", None), ("on", auth.Credentials(keys, "coordinator"))):
        auth.install(credentials)
        servers[name] = RegistryServer().start()
    auth.install(None)
    q = ctx.Queue()
    try:
        addresses = {name: str(server.address) for name, server in servers.items()}
        procs = [ctx.Process(target=_rank, args=(r, keys_dir, shm, addresses, prefix, reps, q))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        result: Samples = q.get(timeout=900)
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"an all_reduce rank exited with {p.exitcode}")
    finally:
        for server in servers.values():
            server.shutdown(timeout=timedelta(seconds=5))
    suffix = "shm" if shm else "tcp"
    return {f"{metric}_{suffix}": values for metric, values in result.items()}


def _cell(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(rounds: list[Samples], args: argparse.Namespace) -> None:
    names = list(SETTINGS)
    print(f"# cellmesh security cost, {WORLD} processes on loopback")
    print(f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.rounds} rounds; round trips: {args.blocks} blocks of {args.calls} calls per setting, "
          f"all_reduce: {args.reps} calls per setting and size; median over rounds of each round's median "
          "(min-max over rounds)\n")
    print(f"| metric | {' | '.join(names)} | {' | '.join(f'{n} / off' for n in names[1:])} |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for metric in rounds[0]:
        label = ("control round trip, us" if metric == "rpc" else
                 "all_reduce {} MiB, {}, GB/s".format(*metric.split("_")[2:]))
        scale = 1e6 if metric == "rpc" else 1.0
        values, ratios = [], []
        for name in names:
            if name not in rounds[0][metric]:
                values.append("(as on)")
                continue
            values.append(_cell([statistics.median(r[metric][name]) * scale for r in rounds]))
            if name != "off":  # each sample against its "off" neighbour of the same turn
                pairs = [zip(r[metric][name], r[metric]["off"], strict=True) for r in rounds]
                ratios.append(_cell([statistics.median(a / b for a, b in p) for p in pairs]))
        ratios += ["(as on)"] * (len(names) - 1 - len(ratios))
        print(f"| {label} | {' | '.join(values)} | {' | '.join(ratios)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes, this many times")
    parser.add_argument("--calls", type=int, default=200, help="round trips per block")
    parser.add_argument("--blocks", type=int, default=20, help="round-trip blocks per setting and round")
    parser.add_argument("--reps", type=int, default=30, help="all_reduce calls per setting, size and round")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from comm.allocator import tune_malloc

    tune_malloc()
    ctx = mp.get_context("spawn")
    keys = auth.JobKeys.generate()
    rounds: list[Samples] = []
    with tempfile.TemporaryDirectory(prefix="cellmesh-bench-keys-") as keys_dir:
        keys.for_workers().save(Path(keys_dir))
        for i in range(args.rounds):
            samples = round_trips(ctx, keys, keys_dir, args.calls, args.blocks)
            for shm in (True, False):
                samples.update(all_reduces(ctx, keys, keys_dir, shm, f"/bench/security/{i}/{shm}", args.reps))
            rounds.append(samples)
    report(rounds, args)


if __name__ == "__main__":
    main()
