"""A process that never joined the job, attacking it: ``python -m tests.multiproc.security.outsider``.

Two commands, each reading the job's ports from a JSON file (:class:`Targets`, written by
the test from the harness's cards and the registry) and printing a JSON report on stdout:

* ``attack``: the outsider attacks of ``test_outsiders.py`` — requests that would run a
  command, step an optimizer, read parameters, release a stage or write the registry,
  sent with no keys at all, with a fresh key pair that knows the server's public key, and
  with a worker's stolen key; the report says, per attempt, what came back (if anything);
* ``fuzz``: ``test_fuzz.py``'s stream of invalid frames (``frames.py``) at every port, with
  every identity, plus raw TCP garbage; the report counts what was sent and answered.

Sockets are raw ZeroMQ sockets in a context of this process's own: the attacker speaks
whatever its keys allow, and nothing of cellmesh's client code decides for it.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq
from pydantic import BaseModel

from comm.auth import Credentials, JobKeys, Role, secure_client
from comm.rpc.framing import request_frames
from services.protocol import Assignment, Empty, OptimizerSpec, OptimizerStepRequest, Release
from tests.multiproc.security.frames import STREAM_FRAMES, FrameMaker, raw_tcp

__all__ = ["Port", "Targets", "holder", "main", "stranger"]

REFUSED_WAIT_S = 2.0  # how long an attempt that should get nothing back is given to get something
ANSWER_WAIT_S = 10.0  # how long an attempt that should be answered (forbidden) may take
FUZZ_BUDGET_S = 75.0  # the fuzzer's sending, within running.py's ATTACK_TIMEOUT_S
OUTSIDERS = ("stranger", "plain")  # identities the job never lets in
Context = zmq.Context[zmq.Socket[bytes]]
Configure = Callable[[zmq.Socket[bytes]], None]
"""Gives a socket, before it connects, the identity it attacks with."""


class Port(BaseModel):
    """One serving socket of the job: a service host (its services by kind) or a data channel."""

    address: str
    services: dict[str, str] = {}  # service name -> kind ("worker", "compute", "registry"...)
    peer: int | None = None  # a data socket: the rank it receives from


class Targets(BaseModel):
    """Where the job is (what the test found in its harness and registry)."""

    job: str
    workers: dict[str, Port]  # by worker name: the worker's service host
    registry: Port
    data: list[Port]
    doors: list[Port] = []  # each rank's door, where a peer asks for its channel (comm/zmq/door.py)
    server_public_key: str  # no secret: every client of the job must know it
    marker: str = ""  # the file an executed command would create


# -- identities -----------------------------------------------------------------------------


def _plain(sock: zmq.Socket[bytes]) -> None:
    """No CURVE at all."""


def stranger(server_public: str) -> Configure:
    """A fresh key pair that knows the server's public key (which is no secret)."""
    public, secret = zmq.curve_keypair()

    def configure(sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode())

    return configure


def holder(credentials: Credentials) -> Configure:
    """Someone holding a role's keys of the job (a worker's copy stolen from its keys directory)."""

    def configure(sock: zmq.Socket[bytes]) -> None:
        secure_client(sock, credentials)

    return configure


def _socket(ctx: Context, kind: int, address: str, configure: Configure,
            hwm: int = 1000) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    configure(sock)
    sock.connect(address)
    return sock


def _identities(targets: Targets, keys_dir: str | None, roles: list[Role]) -> dict[str, Configure]:
    """``plain`` and ``stranger`` always; a role of the job for each of ``roles`` (keys in ``keys_dir``)."""
    found: dict[str, Configure] = {"plain": _plain, "stranger": stranger(targets.server_public_key)}
    if keys_dir:
        keys = JobKeys.load(Path(keys_dir))
        for role in roles:
            found[f"{role}-key"] = holder(Credentials(keys, role))
    return found


# -- attack ------------------------------------------------------------------------------------


def _assign_os_system(marker: str) -> Assignment:
    """An assignment whose factory is ``os:system``, with the command as its keyword argument."""
    command = f"touch {marker}"
    return Assignment(service="pwn", kind="compute", factory="os:system", nodes=[0, 1], seed=0,
                      options={"stage": 0, "num_stages": 1, "data": "os:system", "loss": "os:system",
                               "factory_kwargs": {"command": command}, "data_kwargs": {"command": command},
                               "loss_kwargs": {"command": command}})


