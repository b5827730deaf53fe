"""A worker's heap after start ([Note: a worker's heap and its lease] in comm/heap.py).

The libraries' objects sit in the collector's permanent generation, so a full collection (the memory
probe runs one as each stage is built) scans only what the worker allocated since: its lease's refresh
thread is not starved of the GIL for a whole scan of torch's objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[4])

_SCRIPT = """
import gc, json
from comm.heap import settle_imports
from services.host.worker import _load_runtime
_load_runtime()
before = len(gc.get_objects())
settle_imports()
scanned = len(gc.get_objects())
probe = [[k] for k in range(1000)]  # what an assignment allocates: not frozen, collected as usual
print(json.dumps({"before": before, "frozen": gc.get_freeze_count(), "scanned": scanned,
                  "after": len(gc.get_objects())}))
"""


def test_settling_freezes_the_libraries_and_leaves_later_objects_to_the_collector() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "PYTHONPATH": ROOT})
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["before"] > 100_000, seen  # torch and torch._dynamo: a full scan's worth
    assert seen["frozen"] >= seen["before"] and seen["scanned"] < 100, seen
    assert seen["after"] >= seen["scanned"] + 1000, seen  # new objects are still tracked and collectable
