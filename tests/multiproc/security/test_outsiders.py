"""Nobody outside the job is served: attacks on a running job from a process that never joined it.

A real local run (``Job.fit``: two worker processes, a two-stage pipeline, the embedded
registry in this process, which is the coordinator) is attacked while it trains by
``outsider.py attack``, a separate process:

* with no keys, and with a fresh CURVE key pair that knows the server's public key: an
  ``assign`` whose factory is ``os:system`` (the command would create a marker file),
  ``optimizer_step``, ``parameters``, ``state`` and ``release`` of the compute stages, and
  writes to the embedded registry — not one gets any reply, nothing runs, nothing changes;
* with a worker's key, stolen from ``CELLMESH_KEYS_DIR`` of a worker's environment: the
  control methods are answered ``forbidden``, and nothing runs either.

The job then finishes with the parameters one process reaches on the same batches.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from comm.refusals import REFUSALS
from coordinator.runtime.harness import LocalHarness
from tests.multiproc.security.outsider import Targets
from tests.multiproc.security.running import (
    attacker,
    check_against_reference,
    fit_under_attack,
    log_lines,
    small_job,
    steal_worker_keys,
    targets_of,
)

pytestmark = pytest.mark.timeout(240)

STEPS = 24


def test_outsiders_are_never_served_and_a_stolen_worker_key_is_forbidden(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    job = small_job(tmp_path / "workers")
    found: list[Targets] = []
    refused_before = REFUSALS.total("connection")

    def start(harness: LocalHarness) -> subprocess.Popen[bytes]:
        targets = targets_of(harness, marker)
        found.append(targets)
        return attacker("attack", targets, tmp_path, "--keys-dir", str(steal_worker_keys(harness)))

    run = fit_under_attack(job, STEPS, start, tmp_path / "coordinator.log")
    assert run.attacker_code == 0, (tmp_path / "attack.err").read_text()
    report = json.loads((tmp_path / "attack.json").read_text())

    (targets,) = found
    compute = [s for p in targets.workers.values() for s, kind in p.services.items()
               if kind == "compute"]
    # both stages were there to attack, and the data plane's channels and doors
    assert len(compute) == 2 and targets.data and targets.doors, targets
    for who in ("plain", "stranger"):
        attempts = report[who]
        # assign per worker, 4 per stage, 4 registry writes, a channel asked of every rank's door
        assert len(attempts) == 2 + 4 * len(compute) + 4 + len(targets.doors), attempts
        answered = {label: reply for label, reply in attempts.items() if reply is not None}
        assert not answered, f"an outsider ({who}) was answered: {answered}"
    stolen = report["worker-key"]
    assert len(stolen) == 2 + 4 * len(compute)
    codes = {label: (reply or {}).get("error", {}).get("code") for label, reply in stolen.items()}
    assert set(codes.values()) == {"forbidden"}, codes

    assert not marker.exists(), "os:system ran"
    cards = sorted(k for k in run.registry_keys if k.startswith(f"/cellmesh/{job.name}/workers/"))
    assert [k.rsplit("/", 1)[1] for k in cards] == ["local-0", "local-1"]  # no "evil", none deleted
    assert run.workers_alive_at_end and run.worker_exit_codes == {"local-0": 0, "local-1": 0}
    check_against_reference(job, run, STEPS)

    # the refusals were counted, and said once per peer and reason, not once per attempt
    assert REFUSALS.total("connection") > refused_before  # this process served the registry
    logs = sorted((tmp_path / "workers").glob("*.log"))
    for log in logs:  # each worker was attacked by all three; each says so once per reason
        said = log_lines([log])
        refused = [line.split("refused a connection", 1)[1] for line in said
                   if "refused a connection" in line]
        reasons = [r.split(": ", 1)[1].split(" (")[0] for r in refused]  # one warning per reason at most
        assert refused and len(reasons) == len(set(reasons)) <= 3, said
        assert len([line for line in said if "callable by coordinator only" in line]) == 1, said
    assert len(log_lines([*logs, tmp_path / "coordinator.log"])) < 20, log_lines(logs)
    assert not [line for p in logs for line in p.read_text().splitlines() if "Traceback" in line]