def _attempts(targets: Targets) -> list[tuple[str, str, str, str, BaseModel]]:
    """``(label, address, service, method, body)`` of every attack request."""
    out: list[tuple[str, str, str, str, BaseModel]] = []
    evil = OptimizerStepRequest(optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1000.0}))
    for name, port in sorted(targets.workers.items()):
        out.append((f"{name}: worker.assign os:system", port.address, "worker", "assign",
                    _assign_os_system(targets.marker)))
        for service, kind in sorted(port.services.items()):
            if kind != "compute":
                continue
            out += [
                (f"{name}: {service}.optimizer_step", port.address, service, "optimizer_step", evil),
                (f"{name}: {service}.parameters", port.address, service, "parameters", Empty()),
                (f"{name}: {service}.state", port.address, service, "state", Empty()),
                (f"{name}: worker.release {service}", port.address, "worker", "release",
                 Release(service=service)),
            ]
    return out


def _registry_writes(targets: Targets) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """Writes an outsider tries on the embedded registry (bodies of comm/registry/protocol.py)."""
    prefix = f"/cellmesh/{targets.job}/workers/"
    addr = targets.registry.address
    return [
        ("registry.put", addr, "registry", "put", {"key": prefix + "evil", "value": b"x", "lease": None}),
        ("registry.delete", addr, "registry", "delete", {"key": prefix + sorted(targets.workers)[0]}),
        ("registry.cas", addr, "registry", "cas", {"key": prefix + "evil2", "expected": None, "value": b"x",
                                                   "lease": None}),
        ("registry.lease_revoke", addr, "registry", "lease_revoke", {"lease": 1}),
    ]


def _await(socks: list[tuple[str, zmq.Socket[bytes]]], wait_s: float) -> dict[str, dict[str, Any] | None]:
    """What each socket got back within ``wait_s`` (the decoded reply envelope, or None)."""
    got: dict[str, dict[str, Any] | None] = {label: None for label, _ in socks}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(v is None for v in got.values()):
        for label, sock in socks:
            if got[label] is None and sock.poll(20):
                frames = sock.recv_multipart()
                got[label] = msgpack.unpackb(frames[0], raw=False)
    return got


def attack(targets: Targets, keys_dir: str | None) -> dict[str, Any]:
    """Every attack with every identity; the report maps ``who`` -> attempt -> reply (or None)."""
    ctx: Context = zmq.Context()
    report: dict[str, Any] = {}
    try:
        requests = [(label, addr, svc, method, body.model_dump(mode="python"))
                    for label, addr, svc, method, body in _attempts(targets)] + _registry_writes(targets)
        ask = msgpack.packb({"v": 1, "src": 0, "host_key": "elsewhere"}, use_bin_type=True)
        for who, configure in _identities(targets, keys_dir, ["worker"]).items():
            socks = []
            for i, (label, address, service, method, body) in enumerate(requests):
                if who == "worker-key" and service == "registry":
                    continue  # the workers write the registry by design: not an attack with their key
                sock = _socket(ctx, zmq.DEALER, address, configure)
                sock.send_multipart(request_frames(i + 1, service, method, body))
                socks.append((label, sock))
            if who in OUTSIDERS:  # a worker's key opens channels by design: the doors are an outsider's
                for door in targets.doors:
                    sock = _socket(ctx, zmq.DEALER, door.address, configure)
                    sock.send(ask)
                    socks.append((f"door {door.address}: a channel", sock))
            report[who] = _await(socks, ANSWER_WAIT_S if who.endswith("-key") else REFUSED_WAIT_S)
            for _, sock in socks:
                sock.close(0)
    finally:
        ctx.term()
    return report


# -- fuzz --------------------------------------------------------------------------------------


