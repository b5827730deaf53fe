"""Turns: the stages one worker holds run their actions one at a time, in the worker's merged order.

An interleaved schedule puts several stages of a replica on one worker (a *rank*: rank ``r``
holds stages ``r, r + R, ...``; ``coordinator/planning/schedules.py``). Each stage is still a
compute service of its own, with its own step thread and executor, but the schedule was
validated (deadlock freedom included) for the rank running ``order[r]``, every action of its
stages, one at a time in that order. :class:`RankTurns`, one per rank in the worker process
(shared by the rank's services through :func:`acquire`, by the key the coordinator gives them),
makes the threads do exactly that: before action ``k`` of its list a stage's executor waits
until the rank's order stands at that action's position; after it, the order moves on.

Within a turn the action runs as it would alone: a receive is posted, a forward waits for
its inputs, a send is posted and not waited for (eager sends: [Note: send semantics] in
``services/compute/actions.py``), so a rank's threads behave as the one sequential rank the
validator played. What a step does outside its list (applying the previous commit, waiting for
its sends, the data-parallel all-reduce, tied sums) runs outside the turns, concurrently.

[Note: a step's turns]
A step's turns begin when the first of the rank's stages enters it (:meth:`RankTurns.step`) and
end when every position ran. A stage whose step fails leaves it with the reason: every stage of
the rank waiting for a turn in that step fails at once with it (instead of at the deadline),
and one entering it later fails too, until every stage that entered has left; then the same
step may run again (a replay after ``reconnect``). Every wait is bounded by the step's
deadline, and a timeout names the action waited for and the one the rank's order stands at.

Evaluation steps run without turns: their lists have no backward, so each stage only waits for
the stage before it, and the stages of one worker (in threads of their own) cannot wait on
each other in a cycle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from services.protocol import Action

__all__ = ["RankTurns", "StepTurns", "acquire", "positions", "release", "taking"]


class RankTurns:
    """One rank's turn-taking, shared by the services of its stages in this process.

    Args:
        key: Names the rank (the coordinator's: run, replica and rank).
        order: Every action the rank runs in a training step, in order.
    """

    def __init__(self, key: str, order: Sequence[Action]) -> None:
        self.key = key
        self.order = tuple(order)
        self._position = {a: k for k, a in enumerate(self.order)}
        self._cond = threading.Condition()
        self._step: int | None = None  # the step whose turns are taken (None: none yet)
        self._next = 0  # the position whose turn it is
        self._failed: str | None = None  # why the step was abandoned
        self._inside: set[int] = set()  # the stages inside the step now

    def positions(self, stage: int, actions: Sequence[Action]) -> list[int]:
        """Each action's position in the order.

        Raises:
            ValueError: ``actions`` is not the order restricted to ``stage``.
        """
        if tuple(actions) != tuple(a for a in self.order if a.stage == stage):
            others = sorted({a.stage for a in self.order} - {stage})
            raise ValueError(f"stage {stage} shares its worker with stages {others} and takes turns with "
                             "them: a training step's list must be its part of the worker's order "
                             "(ComputeOptions.turns)")
        return [self._position[a] for a in actions]

    def where(self) -> str:
        """Where the rank's order stands, for an error message."""
        with self._cond:
            if self._step is None or self._next >= len(self.order):
                return "no step is running"
            return f"step {self._step} stands at position {self._next} ({self.order[self._next]})"

    @contextmanager
    def step(self, step: int, stage: int, positions: Sequence[int], deadline: float) -> Iterator[StepTurns]:
        """Take part in ``step``'s turns as ``stage`` (see [Note: a step's turns]); leave on the way out.

        Raises:
            TimeoutError: The rank's previous step did not end by ``deadline``.
        """
        with self._cond:
            while self._inside and self._step != step:  # another step's stages are still inside
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"stage {stage}: the worker's step {self._step} (stages "
                                       f"{sorted(self._inside)}) did not end by step {step}'s deadline")
            if not self._inside and (self._step != step or self._failed is not None
                                     or self._next == len(self.order)):
                self._step, self._next, self._failed = step, 0, None  # a new step, or the same one again
            self._inside.add(stage)
        error: str | None = None
        try:
            yield StepTurns(self, step, stage, positions, deadline)
        except BaseException as exc:
            error = f"stage {stage} failed the step: {type(exc).__name__}: {exc}"
            raise
        finally:
            with self._cond:
                if error is not None and self._step == step and self._failed is None:
                    self._failed = error
                self._inside.discard(stage)
                self._cond.notify_all()

    def _take(self, step: int, stage: int, position: int, deadline: float) -> None:
        action = self.order[position]
        with self._cond:
            while True:
                if self._step != step:
                    raise RuntimeError(f"stage {stage}: the worker's turns moved on to step {self._step} "
                                       f"before {action} (step {step}) ran")
                if self._failed is not None:
                    raise RuntimeError(f"another stage of this worker failed step {step} before {action} "
                                       f"could run: {self._failed}")
                if self._next == position:
                    return
                if self._next > position:
                    raise RuntimeError(f"stage {stage}: {action}'s turn (position {position}) has passed; "
                                       f"the worker's order stands at {self._next}")
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if self._next == position:
                        return
                    at = self.order[self._next] if self._next < len(self.order) else None
                    raise TimeoutError(f"waited until the step's deadline for {action}'s turn (position "
                                       f"{position} of the worker's order); the order stands at position "
                                       f"{self._next} ({at}), whose stage did not run it")

    def _done(self, step: int, position: int) -> None:
        with self._cond:
            if self._step == step and self._next == position:
                self._next = position + 1
                self._cond.notify_all()


