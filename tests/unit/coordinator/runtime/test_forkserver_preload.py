"""The fork server preloads what every worker loads at start, so a forked worker imports none of it."""

from __future__ import annotations

from coordinator.runtime.forkserver import PRELOAD
from services.host.worker import RUNTIME_MODULES


def test_the_fork_server_preloads_every_runtime_module_of_a_worker() -> None:
    missing = [m for m in RUNTIME_MODULES if m not in PRELOAD]
    assert not missing, f"add {missing} to coordinator/runtime/forkserver.py's PRELOAD"
