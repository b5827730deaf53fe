"""Targets the fork server test runs in forked children (``module:function``, called with argv)."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from collections.abc import Sequence

import torch

READ_AT_IMPORT = os.environ.get("FORKED_TARGET_VALUE", "")  # as services/faults.py reads its spec


def report(argv: Sequence[str]) -> int:
    """Print what the child is (one JSON line to stdout, i.e. its log) and exit with ``argv[0]``."""
    print(json.dumps({"argv": list(argv), "value": READ_AT_IMPORT, "cwd": os.getcwd(), "pid": os.getpid(),
                      "sid": os.getsid(0), "threads": torch.get_num_threads(), "path0": sys.path[0],
                      "stdin": sys.stdin.read(), "signals": signals(), "frozen": gc.get_freeze_count()}))
    return int(argv[0])


def sleep(argv: Sequence[str]) -> int:
    """Sleep ``argv[0]`` seconds."""
    time.sleep(float(argv[0]))
    return 0


def fail(argv: Sequence[str]) -> int:
    raise ValueError(f"failing on purpose with {list(argv)}")


def signals() -> dict[str, str]:
    """The disposition of each signal a worker's behaviour depends on."""
    return {sig.name: repr(signal.getsignal(sig)) for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM,
                                                             signal.SIGCHLD)}
