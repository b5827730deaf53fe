"""Training progress for the command line: a bar on a terminal, plain log lines otherwise.

Both displays take each finished step's :class:`~coordinator.runtime.driver.StepRecord` (the
callback of ``Job.fit``) and show the step, its loss and the throughput. Throughput is
measured over a trailing window of steps, from the end of the step before the window to
the end of the last one, so it counts everything a step costs (the coordinator's own
work between steps included); the first step, which warms up, is left out of the window
once a second one exists (but not out of :attr:`Throughput.overall`).

The line format, one line per ``every`` steps and for the last step::

    step   10/150  loss 2.4123  samples/s   412.5  elapsed    1.9s

and one line per evaluation on the held-out data (``StepRecord.eval``), after its step's; the
bar shows the last one in its postfix::

    eval after step   10/150  loss 2.5011  metric 0.8125  (37 samples, 0.2s)
"""

from __future__ import annotations

import shutil
from collections import deque
from typing import Protocol, TextIO

from tqdm import tqdm

from coordinator.runtime.records import EvalRecord, StepRecord

__all__ = ["BarProgress", "LineProgress", "Progress", "Throughput", "describe_eval", "log_interval",
           "make_progress"]

WINDOW = 10  # steps in the throughput window


class Throughput:
    """Samples per second over the last ``window`` steps, and since the first step began."""

    def __init__(self, window: int = WINDOW) -> None:
        self._ends: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self.first_start: float | None = None
        self.first_end = 0.0
        self.last_end = 0.0
        self.total_samples = 0
        self.num_steps = 0
        self._first_samples = 0

    def add(self, record: StepRecord) -> None:
        if self.first_start is None:
            self.first_start = record.start
            self._ends.append((record.start, 0))
        elif len(self._ends) == 2 and self._ends[0][0] == self.first_start:
            self._ends.popleft()  # the first step warms up (connections, allocations): not in the window
        self._ends.append((record.end, record.num_samples))
        if self.num_steps == 0:
            self.first_end, self._first_samples = record.end, record.num_samples
        self.last_end = record.end
        self.total_samples += record.num_samples
        self.num_steps += 1

    @property
    def recent(self) -> float:
        """Samples/s over the window (0 before the first step)."""
        if len(self._ends) < 2:
            return 0.0
        span = self._ends[-1][0] - self._ends[0][0]
        return sum(n for _, n in list(self._ends)[1:]) / span if span > 0 else 0.0

    @property
    def elapsed(self) -> float:
        """Seconds from the first step's start to the last step's end."""
        return self.last_end - self.first_start if self.first_start is not None else 0.0

    @property
    def overall(self) -> float:
        """Samples/s over every step so far."""
        return self.total_samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def steady(self) -> float:
        """Samples/s after the first step (``overall`` while there is only one)."""
        span = self.last_end - self.first_end
        if self.num_steps < 2 or span <= 0:
            return self.overall
        return (self.total_samples - self._first_samples) / span


class Progress(Protocol):
    """What ``cellmesh run`` drives: one :meth:`update` per finished step, then :meth:`close`."""

    throughput: Throughput

    def update(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


def log_interval(steps: int, lines: int = 20) -> int:
    """A round step interval giving about ``lines`` log lines: 1, 2, 5, 10, 20, 50, ..."""
    target = max(1, steps // lines)
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale >= target:
                return mantissa * scale
        scale *= 10


def describe_eval(record: EvalRecord) -> str:
    """An evaluation's loss and metric, for people: ``loss 2.5011  metric 0.8125``."""
    metric = f"  metric {record.metric:.4f}" if record.metric is not None else ""
    return f"loss {record.loss:.4f}{metric}"


class LineProgress:
    """One plain line per ``every`` steps (and the last), flushed: for logs and pipes."""

    def __init__(self, total: int, out: TextIO, every: int | None = None) -> None:
        self.total = total
        self.out = out
        self.every = every or log_interval(total)
        self.throughput = Throughput()
        self.done = 0

    def update(self, record: StepRecord) -> None:
        self.throughput.add(record)
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total or self.done == 1:
            width = len(str(self.total))
            print(f"step {self.done:>{width}}/{self.total}  loss {record.loss:.4f}  "
                  f"samples/s {self.throughput.recent:>7.1f}  elapsed {self.throughput.elapsed:>6.1f}s",
                  file=self.out, flush=True)
        done = record.eval
        if done is not None:
            width = len(str(self.total))
            print(f"eval after step {self.done:>{width}}/{self.total}  {describe_eval(done)}  "
                  f"({done.num_samples} samples, {done.seconds:.1f}s)", file=self.out, flush=True)

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar on a terminal: step count, ETA, and the loss and samples/s as its postfix."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.throughput = Throughput()
        # the terminal's width; a pseudo-terminal without a size reports 0, which hides tqdm's bar
        width = shutil.get_terminal_size((100, 24)).columns
        self._bar = tqdm(total=total, file=out, unit="step", ncols=width, leave=True)
        self._eval = ""  # the last evaluation, shown until the next

    def update(self, record: StepRecord) -> None:
        self.throughput.add(record)
        if record.eval is not None:
            self._eval = f", eval {describe_eval(record.eval).removeprefix('loss ')}"
        self._bar.set_postfix_str(
            f"loss {record.loss:.4f}{self._eval}, {self.throughput.recent:.1f} samples/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def make_progress(total: int, out: TextIO, *, bar: bool | None = None, every: int | None = None) -> Progress:
    """A bar if ``bar`` (default: ``out`` is a terminal), else log lines every ``every`` steps."""
    if bar is None:
        bar = out.isatty()
    return BarProgress(total, out) if bar else LineProgress(total, out, every)
