"""A small real job to attack while it runs, and what an attacker can learn about it.

The job: the coordinator tests' MLP in float64, two pipeline stages on two local worker
processes (so the zmq transport's data channels are up between them), trained with SGD
for a few dozen steps and compared with ``coordinator.runtime.reference.train_reference``.
:func:`fit_under_attack` starts the attacker process after the first step (services
placed, the pipeline's communicator joined) and slows the job's steps while it runs, so
the attack overlaps training; the job then finishes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from comm import auth
from comm.codec import unpack
from comm.logs import log_to_file
from comm.zmq.door import ChannelRequest, ask
from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.records import StepRecord
from coordinator.runtime.reference import max_abs_diff, train_reference
from services.protocol import WorkerCard
from tests.multiproc.security.outsider import Port, Targets

__all__ = ["Run", "attacker", "check_against_reference", "coordinator_keys_copy", "fit_under_attack",
           "log_lines", "small_job", "steal_worker_keys", "targets_of"]

M = "tests.multiproc.coordinator.models"
TOL64 = 1e-9  # float64: the plan and one process sum in different orders
PACE_S = 0.1  # a step's extra time while the attacker runs
ATTACK_TIMEOUT_S = 90.0
KINDS = ("compute", "param_server", "barrier")


def small_job(log_dir: Path) -> Job:
    return Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
               optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, model_kwargs={"dtype": "float64"},
               data_kwargs={"dtype": "float64"}, global_batch=16, seed=5, step_timeout_s=60,
               resources=Resources.local(workers=2), data_parallel=1, num_stages=2, num_microbatches=2,
               schedule="1f1b", log_dir=log_dir,
               steps_per_request=2)  # windows of 2 steps: the callback paces the steps while the attack runs


def targets_of(harness: LocalHarness, marker: Path) -> Targets:
    """Every serving socket of the running job: worker hosts (and their services), registry, data channels."""
    registry = harness.registry
    workers: dict[str, Port] = {}
    for kv in registry.list(f"/cellmesh/{harness.job}/workers/"):
        card = unpack(kv.value, WorkerCard)
        services = {"worker": "worker"}
        for name in card.services:
            kind = next((k for k in KINDS if k in name), None)
            if kind is not None:
                services[name] = kind
        workers[card.name] = Port(address=card.address, services=services)
    credentials = auth.installed()
    assert credentials is not None, "the harness installs the coordinator's keys in this process"
    groups: dict[str, dict[int, dict[str, Any]]] = {}  # a communicator's prefix -> rank -> card
    for kv in registry.list("/"):
        if "/members/" in kv.key:
            prefix, rank = kv.key.rsplit("/members/", 1)
            groups.setdefault(prefix, {})[int(rank)] = msgpack.unpackb(kv.value, raw=False)
    doors: list[Port] = []
    data: list[Port] = []
    for cards in groups.values():
        for card in cards.values():
            doors.append(Port(address=card["door"], services={"door": "door"}))
            # each rank's channel for every peer, as an insider finds it: asking the rank's door (it binds
            # the channel if that peer never sent to the rank)
            for peer in sorted(cards):
                if card["door"] != cards[peer]["door"]:
                    got = ask(card["door"], ChannelRequest(src=peer, host_key="elsewhere"),
                              deadline_at=time.monotonic() + 30, slice_ms=100, check=_no_wait_past(30),
                              what=f"asking {card['door']} for rank {peer}'s channel")
                    data.append(Port(address=got.tcp, peer=peer))  # the card's rank's socket for ``peer``
    return Targets(job=harness.job, workers=workers,
                   registry=Port(address=harness.registry_url, services={"registry": "registry"}),
                   data=data, doors=doors, server_public_key=credentials.keys.server.public,
                   marker=str(marker))


def _no_wait_past(seconds: float) -> Callable[[], None]:
    deadline = time.monotonic() + seconds

    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"a rank's door did not answer within {seconds:.0f}s")
    return check


def steal_worker_keys(harness: LocalHarness) -> Path:
    """Where a worker's copy of the keys is, found as a local intruder of the same user would: named in the
    worker's ``/proc/PID/environ``, or (a worker forked from the fork server sets its environment after
    the fork, so that file shows the server's) the job's key directory under the temporary directory."""
    pid = next(iter(harness.procs.values())).pid
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    named = [v for v in environ if v.startswith(auth.KEYS_DIR_ENV.encode() + b"=")]
    if named:
        return Path(named[0].split(b"=", 1)[1].decode())
    # the key files sit in a 0700 directory under the temporary directory, named after the job
    found = Path(tempfile.gettempdir()).glob(f"cellmesh-{harness.job}-keys-*")
    [directory] = [d for d in found if d.is_dir()]
    return directory


def coordinator_keys_copy(directory: Path) -> Path:
    """This process's keys (it is the coordinator) in a private directory, for the fuzzer."""
    credentials = auth.installed()
    assert credentials is not None
    credentials.keys.save(directory)
    return directory