class StepTurns:
    """One stage's part of one step's turns: what its executor calls around action ``k`` of its list."""

    def __init__(self, rank: RankTurns, step: int, stage: int, positions: Sequence[int],
                 deadline: float) -> None:
        self._rank, self._step, self._stage = rank, step, stage
        self._positions = tuple(positions)
        self._deadline = deadline

    def wait(self, k: int) -> None:
        """Block until action ``k``'s turn has come (bounded by the step's deadline).

        Raises:
            TimeoutError: The deadline passed first (naming the action and where the order stands).
            RuntimeError: Another stage of the worker failed the step.
        """
        self._rank._take(self._step, self._stage, self._positions[k], self._deadline)

    def done(self, k: int) -> None:
        """Action ``k`` ran: the next position's turn."""
        self._rank._done(self._step, self._positions[k])


def positions(rank: RankTurns | None, stage: int, actions: Sequence[Action], source: str) -> list[int] | None:
    """Where a step's actions stand in the worker's order; None: the step takes no turns (no rank, or
    an evaluation step).

    Raises:
        ValueError: A training step's list is not ``stage``'s part of the worker's order.
    """
    return None if rank is None or source == "eval" else rank.positions(stage, actions)


@contextmanager
def taking(rank: RankTurns | None, step: int, stage: int, positions: Sequence[int] | None,
           deadline: float) -> Iterator[StepTurns | None]:
    """:meth:`RankTurns.step` when the step takes turns (``positions`` given), else nothing to take.

    Raises:
        TimeoutError: The worker's previous step did not end by ``deadline``.
    """
    if rank is None or positions is None:
        yield None
        return
    with rank.step(step, stage, positions, deadline) as turns:
        yield turns


_lock = threading.Lock()
_ranks: dict[str, tuple[RankTurns, int]] = {}  # key -> (the rank's turns, services holding it)


def acquire(key: str, order: Sequence[Action]) -> RankTurns:
    """The process's turns for rank ``key`` (made by its first service), held until :func:`release`.

    Raises:
        ValueError: Another service holds ``key`` with another order.
    """
    with _lock:
        turns, holders = _ranks.get(key, (None, 0))
        if turns is None:
            turns = RankTurns(key, order)
        elif turns.order != tuple(order):
            raise ValueError(f"the stages of worker rank {key!r} were given different orders")
        _ranks[key] = (turns, holders + 1)
        return turns


def release(key: str) -> None:
    """One service of rank ``key`` is done with its turns (the last one drops them)."""
    with _lock:
        turns, holders = _ranks.get(key, (None, 0))
        if turns is None:
            return
        if holders <= 1:
            del _ranks[key]
        else:
            _ranks[key] = (turns, holders - 1)
