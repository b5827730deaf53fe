"""Garbage never hurts or floods: 10,000 invalid frames at every port of a running job.

``outsider.py fuzz``, a process of its own, throws ``frames.py``'s stream at the worker
hosts, the embedded registry and the zmq transport's data channels of a small job while
it trains: random bytes, msgpack that is no envelope, envelopes of every message type of
``services/protocol/`` and ``comm/registry/protocol.py`` with wrong fields, wrong types,
wrong versions, huge sizes and truncated tensors, broken tensor headers, frames over the
size limit, and raw TCP garbage — with the coordinator's and the workers' own keys (so the
frames reach the validators), a stranger's key and no key at all. ``test_frames.py`` proves
every one of those frames is invalid, so none may change the job.

Then: nothing crashed (the workers lived and exited 0, no traceback, no ``internal``
reply), the job trained to one process's parameters, and the logs stayed bounded: a few
warnings per peer and reason, not one per frame.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from comm.refusals import REFUSALS
from coordinator.runtime.harness import LocalHarness
from tests.multiproc.security import test_frames
from tests.multiproc.security.outsider import Targets
from tests.multiproc.security.running import (
    attacker,
    check_against_reference,
    coordinator_keys_copy,
    fit_under_attack,
    log_lines,
    small_job,
    targets_of,
)

pytestmark = pytest.mark.timeout(300)

FRAMES = 10_000
STEPS = 24
LOG_BOUND = 50  # ERROR and WARNING lines of every process together: not growing with FRAMES


def test_ten_thousand_bad_frames_change_nothing_crash_nothing_and_log_little(tmp_path: Path) -> None:
    job = small_job(tmp_path / "workers")
    keys = tmp_path / "keys"
    found: list[Targets] = []
    refused_before = REFUSALS.counts()

    def start(harness: LocalHarness) -> subprocess.Popen[bytes]:
        targets = targets_of(harness, tmp_path / "pwned")
        found.append(targets)
        return attacker("fuzz", targets, tmp_path, "--keys-dir", str(coordinator_keys_copy(keys)),
                        "--frames", str(FRAMES), "--seed", str(test_frames.SEED))

    run = fit_under_attack(job, STEPS, start, tmp_path / "coordinator.log")
    assert run.attacker_code == 0, (tmp_path / "fuzz.err").read_text()
    report = json.loads((tmp_path / "fuzz.json").read_text())
    (targets,) = found
    assert targets.data and len(targets.workers) == 2

    # every port got its share, with every identity
    sent = report["sent"]
    assert sum(sent.values()) >= FRAMES, sent
    for kind in ("control", "data"):
        for who in ("coordinator-key", "worker-key"):
            assert sent.get(f"{kind} {who}", 0) > 500, sent
        for who in ("stranger", "plain"):  # their queues fill: a connection that is refused takes nothing
            assert sent.get(f"{kind} {who}", 0) > 0, sent
    assert sent["raw tcp"] >= 20 and sent["huge"] == 3, sent
    # each stream's frames are among those test_frames.py proved invalid
    assert max(report["streams"].values()) <= test_frames.N, report["streams"]
    # the frames with the job's keys reached the validators: answered with errors, never served
    replies = report["replies"]
    assert replies.get("coordinator-key: bad_request", 0) > 1000, replies
    # (how many of a worker key's frames name a coordinator-only method depends on the mix: 90-140 here)
    assert replies.get("worker-key: forbidden", 0) > 50, replies
    assert not [k for k in replies if k.endswith(": ok") or k.endswith(": internal")], replies
    assert not [k for k in replies if k.startswith(("stranger", "plain"))], replies  # outsiders: silence
    # the doors (comm/zmq/door.py) answered the key holders' garbage with errors and opened nothing
    assert targets.doors and sum(v for k, v in sent.items() if k.startswith("door ")) > 100, sent
    refused = replies.get("coordinator-key: door refused", 0) + replies.get("worker-key: door refused", 0)
    assert refused > 50, replies
    assert not [k for k in replies if k.endswith("door opened a channel")], replies

    # nothing crashed, nothing changed
    assert run.workers_alive_at_end and run.worker_exit_codes == {"local-0": 0, "local-1": 0}
    check_against_reference(job, run, STEPS)
    assert not (tmp_path / "pwned").exists()

    # the registry (in this process) counted what it refused
    counts = REFUSALS.counts()
    assert counts.get(("frame", "rpc/bad_request"), 0) > refused_before.get(("frame", "rpc/bad_request"), 0)

    # the logs stayed bounded; the workers did see (and say) what they dropped
    logs = [*sorted((tmp_path / "workers").glob("*.log")), tmp_path / "coordinator.log"]
    noisy = log_lines(logs)
    assert len(noisy) < LOG_BOUND, "\n".join(noisy)
    worker_lines = "\n".join(log_lines(logs[:-1]))
    for said in ("dropped a bad data message", "rejected a bad request", "refused a connection"):
        assert said in worker_lines, worker_lines
    assert not [line for p in logs for line in p.read_text().splitlines() if "Traceback" in line]