def attacker(command: str, targets: Targets, work: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start ``outsider.py command`` in a process of its own, its report going to ``work/command.json``."""
    path = work / f"{command}-targets.json"
    path.write_text(targets.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k != auth.KEYS_DIR_ENV}  # it never joined the job
    with open(work / f"{command}.json", "wb") as out, open(work / f"{command}.err", "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "tests.multiproc.security.outsider", command,
                                 "--targets", str(path), *extra], stdout=out, stderr=err, env=env,
                                stdin=subprocess.DEVNULL)


@dataclass
class Run:
    """What a run under attack left: its result, the attacker's exit code, whether the workers lived,
    and the registry's keys at the end of training."""

    result: FitResult
    attacker_code: int | None
    workers_alive_at_end: bool
    worker_exit_codes: dict[str, int | None]
    registry_keys: list[str]


def fit_under_attack(job: Job, steps: int, start: Callable[[LocalHarness], subprocess.Popen[bytes]],
                     coordinator_log: Path) -> Run:
    """Train ``steps`` steps; after the first, ``start`` the attack, and pace the steps until it ends."""
    proc: subprocess.Popen[bytes] | None = None
    harness: LocalHarness | None = None

    def paced(record: StepRecord) -> None:
        nonlocal proc
        assert harness is not None
        if proc is None:
            proc = start(harness)
        elif record.step >= steps - 3:  # the last steps run after the attack is over
            proc.wait(ATTACK_TIMEOUT_S)
        elif proc.poll() is None:
            time.sleep(PACE_S)

    with log_to_file(coordinator_log), job:
        harness = job.harness
        assert harness is not None
        result = job.fit(steps, callback=paced)
        alive = all(p.poll() is None for p in harness.procs.values())
        keys = [kv.key for kv in harness.registry.list("/")]
    codes = {name: p.returncode for name, p in harness.procs.items()}
    assert proc is not None
    return Run(result=result, attacker_code=proc.poll(), workers_alive_at_end=alive, worker_exit_codes=codes,
               registry_keys=keys)


def check_against_reference(job: Job, run: Run, steps: int) -> None:
    """The job trained as one process does, and moved (so the comparison means something)."""
    ref = train_reference(job, steps)
    diff = max_abs_diff(run.result.state_dict, ref.state_dict)
    assert diff < TOL64, f"the attacked job's parameters differ from one process's by {diff:.3g}"
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3, "the reference did not move"


def log_lines(paths: list[Path], levels: tuple[str, ...] = ("ERROR", "WARNING", "CRITICAL")) -> list[str]:
    """The lines of ``paths`` at one of ``levels`` (the human log format: ``time LEVEL logger: ...``)."""
    found = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) > 2 and parts[2] in levels:
                found.append(f"{path.name}: {line}")
    return found
