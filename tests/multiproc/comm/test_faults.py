"""Fault injection: a rank killed (SIGKILL) or frozen (SIGSTOP) while the others communicate.

Every survivor must raise PeerLostError (or CommTimeoutError) naming the lost rank within
the test's op timeout, and never hang; afterwards the survivors still serve commands and
exit cleanly. The liveness lease is 1 s (embedded registry), so a frozen rank is declared
lost after about a second; a killed one errors gloo at once.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from typing import Any

import pytest

from tests.harness.procs import RankGroup

CHECKS = "tests.multiproc.comm.checks"
WORLD = 3
VICTIM = 1
OP_TIMEOUT_S = 5.0
LIVENESS_TTL = timedelta(seconds=1)
# How late after the fault a survivor may report it: the op timeout plus scheduling slack (a loaded
# 2-core machine has delayed a starved survivor by ~2 s; typical reports come ~1 s after the fault).
REPORT_WITHIN_S = OP_TIMEOUT_S + 4.0

ALL_REDUCE = ("loop_all_reduce", {"numel": 1 << 20})
# The victim sends to the others, which block in recv (gloo: the watchdog path).
RECV_FROM_VICTIM = ("loop_recv_from", {"numel": 1 << 16, "hub": VICTIM})


def _fault_run(backend: str, sig: signal.Signals, loop: tuple[str, dict[str, Any]]) -> None:
    fn, kwargs = loop
    op_timeout = timedelta(seconds=OP_TIMEOUT_S)
    survivors = [r for r in range(WORLD) if r != VICTIM]
    with RankGroup(WORLD, backend, timeout=op_timeout, liveness_ttl=LIVENESS_TTL) as group:
        group.run(f"{CHECKS}:warm_up", timeout=timedelta(seconds=30))
        pending = group.submit(f"{CHECKS}:{fn}", seconds=30.0, timeout_s=OP_TIMEOUT_S, **kwargs)
        time.sleep(0.7)  # the loops are running
        fault_at = time.time()
        group.kill(VICTIM, sig)
        try:
            wait = timedelta(seconds=REPORT_WITHIN_S + 20)
            results = group.collect(pending, ranks=survivors, timeout=wait)
        finally:
            if sig != signal.SIGKILL:
                group.kill(VICTIM, signal.SIGKILL)
        # The survivors outlive the fault and the victim's final death (no abort in a
        # backend thread when its connections reset).
        time.sleep(0.5)
        assert group.run(f"{CHECKS}:ping", ranks=survivors, timeout=timedelta(seconds=10)) == survivors
    # ... and shut down cleanly: exit code 0, not an abort from a backend thread at exit.
    assert [group.exitcodes[r] for r in survivors] == [0] * len(survivors), group.exitcodes
    for rank, outcome in zip(survivors, results, strict=True):
        where = f"{backend} {fn} rank {rank} after {sig.name} of rank {VICTIM}: {outcome}"
        assert outcome["error"] in ("PeerLostError", "CommTimeoutError"), where
        assert outcome["peer"] == VICTIM, where
        assert str(VICTIM) in outcome["message"], where
        took = outcome["at"] - fault_at
        print(f"{backend} {fn} {sig.name}: rank {rank} raised {outcome['error']} after {took:.2f}s "
              f"({outcome['iterations']} iterations before): {outcome['message']}")
        assert took <= REPORT_WITHIN_S, f"reported {took:.2f}s after the fault; {where}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "zmq"])
def test_killed_rank_is_named(backend: str) -> None:
    _fault_run(backend, signal.SIGKILL, ALL_REDUCE)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "zmq"])
def test_frozen_rank_is_named(backend: str) -> None:
    _fault_run(backend, signal.SIGSTOP, ALL_REDUCE)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "zmq"])
def test_frozen_sender_is_named(backend: str) -> None:
    """Receivers blocked in recv from a frozen rank are released, naming it."""
    _fault_run(backend, signal.SIGSTOP, RECV_FROM_VICTIM)
