"""A local run listens on loopback only: every listening TCP socket of its processes is on 127.0.0.1.

The run's processes are this one (the coordinator: the registry, the event loop) and the
harness's workers (service hosts, data channels, and with gloo the rendezvous ``TCPStore``
and gloo's own pairs). Their listening sockets are read from ``/proc``: the socket inodes a
process holds (``/proc/PID/fd``) matched with the listening entries of its network
namespace (``/proc/PID/net/tcp`` and ``tcp6``), while each job is between two steps, with
every communicator of its plan up.
"""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta
from pathlib import Path

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job

pytestmark = pytest.mark.timeout(180)

M = "tests.multiproc.coordinator.models"
TCP_LISTEN = "0A"  # the state column of a listening socket


def _address(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s ``ADDR:PORT`` hex (host-order 32-bit words) as ``ip:port``."""
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port_hex, 16)}"


def listening(pid: int) -> list[str]:
    """Every TCP socket process ``pid`` listens on, as ``ip:port``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == TCP_LISTEN and fields[9] in inodes:
                found.append(_address(fields[1]))
    return found


def test_the_address_reader_itself() -> None:
    assert _address("0100007F:1F90") == "127.0.0.1:8080"
    assert _address("00000000:0050") == "0.0.0.0:80"
    assert _address("00000000000000000000000000000000:0016") == ":::22"
    assert _address("0000000000000000FFFF00000100007F:0016") == "127.0.0.1:22"


def test_every_listening_socket_of_a_local_run_is_on_loopback() -> None:
    factories = [f"{M}:mlp", f"{M}:regression", f"{M}:mse"]
    plans = {"dp2": dict(data_parallel=2, num_stages=1), "pipeline": dict(data_parallel=1, num_stages=2)}
    seen: dict[str, dict[int, list[str]]] = {}
    with LocalHarness(["local-0", "local-1"], job="t-listen", lease_ttl=timedelta(seconds=6),
                      factories=factories) as harness:
        pids = [os.getpid(), *(p.pid for p in harness.procs.values())]
        for backend in ("zmq", "gloo"):
            for plan_name, plan in plans.items():
                key = f"{backend}/{plan_name}"
                job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", global_batch=8,
                          resources=Resources.local(2), comm_backend=backend, num_microbatches=2,
                          step_timeout_s=60, **plan)  # type: ignore[arg-type]

                def record(_: object, key: str = key) -> None:
                    seen.setdefault(key, {pid: listening(pid) for pid in pids})

                with job.attach(harness):
                    job.fit(2, callback=record)
        workers = {name: harness.address(name) for name in harness.names}
    for key, by_pid in seen.items():
        everything = [a for addresses in by_pid.values() for a in addresses]
        outside = [a for a in everything if not a.startswith("127.0.0.1:")]
        assert not outside, f"{key}: listening beyond loopback: {by_pid}"
        for name, address in workers.items():  # the reader sees the sockets it should
            assert address.removeprefix("tcp://") in everything, f"{key}: {name}'s host {address} not seen"
        # each worker holds more than its service host: the job's data channels (and the store, with gloo)
        assert all(len(by_pid[pid]) > 1 for pid in pids[1:]), f"{key}: {by_pid}"
    assert sorted(seen) == ["gloo/dp2", "gloo/pipeline", "zmq/dp2", "zmq/pipeline"]
