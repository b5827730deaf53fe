"""Keep glibc from handing large freed buffers back to the kernel on the data path.

libzmq allocates one buffer per received frame (up to 4 MiB on cellmesh's data path) and frees
it when the frame is released. With glibc's defaults, buffers of that size come from
``mmap`` and go back with ``munmap``, or the heap top is trimmed, so every frame pays page
faults when it is touched again: measured here, 4,000-16,000 faults per process per
64 MiB push/pull step and 10-15 ms of CPU (see docs/benchmarks.md). Raising
``M_MMAP_THRESHOLD`` to 32 MiB and ``M_TRIM_THRESHOLD`` to 1 GiB keeps such buffers in the
heap for reuse. The cost is that up to that much freed memory stays with the process.

:func:`tune_malloc` is called once by cellmesh's process entry points (the worker, the
demo and benchmark ranks, the test harness); a library import never changes the
allocator. ``CELLMESH_MALLOC_TUNE=0`` turns it off. On a C library other than glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MALLOC_TUNE_ENV", "tune_malloc"]

log = logging.getLogger(__name__)

MALLOC_TUNE_ENV = "CELLMESH_MALLOC_TUNE"
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum for this option
_TRIM_THRESHOLD = 1 << 30

_done = False


def tune_malloc() -> bool:
    """Apply the thresholds once per process; True if they are in force."""
    global _done
    if _done:
        return True
    if os.environ.get(MALLOC_TUNE_ENV, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) and ok
    if not ok:
        log.debug("mallopt refused the cellmesh thresholds")
    _done = ok
    return ok