def fuzz(targets: Targets, keys_dir: str | None, frames: int, seed: int) -> dict[str, Any]:
    """Send ``frames`` invalid frames at every port with every identity; report what happened."""
    ctx: Context = zmq.Context()
    # one stream per service kind and per data peer, each exactly what test_frames.py checks for ``seed``
    makers: dict[str | int, FrameMaker] = {}
    rng = random.Random(seed + 1)
    identities = _identities(targets, keys_dir, ["coordinator", "worker"])
    weights = {"coordinator-key": 4, "worker-key": 4, "stranger": 1, "plain": 1}
    names = [n for n in identities for _ in range(weights[n])]
    control = [*targets.workers.values(), targets.registry]
    ports = ([("control", p) for p in control] + [("data", p) for p in targets.data]
             + [("door", p) for p in targets.doors])
    socks: dict[tuple[str, str], zmq.Socket[bytes]] = {}
    sent: Counter[str] = Counter()
    replies: Counter[str] = Counter()
    full: set[tuple[str, str]] = set()  # outsiders' sockets whose queue is full: they never connect

    def sock_for(kind: str, port: Port, who: str) -> zmq.Socket[bytes]:
        key = (port.address, who)
        if key not in socks:
            zmq_kind = zmq.PUSH if kind == "data" else zmq.DEALER
            socks[key] = _socket(ctx, zmq_kind, port.address, identities[who], hwm=200)
        return socks[key]

    def drain() -> None:
        for (_, who), sock in socks.items():
            if sock.socket_type != zmq.DEALER:
                continue
            while sock.poll(0):
                reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
                error = reply.get("error") or {}
                if isinstance(error, str):  # a door's answer: an error names what was wrong, or a channel
                    replies[f"{who}: door {'refused' if error else 'opened a channel'}"] += 1
                    continue
                replies[f"{who}: {error.get('code', 'ok')}"] += 1

    started = time.monotonic()
    tcp_ports = sorted({p.address for _, p in ports if p.address.startswith("tcp://")})
    raw_per_port = max(1, frames // 50 // max(1, len(tcp_ports)))
    try:
        for address in tcp_ports:  # raw TCP garbage: not even ZeroMQ's greeting
            host, port_no = address[len("tcp://"):].rsplit(":", 1)
            for _ in range(raw_per_port):
                with socket.create_connection((host, int(port_no)), timeout=2) as s:
                    s.sendall(raw_tcp(rng))
                sent["raw tcp"] += 1
        for port in control:  # frames over the size limit: libzmq drops the connection
            sock_for("control", port, "worker-key" if "worker-key" in identities else "plain").send_multipart(
                FrameMaker.huge_control())
            sent["huge"] += 1
        draws = 0
        budget = started + FUZZ_BUDGET_S  # bounded: every stream may be spent, or every peer slow
        while sum(sent.values()) < frames and draws < 20 * frames and time.monotonic() < budget:
            draws += 1
            kind, port = rng.choice(ports)
            who = rng.choice(names)
            if (port.address, who) in full:
                continue
            # each stream stops at the frames test_frames.py proved invalid (a stream may draw most of
            # the sends: how many data ports a job has depends on when its channels are up)
            if kind == "control":
                service, service_kind = rng.choice(sorted(port.services.items()))
                maker = makers.setdefault(service_kind, FrameMaker(seed))
                if maker.made >= STREAM_FRAMES:
                    continue
                message = maker.control(service, service_kind)
            elif kind == "door":
                maker = makers.setdefault("door", FrameMaker(seed))
                if maker.made >= STREAM_FRAMES:
                    continue
                message = maker.door()
            else:
                assert port.peer is not None
                maker = makers.setdefault(port.peer, FrameMaker(seed))
                if maker.made >= STREAM_FRAMES:
                    continue
                message = maker.data(port.peer)
            try:
                sock_for(kind, port, who).send_multipart(message, flags=zmq.NOBLOCK)
                sent[f"{kind} {who}"] += 1
            except zmq.Again:
                if who in OUTSIDERS:  # an outsider's socket never connects: its queue fills, and it stops
                    full.add((port.address, who))
                else:  # a keyed socket's peer reads on, slowly on a loaded machine (or it is reconnecting
                    drain()  # after the huge frame): wait a little for room, within the attack's budget
                    sock_for(kind, port, who).poll(50, zmq.POLLOUT)
            if sum(sent.values()) % 200 == 0:
                drain()
        deadline = time.monotonic() + 3.0  # the hosts answer what they have read
        while time.monotonic() < deadline:
            drain()
            time.sleep(0.05)
    finally:
        for sock in socks.values():
            sock.close(0)
        ctx.term()
    streams = {str(key): maker.made for key, maker in makers.items()}
    return {"sent": dict(sent), "replies": dict(replies), "streams": streams,
            "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="outsider", description=__doc__)
    parser.add_argument("command", choices=["attack", "fuzz"])
    parser.add_argument("--targets", required=True, help="the JSON file of Targets")
    parser.add_argument("--keys-dir", default=None, help="stolen job keys (keys.json) to attack with too")
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    targets = Targets.model_validate_json(Path(args.targets).read_text())
    if args.command == "attack":
        report = attack(targets, args.keys_dir)
    else:
        report = fuzz(targets, args.keys_dir, args.frames, args.seed)
    json.dump(report, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
