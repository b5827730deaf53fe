"""A worker process's memory cap, and what the process holds (for the planner's predictions).

[Note: the memory cap] ``cellmesh worker --memory-limit BYTES`` (a local run's harness passes its
resource's ``memory_bytes``) caps what the process may map beyond what it held at start, with
``setrlimit(RLIMIT_DATA)``: the kernel refuses a private writable mapping (``brk``, ``mmap``, an
arena's growth) past ``VmData at start + BYTES``, so an allocation beyond the cap fails in the
thread that makes it, at once and whatever the allocator. torch's CPU allocator then raises
``RuntimeError: ... can't allocate memory: you tried to allocate N bytes``, Python ``MemoryError``;
the compute service turns either into an ``out_of_memory`` failure of the step that names the
worker, the cap, the bytes asked for and the action (:func:`out_of_memory_message`), and the job
stops there (a refusal: no replacement would fit either).

Why not the others (measured here, torch 2.x on glibc, ``OMP_NUM_THREADS=1``):

* ``RLIMIT_AS`` counts address space: importing torch alone maps ~590 MiB (its libraries), and
  each thread that allocates reserves a 64 MiB glibc arena (``PROT_NONE``) plus its 8 MiB stack:
  8 such threads took VmSize from 585 to 1137 MiB while RSS grew 15 MiB. A cap on it is a cap
  on threads, not on tensors.
* ``RLIMIT_DATA`` counted the same 8 threads as +56 MiB (their stacks; arenas count once
  made writable), and a loop of 16 MiB tensors under a 200 MiB cap failed at the 13th (192 MiB).
* Checking RSS after each step cannot stop the allocation that swaps, or that the OOM killer
  answers by killing a process of its choosing.

What it does not see: shared mappings (``/dev/shm`` segments of the local transport, counted
by a pod's cgroup but not here), and a C library that aborts on a failed ``malloc`` (libzmq's
I/O threads do): if the cap is hit there first, the process dies and the run treats it as a lost
worker (bounded by ``runtime.max_restarts``). The tensors are the large allocations, and they are
made on the step thread, so in practice the step fails first.

Measuring (:class:`PeakProbe`): the kernel's high-water mark of the resident set (``VmHWM``),
reset by writing ``5`` to ``/proc/self/clear_refs``, less the resident set when the probe started,
after ``malloc_trim`` handed the heap's free pages back (cellmesh keeps freed buffers in the heap:
``comm/allocator.py``). It counts every byte the process touched, tensors first, also the
allocator's slack and the communication buffers: what a cap sees.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import re
import resource
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryCap", "PeakProbe", "apply_cap", "installed_cap", "is_allocation_failure",
           "out_of_memory_message", "release_freed", "status_bytes"]

log = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
# torch's CPU allocator, errno 12's text, Python's thread start (a thread's stack is a private mapping)
_ALLOCATION_FAILED = ("can't allocate memory", "Cannot allocate memory", "out of memory",
                      "can't start new thread")


def status_bytes(field: str) -> int:
    """``VmData``, ``VmRSS``, ``VmHWM``... of this process (``/proc/self/status``), in bytes; 0 if unknown."""
    try:
        for line in _STATUS.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == field:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _fmt(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryCap:
    """The cap in force: ``limit_bytes`` beyond the ``baseline_bytes`` of data the process held at start."""

    worker: str
    limit_bytes: int
    baseline_bytes: int

    @property
    def rlimit_bytes(self) -> int:
        return self.baseline_bytes + self.limit_bytes

    def text(self) -> str:
        return (f"{_fmt(self.limit_bytes)} (--memory-limit {self.limit_bytes}, beyond the "
                f"{_fmt(self.baseline_bytes)} it held at start)")


_cap: MemoryCap | None = None
_cap_lock = threading.Lock()


def apply_cap(worker: str, limit_bytes: int) -> MemoryCap:
    """Cap this process's data at what it holds now plus ``limit_bytes`` (see [Note: the memory cap]).

    Raises:
        ValueError: ``limit_bytes`` is not positive, or the hard limit already in force is lower than
            the cap (a container's ``ulimit -d``): names both.
    """
    global _cap
    if limit_bytes <= 0:
        raise ValueError(f"--memory-limit must be a positive number of bytes, got {limit_bytes}")
    baseline = status_bytes("VmData")
    cap = MemoryCap(worker, limit_bytes, baseline)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and hard < cap.rlimit_bytes:
        raise ValueError(f"worker {worker}: --memory-limit {limit_bytes} needs RLIMIT_DATA "
                         f"{cap.rlimit_bytes} (with the {baseline} bytes held at start) but the hard limit"
                         f" is {hard}: give a smaller --memory-limit or raise the hard limit")
    resource.setrlimit(resource.RLIMIT_DATA, (cap.rlimit_bytes, hard))
    with _cap_lock:
        _cap = cap
    log.info("[worker %s] memory capped at %s", worker, cap.text())
    return cap


def installed_cap() -> MemoryCap | None:
    """The cap :func:`apply_cap` put in force in this process, if any."""
    with _cap_lock:
        return _cap


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` or what it was raised from is a failed allocation (torch's or Python's)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError):
            return True
        if isinstance(current, RuntimeError) and any(s in str(current) for s in _ALLOCATION_FAILED):
            return True
        current = current.__cause__ or current.__context__
    return False


_BARE_MEMORY_ERROR = re.compile(r"MemoryError:(?=\s*(?:$|;))")


def out_of_memory_message(failed: str) -> str:
    """``failed`` (what ran and the allocation's error), against the cap in force, and the fix."""
    cap = installed_cap()
    detail = " ".join(failed.split("\n\n", 1)[0].split())
    # Python's own MemoryError carries no text: say what it means
    detail = _BARE_MEMORY_ERROR.sub("MemoryError: can't allocate memory (Python's allocator)", detail)
    held = status_bytes("VmData")
    if cap is not None:
        limit = (f"worker {cap.worker} holds {_fmt(max(0, held - cap.baseline_bytes))} of its memory cap "
                 f"{cap.text()}")
    else:
        limit = f"the worker process (no --memory-limit; {_fmt(held)} of data mapped) ran out of memory"
    return (f"{detail}; {limit}. Fix: a plan that holds less per worker (plan.zero 1/2/3, plan.recompute, a "
            "smaller microbatch, more workers) or a larger memory_bytes in the resource list")


def release_freed() -> None:
    """Collect garbage and trim the heap (glibc). A failed step's frames can sit in reference cycles
    (an exception, its traceback, the frames holding tensors) until the collector runs: collected,
    their large tensors (``mmap``'d, ``comm/allocator.py``) go back to the system at once and stop
    counting against the cap; the small ones' pages go back as far as the heap can be trimmed."""
    gc.collect()
    _malloc_trim()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once (``find_library`` runs ``ldconfig -p`` in a subprocess each time)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _malloc_trim() -> None:
    libc = _libc()
    if libc is None:
        return
    with contextlib.suppress(AttributeError):  # not glibc
        libc.malloc_trim(0)


class PeakProbe:
    """The process's peak resident bytes since :meth:`start`, less what it held then (see the module doc)."""

    def __init__(self) -> None:
        self.baseline = 0

    def start(self) -> PeakProbe:
        gc.collect()
        _malloc_trim()
        try:
            _CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
        except OSError:
            log.debug("cannot reset VmHWM; the peak counts from the process's start")
        self.baseline = status_bytes("VmRSS")
        return self

    def peak(self) -> int:
        return max(0, status_bytes("VmHWM") - self.baseline)
