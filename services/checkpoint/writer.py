"""The background writer: a stage's snapshots go to storage on a thread of their own, in order.

Training goes on while a part is written (the snapshot is a copy); the service reports each
finished part (:class:`~services.protocol.SavedPart`, with the error if it failed) in the
next reply it sends anyway (:meth:`PartWriter.finished`), and :meth:`PartWriter.flush`
waits, bounded, for what is still being written (the end of a run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from services.checkpoint import dcp
from services.checkpoint.stage_state import TRAIN, Snapshot
from services.protocol import SavedPart

__all__ = ["PartWriter", "part_dirs"]

log = logging.getLogger(__name__)


def part_dirs(directory: Path, part: str) -> tuple[Path, Path]:
    """Where part ``part`` of the checkpoint at ``directory`` goes: its model tensors, its training state."""
    return directory / "parts" / part, directory / TRAIN / "parts" / part


class PartWriter:
    """Writes snapshots in the background, one at a time, in the order given.

    Args:
        before_write: Called on the writing thread before each part (the fault-injection hook).
    """

    def __init__(self, before_write: Callable[[Snapshot], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._lock = threading.Lock()
        self._pending: list[Future[SavedPart]] = []
        self._before_write = before_write

    def submit(self, snap: Snapshot, directory: Path,
               then: Callable[[SavedPart], None] | None = None) -> None:
        """Write ``snap`` into the checkpoint staged at ``directory`` (returns at once).

        ``then`` (a service that answers each save by itself, e.g. a parameter shard) takes the
        part's report on the writing thread, instead of :meth:`finished` and :meth:`flush`.
        """
        if then is not None:
            self._pool.submit(lambda: then(self._write(snap, directory)))
            return
        future = self._pool.submit(self._write, snap, directory)
        with self._lock:
            self._pending.append(future)

    def _write(self, snap: Snapshot, directory: Path) -> SavedPart:
        start = time.monotonic()
        try:
            if self._before_write is not None:
                self._before_write(snap)
            model_dir, train_dir = part_dirs(directory, snap.part)
            if snap.model:
                dcp.save_part(snap.model, model_dir)
            dcp.save_part(snap.train, train_dir)
        except Exception as exc:  # reported to the coordinator, which drops this checkpoint
            log.warning("checkpoint of step %d, part %s: %s: %s", snap.step, snap.part, type(exc).__name__,
                        exc)
            return SavedPart(step=snap.step, part=snap.part, error=f"{type(exc).__name__}: {exc}"[:4000])
        log.debug("checkpoint of step %d, part %s written in %.3fs", snap.step, snap.part,
                  time.monotonic() - start)
        return SavedPart(step=snap.step, part=snap.part, model=bool(snap.model))

    def finished(self) -> list[SavedPart]:
        """The parts written (or failed) since the last call, in order; never waits."""
        with self._lock:
            done = []
            while self._pending and self._pending[0].done():
                done.append(self._pending.pop(0).result())
            return done

    def flush(self, timeout: timedelta) -> list[SavedPart]:
        """Wait until every submitted part is written; the parts not reported yet.

        Raises:
            TimeoutError: Naming how many parts were still being written after ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"{sum(not f.done() for f in pending)} checkpoint parts were still being "
                                   f"written after {timeout.total_seconds():.0f}s") from None
        return self.finished()

    def close(self) -> None:
        """Stop taking parts; what is being written finishes on its thread (never waited for here)."""
        self._pool.shutdown(wait=False, cancel_futures=False)
