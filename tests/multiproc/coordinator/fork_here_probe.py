"""Run as a command forked from the harness (``python -m tests.multiproc.coordinator.fork_here_probe OUT``):
makes this process's fork server a fork of itself, forks a child from it, and writes as JSON what the child
saw, its exit code, the server's parent and whether ``fork_here`` was refused with a cellmesh module
loaded, a second time, and with a thread running."""

from __future__ import annotations

import json
import os
import sys
import threading
import types
from pathlib import Path

from coordinator.runtime import forkserver


def main() -> None:
    out = Path(sys.argv[1])
    refused = []
    sys.modules["services.probe_module"] = types.ModuleType("services.probe_module")  # as if imported
    try:
        forkserver.fork_here()
    except RuntimeError as exc:
        refused.append(str(exc))
    del sys.modules["services.probe_module"]
    forkserver.fork_here()
    server = forkserver.shared()
    assert server is not None
    log = out.with_suffix(".child.log")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "FORKED_TARGET_VALUE": "from-here", "OMP_NUM_THREADS": "2"}
    child = server.spawn("tests.multiproc.coordinator.forked_targets:report", ["4", "y"], log_path=str(log),
                         cwd=str(out.parent), env=env)
    code = child.wait(30)
    try:
        forkserver.fork_here()
    except RuntimeError as exc:
        refused.append(str(exc))
    forkserver._shared = None  # as a process without one: refused now for the running thread alone
    gate = threading.Event()
    thread = threading.Thread(target=gate.wait, daemon=True)
    thread.start()
    try:
        forkserver.fork_here()
    except RuntimeError as exc:
        refused.append(str(exc))
    gate.set()
    server_parent = int(Path(f"/proc/{server._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    out.write_text(json.dumps({"code": code, "seen": json.loads(log.read_text().splitlines()[-1]),
                               "server_parent": server_parent, "me": os.getpid(), "refused": refused}))
    server.close()


if __name__ == "__main__":
    main()
