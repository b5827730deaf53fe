"""Pipeline schedules as data: GPipe, 1F1B, ZB-H1 and interleaved 1F1B, one ordered list of actions per stage.

A schedule holds, for every stage, the :class:`~services.protocol.Action` s it runs, in
order: the very type a worker receives in ``RunStep`` (``0F3``, ``0SEND_F3``, ``1RECV_B2``...),
so the coordinator sends a stage its list as it is. A :class:`Schedule` is valid by
construction: it checks itself with ``services.compute.actions.validate_schedule``, the one
validator, whose per-stage half every worker runs on receipt. The rules, the send
semantics ([Note: send semantics]) and the step-by-stage table are that module's.

Printed (``str``), a schedule is a header and one line per stage, and parses back
(:meth:`Schedule.parse`); :meth:`Schedule.format` is the step-by-stage table.

[Note: chunks] A schedule is built by name from ``(stages, microbatches, chunks)``
(:func:`build_schedule`). ``chunks`` is how many stages each worker of the pipeline holds
(virtual stages): 1 for every schedule but ``interleaved-1f1b``, which takes ``chunks >= 2``
and puts ``p = chunks * R`` stages on ``R`` workers (rank ``r`` holds stages ``r, r + R, ...``).
:func:`schedule_problem` says why a shape is refused (naming the fix), or None; the planner
skips refused shapes and :func:`build_schedule` raises with that message.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias, cast

import numpy as np

from coordinator.planning.config import SCHEDULE_NAMES
from services.compute.actions import ScheduleError, format_schedule, validate_schedule
from services.protocol import Action, ActionKind

__all__ = ["CHUNKED", "SCHEDULES", "Schedule", "Step", "build_schedule", "chunked_fits", "gpipe",
           "interleaved_1f1b", "interleaved_group", "one_f_one_b", "peak_in_flight", "schedule_problem",
           "schedule_steps", "stage_holds", "zb_h1"]

_HEAD = re.compile(r"(\S+): (\d+) stages? x (\d+) microbatch(?:es)?")
_RANK = re.compile(r"rank (\d+) \((\d+(?:,\d+)*)\)")


@dataclass(frozen=True)
class Schedule:
    """Every stage's ordered action list; ``actions[s]`` is what stage ``s`` does, in order.

    Virtual stages. A worker of the pipeline (a *rank*) may hold several stages (interleaved
    1F1B: rank ``r`` holds stages ``r, r + R, ...``; a V schedule: ``r`` and ``2R - 1 - r``).
    ``ranks[r]`` then names the stages rank ``r`` holds, and ``order[r]`` is every action of
    those stages in the order the rank runs them, one at a time (each stage's own list is
    ``order[r]`` restricted to it). Both empty: each stage has a rank of its own (rank ``s``
    holds stage ``s``) and ``order`` is ``actions``.

    Raises:
        ScheduleError: The lists break a rule (the message names it and the actions, then
            shows the table with them marked), or ``ranks``/``order`` do not match ``actions``.
    """

    name: str
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    ranks: tuple[tuple[int, ...], ...] = ()
    order: tuple[tuple[Action, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.ranks and not self.order:
            validate_schedule(self.actions, self.num_microbatches)
            return
        p = len(self.actions)
        held = sorted(s for stages in self.ranks for s in stages)
        if held != list(range(p)):
            raise ScheduleError(f"ranks {self.ranks} must hold each of the {p} stages exactly once")
        if len(self.order) != len(self.ranks):
            raise ScheduleError(f"{len(self.ranks)} ranks need {len(self.ranks)} ordered lists, "
                                f"got {len(self.order)}")
        for r, (stages, acts) in enumerate(zip(self.ranks, self.order, strict=True)):
            for st in stages:
                if tuple(a for a in acts if a.stage == st) != self.actions[st]:
                    raise ScheduleError(f"rank {r}'s order, restricted to stage {st}, is not stage {st}'s "
                                        "list")
            if stray := [a for a in acts if a.stage not in stages]:
                raise ScheduleError(f"rank {r} holds stages {list(stages)}, but its order has {stray[0]}",
                                    stray[:1])
        validate_schedule(self.actions, self.num_microbatches, self.order)

    @property
    def num_stages(self) -> int:
        return len(self.actions)

    @property
    def num_ranks(self) -> int:
        """The workers one replica of the pipeline takes (``num_stages`` unless stages share a rank)."""
        return len(self.ranks) if self.ranks else len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        return tuple(sorted(self.ranks[rank])) if self.ranks else (rank,)

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage``."""
        if not self.ranks:
            return stage
        return next(r for r, stages in enumerate(self.ranks) if stage in stages)

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        """Everything rank ``rank`` runs, in order (its stage's list when it holds one)."""
        return self.order[rank] if self.order else self.actions[rank]

    def _head(self) -> str:
        return f"{self.name}: {self.num_stages} stages x {self.num_microbatches} microbatches"

    def __str__(self) -> str:
        """The header, one line per stage, then (stages sharing ranks) one per rank: ``rank 0 (0,2): ...``."""
        width = len(str(self.num_stages - 1))
        lines = [f"stage {s:>{width}}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.actions)]
        lines += [f"rank {r} ({','.join(map(str, stages))}): " + " ".join(map(str, acts))
                  for r, (stages, acts) in enumerate(zip(self.ranks, self.order, strict=True))]
        return "\n".join([self._head(), *lines])

    def format(self) -> str:
        """The header, then the step-by-stage table (``services.compute.actions.format_schedule``; by
        rank when stages share ranks: column ``r`` is rank ``r``)."""
        return f"{self._head()}\n{format_schedule(self.order or self.actions)}"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Parses :meth:`__str__` output back (and validates it).

        Raises:
            ScheduleError: If the header or an action does not parse, or the lists break a rule.
        """
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        head = _HEAD.fullmatch(lines[0]) if lines else None
        if head is None:
            raise ScheduleError("a schedule starts with '<name>: <p> stages x <m> microbatches'")
        stages: list[tuple[Action, ...]] = []
        ranks: list[tuple[int, ...]] = []
        order: list[tuple[Action, ...]] = []
        for line in lines[1:]:
            label, _, rest = line.partition(":")
            rank = _RANK.fullmatch(label.strip())
            if rank is not None:
                if int(rank.group(1)) != len(ranks):
                    raise ScheduleError(f"expected 'rank {len(ranks)} (<stages>): <actions>', got {line!r}")
                ranks.append(tuple(int(s) for s in rank.group(2).split(",")))
                try:
                    order.append(tuple(Action.parse(word) for word in rest.split()))
                except ValueError as exc:
                    raise ScheduleError(f"{label.strip()}: {exc}") from None
                continue
            if label.split() != ["stage", str(len(stages))]:
                raise ScheduleError(f"expected 'stage {len(stages)}: <actions>', got {line!r}")
            try:
                stages.append(tuple(Action.parse(word) for word in rest.split()))
            except ValueError as exc:
                raise ScheduleError(f"{label.strip()}: {exc}") from None
        if len(stages) != int(head.group(2)):
            raise ScheduleError(f"the header says {head.group(2)} stages, {len(stages)} follow")
        return cls(head.group(1), int(head.group(3)), tuple(stages), tuple(ranks), tuple(order))


class Step(NamedTuple):
    """An action as plain data (the planner plays these without building :class:`Action` s)."""

    stage: int
    kind: ActionKind
    microbatch: int


Lists: TypeAlias = tuple[tuple[Step, ...], ...]


def _actions(s: int, i: int, steps: tuple[tuple[ActionKind, bool], ...]) -> list[Step]:
    return [Step(s, kind, i) for kind, present in steps if present]


def _as_actions(lists: Lists) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(Action(stage=a.stage, kind=a.kind, microbatch=a.microbatch) for a in acts)
                 for acts in lists)


def _forward(s: int, i: int, p: int) -> list[Step]:
    """Receive the activations (but on stage 0), forward, send them on (but on the last stage)."""
    return _actions(s, i, (("RECV_F", s > 0), ("F", True), ("SEND_F", s < p - 1)))


def _backward(s: int, i: int, p: int, kind: ActionKind = "B") -> list[Step]:
    """Receive the gradients (but on the last stage), backward, send them on (but on stage 0).

    ``kind="I"``: only the input-gradient half (what ``SEND_B`` sends); its ``W`` comes apart.
    """
    return _actions(s, i, (("RECV_B", s < p - 1), (kind, True), ("SEND_B", s > 0)))


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need >= 1 stage and >= 1 microbatch, got {num_stages} and {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (fill, drain).

    Stage ``s`` holds the activations of all ``m`` microbatches at its peak.

    Raises:
        ValueError: If either count is < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    return Schedule("gpipe", num_microbatches, _as_actions(_gpipe(num_stages, num_microbatches)))


def _gpipe(p: int, m: int) -> Lists:
    stages = []
    for s in range(p):
        acts = [a for i in range(m) for a in _forward(s, i, p)]
        acts += [a for i in range(m) for a in _backward(s, i, p)]
        stages.append(tuple(acts))
    return tuple(stages)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up with ``p - s - 1`` forwards, alternate, cool down.

    Stage ``s`` holds at most ``min(p - s, m)`` microbatches of activations.

    Raises:
        ValueError: If either count is < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    return Schedule("1f1b", num_microbatches, _as_actions(_one_f_one_b(num_stages, num_microbatches)))


def _one_f_one_b(p: int, m: int) -> Lists:
    stages = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [a for i in range(warmup) for a in _forward(s, i, p)]
        for i in range(m - warmup):  # steady state: forward of i + warmup, then backward of i
            acts += _forward(s, i + warmup, p) + _backward(s, i, p)
        acts += [a for i in range(m - warmup, m) for a in _backward(s, i, p)]
        stages.append(tuple(acts))
    return tuple(stages)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble, Qi et al. 2023): 1F1B with every backward split into ``I`` then ``W``.

    Stage ``s`` warms up with ``min(p - s - 1, m)`` forwards as 1F1B does, then alternates a
    forward with an ``I`` (``SEND_B`` right after it: the gradients reach the stage below
    sooner); the ``W`` s follow their ``I`` s in order, each after the ``I`` that is ``s``
    later, so stage ``s`` defers up to ``s`` of them; the rest run after the last ``I``, in
    the drain, where 1F1B's later stages idle. Deferring more on later stages is the paper's
    rule: their drain bubble is the larger.

    Memory (activations held from ``F`` to ``W``): at most ``min(p, m)`` microbatches on every
    stage, the paper's "same peak as 1F1B" (1F1B's stage 0 holds ``min(p, m)``); equal for
    ``m >= p``.

    Raises:
        ValueError: If either count is < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    return Schedule("zb-h1", num_microbatches, _as_actions(_zb_h1(num_stages, num_microbatches)))


def _zb_h1(p: int, m: int) -> Lists:
    stages = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [a for i in range(warmup) for a in _forward(s, i, p)]
        weights = 0  # W's run so far (in microbatch order)
        for i in range(m):  # the i-th input gradient, after the forward it alternates with (if any is left)
            if i + warmup < m:
                acts += _forward(s, i + warmup, p)
            acts += _backward(s, i, p, "I")
            if i >= s:
                acts.append(Step(s, "W", weights))
                weights += 1
        acts += [Step(s, "W", j) for j in range(weights, m)]
        stages.append(tuple(acts))
    return tuple(stages)


def _zb_h1_kinds(p: int, m: int) -> tuple[tuple[str, ...], ...]:
    """:func:`_zb_h1` 's lists as their kinds alone (the same order; no :class:`Step` built)."""
    stages = []
    for s in range(p):
        fwd = ("RECV_F",) * (s > 0) + ("F",) + ("SEND_F",) * (s < p - 1)
        inp = ("RECV_B",) * (s < p - 1) + ("I",) + ("SEND_B",) * (s > 0)
        warmup = min(p - s - 1, m)
        kinds = list(fwd * warmup)
        weights = 0
        for i in range(m):
            if i + warmup < m:
                kinds += fwd
            kinds += inp
            if i >= s:
                kinds.append("W")
                weights += 1
        kinds += ["W"] * (m - weights)
        stages.append(tuple(kinds))
    return tuple(stages)


def interleaved_group(num_ranks: int, num_microbatches: int) -> int | None:
    """The microbatches interleaved 1F1B runs per chunk in a row (its *group*), or None if ``m`` is refused.

    Megatron runs them in groups of ``R`` (the ranks) and needs ``R | m``; as torch's
    ``ScheduleInterleaved1F1B``, cellmesh splits ``m`` into ``max(1, m // R)`` equal groups: ``R``
    when ``R`` divides ``m``, ``m`` when ``m < R`` (one group), and refuses ``m`` that does not split
    (``R = 2``: 5, 7, 9...; ``R = 4``: 5..7, 9, 11...).
    """
    rounds = max(1, num_microbatches // num_ranks)
    return None if num_microbatches % rounds else num_microbatches // rounds


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): ``chunks`` (``v``) stages per worker.

    Rank ``r`` of ``R = p / v`` holds stages ``r, r + R, ..., r + (v - 1) R`` (its chunks) and runs
    their actions merged into one order (``Schedule.order``). Forwards go through the chunks in
    groups of ``g`` microbatches (:func:`interleaved_group`; ``g = R`` when ``R | m``): forward ``k``
    of the rank is chunk ``(k // g) % v``'s microbatch ``(k // (g v)) g + k % g``; backwards go
    through the chunks the other way round, last chunk first. Rank ``r`` warms up with
    ``w_r = min((v - 1) g + 2 (R - 1 - r), v m)`` forwards, then alternates a forward and a
    backward, then drains the backwards. Each forward is its ``RECV_F``, ``F``, ``SEND_F``; each
    backward its ``RECV_B``, ``B``, ``SEND_B`` (those the stage has).

    Bubble: with equal stages, free transfers and ``R | m``, ``(R - 1) / (v m + R - 1)``, the 1F1B
    bubble of ``R`` workers shrunk by ``v``. Memory (Megatron's bound): rank ``r`` holds at most
    ``min(w_r + 1, v m)`` chunk-microbatches of activations (each a ``1/v`` of the worker's layers), so
    rank 0 holds ``(v - 1) g + 2R - 1``: ``(1 + (R - 1) / (v R)) R``-ish of its layers' microbatches, a
    little more than 1F1B's ``R``.

    Raises:
        ValueError: The shape is refused (:func:`schedule_problem` names why and the fix).
    """
    problem = schedule_problem("interleaved-1f1b", num_stages, num_microbatches, chunks)
    if problem is not None:
        raise ValueError(problem)
    order = _interleaved(num_stages, num_microbatches, chunks)
    num_ranks = len(order)
    ranks = tuple(tuple(range(r, num_stages, num_ranks)) for r in range(num_ranks))
    actions = _as_actions(_stage_lists(order, num_stages))
    return Schedule("interleaved-1f1b", num_microbatches, actions, ranks, _as_actions(order))


def _stage_lists(order: Lists, num_stages: int) -> Lists:
    """Each stage's own list, from the ranks' merged orders (rank ``s % R`` holds stage ``s``)."""
    return tuple(tuple(a for a in order[s % len(order)] if a.stage == s) for s in range(num_stages))


def _interleaved(p: int, m: int, v: int) -> Lists:
    """Interleaved 1F1B's merged order per rank (see :func:`interleaved_1f1b`): a rank's ``k``-th forward
    runs chunk ``(k // g) % v`` of microbatch ``k // (g v) * g + k % g``, its ``k``-th backward the chunks
    the other way round; each with its receive before and its send after (:func:`_forward`,
    :func:`_backward`), appended in place (a plan of 64 stages holds tens of thousands of them)."""
    num_ranks = p // v
    g = interleaved_group(num_ranks, m)
    assert g is not None
    n = v * m
    order: list[tuple[Step, ...]] = []
    for r in range(num_ranks):
        acts: list[Step] = []
        add = acts.append

        def forward(k: int, r: int = r, add: Callable[[Step], None] = add) -> None:
            s, i = (k // g) % v * num_ranks + r, k // (g * v) * g + k % g
            if s > 0:
                add(Step(s, "RECV_F", i))
            add(Step(s, "F", i))
            if s < p - 1:
                add(Step(s, "SEND_F", i))

        def backward(k: int, r: int = r, add: Callable[[Step], None] = add) -> None:
            s, i = (v - 1 - (k // g) % v) * num_ranks + r, k // (g * v) * g + k % g
            if s < p - 1:
                add(Step(s, "RECV_B", i))
            add(Step(s, "B", i))
            if s > 0:
                add(Step(s, "SEND_B", i))

        warmup = min((v - 1) * g + 2 * (num_ranks - 1 - r), n)
        for k in range(warmup):
            forward(k)
        for k in range(n - warmup):  # steady state: the next forward, then the oldest backward
            forward(warmup + k)
            backward(k)
        for k in range(n - warmup, n):
            backward(k)
        order.append(tuple(acts))
    return tuple(order)


ScheduleFn = Callable[[int, int], Schedule]
SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1,
    # (stages, microbatches) -> two chunks per worker; build_schedule passes any other count
    "interleaved-1f1b": lambda p, m: interleaved_1f1b(p, m, 2)}
if tuple(SCHEDULES) != SCHEDULE_NAMES:  # the job config checks names without importing this module
    raise ImportError(f"config.SCHEDULE_NAMES {SCHEDULE_NAMES} must list schedules.SCHEDULES "
                      f"{tuple(SCHEDULES)}")
# the schedules whose workers hold several stages (see [Note: chunks]): built with their chunk count
CHUNKED: dict[str, Callable[[int, int, int], Schedule]] = {"interleaved-1f1b": interleaved_1f1b}
# schedules whose backward is split in I and W to fill a pipeline's bubbles: nothing to fill on one stage
# ([Note: no split backward on one stage] in coordinator/planning/request.py)
SPLIT: frozenset[str] = frozenset({"zb-h1"})


@functools.lru_cache(maxsize=4096)
def chunked_fits(name: str, num_ranks: int, num_microbatches: int) -> bool:
    """Whether the chunked schedule ``name`` runs ``num_microbatches`` on ``num_ranks`` workers per replica:
    :func:`schedule_problem`'s answer for every stage count ``num_ranks * chunks`` (``chunks >= 2``), which
    reads only the workers and the microbatches (the planner asks it of thousands of shapes)."""
    return schedule_problem(name, 2 * num_ranks, num_microbatches, 2) is None


def schedule_problem(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> str | None:
    """Why schedule ``name`` cannot run ``num_stages`` stages x ``num_microbatches`` with ``chunks`` stages
    per worker, naming the fix; None if it can (see [Note: chunks])."""
    p, m, v = num_stages, num_microbatches, chunks
    if name not in SCHEDULES:
        return f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}"
    if p < 1 or m < 1 or v < 1:
        return f"need >= 1 stage, microbatch and chunk, got {p}, {m} and {v}"
    if name not in CHUNKED:
        return None if v == 1 else (f"schedule {name!r} runs one stage per worker, not chunks={v}: use "
                                    "interleaved-1f1b for several stages per worker, or chunks=1")
    if v < 2:
        return f"{name} needs chunks >= 2 stages per worker (with one, use 1f1b)"
    if p % v:
        return (f"{name} puts chunks={v} stages on each worker, so the stages must be a multiple of {v}, "
                f"not {p}: use {p - p % v or v} or {p - p % v + v} stages, or chunks dividing {p}")
    ranks = p // v
    if interleaved_group(ranks, m) is None:
        fits = [k for k in range(max(1, m - ranks), m + ranks + 1) if interleaved_group(ranks, k) is not None]
        return (f"{name} on {ranks} workers runs the microbatches in max(1, m // {ranks}) equal groups, and "
                f"num_microbatches={m} does not split into {m // ranks} equal groups: use a multiple of "
                f"{ranks} (Megatron's rule) or fewer than {ranks}; nearby counts that work: {fits}")
    return None


@functools.lru_cache(maxsize=256)
def build_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Builds a registered schedule by name with ``chunks`` stages per worker ([Note: chunks]); schedules
    are immutable, so cached.

    Raises:
        ValueError: If the name is unknown or the shape is refused (:func:`schedule_problem`'s message).
    """
    problem = schedule_problem(name, num_stages, num_microbatches, chunks)
    if problem is not None:
        raise ValueError(problem)
    if name in CHUNKED:
        return CHUNKED[name](num_stages, num_microbatches, chunks)
    return SCHEDULES[name](num_stages, num_microbatches)


_LISTS: dict[str, Callable[[int, int], Lists]] = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}


@functools.lru_cache(maxsize=64)
def schedule_steps(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> tuple[Lists, Lists]:
    """What :func:`build_schedule` builds, as plain :class:`Step` s: every rank's order and every stage's
    list (the same lists, one object: each rank holds one stage), without building or validating
    :class:`Action` s (the planner plays thousands of shapes; the schedule it picks is built and validated
    when it runs). The builders are the same, so the lists are the built schedule's.

    Raises:
        ValueError: If the name is unknown or the shape is refused (:func:`schedule_problem`'s message).
    """
    problem = schedule_problem(name, num_stages, num_microbatches, chunks)
    if problem is not None:
        raise ValueError(problem)
    if name in CHUNKED:
        order = _interleaved(num_stages, num_microbatches, chunks)
        return order, _stage_lists(order, num_stages)
    if name not in _LISTS:  # a schedule registered by name: from its built actions
        built = build_schedule(name, num_stages, num_microbatches, chunks)
        steps = tuple(tuple(Step(a.stage, a.kind, a.microbatch) for a in built.rank_actions(r))
                      for r in range(built.num_ranks))
        return steps, tuple(tuple(Step(a.stage, a.kind, a.microbatch) for a in acts)
                            for acts in built.actions)
    lists = _LISTS[name](num_stages, num_microbatches)
    return lists, lists


UNSPLIT_CHUNKED = frozenset({"interleaved-1f1b"})
"""Chunked schedules whose stages run each microbatch's forward and whole backward once (no ``I`` / ``W``):
:func:`stage_kinds` gives their kinds without building them (``tests/unit/coordinator/planning/
test_schedule_kinds.py`` holds it against the built lists)."""


def stage_kinds(name: str, num_stages: int, num_microbatches: int,
                chunks: int = 1) -> tuple[tuple[str, ...], ...]:
    """Per stage, the kinds of its list in :func:`schedule_steps` (transfers included), in order (zb-h1's
    made without building its steps); for an unsplit chunked schedule (:data:`UNSPLIT_CHUNKED`) its ``F`` s
    then its ``B`` s instead, which is all that a schedule without split backwards is asked of (how many
    backwards, none split), and costs no build: the planner's bound asks it of thousands of shapes, and an
    interleaved schedule of 128 stages takes tens of milliseconds to build (``schedule_steps`` keeps 64).
    Not kept here: the planner keeps them for one search (a module's cache of 4,096 of them held 56 MB
    after one search over 1,024 workers, and could hold gigabytes).

    Raises:
        ValueError: As :func:`schedule_steps`.
    """
    if name in UNSPLIT_CHUNKED or name == "zb-h1":
        problem = schedule_problem(name, num_stages, num_microbatches, chunks)
        if problem is not None:
            raise ValueError(problem)
        if name == "zb-h1":
            return _zb_h1_kinds(num_stages, num_microbatches)
        each = ("F",) * num_microbatches + ("B",) * num_microbatches
        return (each,) * num_stages
    return tuple(tuple(step.kind for step in steps)
                 for steps in schedule_steps(name, num_stages, num_microbatches, chunks)[1])


def stage_kind_counts(name: str, num_stages: int, num_microbatches: int,
                      chunks: int = 1) -> tuple[tuple[int, int, int], ...] | None:
    """Per stage, how many ``B``, ``I`` and ``W`` its list in :func:`schedule_steps` runs, where a closed form
    gives them: every stage of GPipe, 1F1B and interleaved 1F1B runs ``m`` whole backwards, every stage of
    ZB-H1 ``m`` of each half. None for another (a registered) schedule: count :func:`stage_kinds`. The
    planner prices a stage's backwards by these counts, and only a split list's order besides
    (``tests/unit/coordinator/planning/test_schedule_kinds.py`` holds them against the built lists).

    Raises:
        ValueError: As :func:`schedule_steps`, for a schedule it knows.
    """
    p, m = num_stages, num_microbatches
    if name not in ("gpipe", "1f1b", "zb-h1") and name not in UNSPLIT_CHUNKED:
        return None
    if (problem := schedule_problem(name, p, m, chunks)) is not None:
        raise ValueError(problem)
    return ((0, m, m),) * p if name == "zb-h1" else ((m, 0, 0),) * p


@functools.lru_cache(maxsize=4096)
def stage_holds(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> tuple[tuple[int, ...],
                                                                                            tuple[bool, ...]]:
    """Per stage of the schedule :func:`build_schedule` builds: the most microbatches it holds at once
    (:func:`peak_in_flight` of its list) and whether it defers its weight gradients
    (``services.compute.weight_grads.defers``), without the lists where a closed form gives them:

    - GPipe: every stage holds all ``m``, and defers when ``m >= 2`` (every ``B`` after every ``F``);
    - 1F1B: stage ``s`` holds ``min(p - s, m)``, and defers only when its warm-up and the first steady
      forward are every forward (``2 <= m <= p - s``);
    - ZB-H1: every stage holds ``min(p, m)`` (its ``W`` s start after ``s + 1`` forwards beyond the
      warm-up of ``p - s - 1``) and defers (it splits its backward).

    Others (interleaved, a registered schedule) from their lists.

    Raises:
        ValueError: If the name is unknown or the shape is refused.
    """
    p, m = num_stages, num_microbatches
    if name == "gpipe" and chunks == 1:
        return (m,) * p, (m >= 2,) * p
    if name == "1f1b" and chunks == 1:
        return tuple(min(p - s, m) for s in range(p)), tuple(2 <= m <= p - s for s in range(p))
    if name == "zb-h1" and chunks == 1:
        return (min(p, m),) * p, (True,) * p
    if name == "interleaved-1f1b" and schedule_problem(name, p, m, chunks) is None:
        return _interleaved_holds(p, m, chunks)
    from services.compute.weight_grads import defers  # the services' rule, on the lists' kinds

    _, lists = schedule_steps(name, num_stages, num_microbatches, chunks)
    return (tuple(peak_in_flight(acts) for acts in lists),
            tuple(defers(cast(Sequence[Action], acts)) for acts in lists))


@functools.lru_cache(maxsize=4096)  # a search asks again for each replica count and mode
def _interleaved_holds(p: int, m: int, v: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """:func:`stage_holds` of interleaved 1F1B: its ranks' forwards and backwards in :func:`_interleaved`'s
    order, counted per stage without building the lists (a stage defers when all its forwards come
    before its first backward and it has two or more).

    Rank ``r`` runs ``w = min((v - 1) g + 2 (R - 1 - r), v m)`` forwards, then a forward and a backward in
    turn, then the backwards left: its ``k``-th forward is at position ``k`` (``k < w``) or ``w + 2 (k - w)``,
    its ``k``-th backward at ``w + 2 k + 1`` (``k < v m - w``) or ``v m + k`` beyond, and both belong to
    chunk ``(k // g) % v`` (a backward to the stage of chunk ``v - 1 -`` that). So the backwards before
    forward ``k`` are the first ``k - w`` (none while ``k < w``), and a stage's microbatches in flight just
    after its forward ``k`` are its forwards up to ``k`` less its backwards among those: its peak is the most
    of that over its forwards (the count only grows at a forward). Every rank and forward at once, one
    gather: 64 stages, 64 microbatches, 4 chunks in a fraction of a millisecond (a sort of every rank's
    ``2 v m`` actions took three times as long, a loop over them six times more)."""
    num_ranks = p // v
    g = interleaved_group(num_ranks, m)
    assert g is not None
    n = v * m  # a rank's forwards: rounds of v chunks of g
    rounds = n // (v * g)
    k = np.arange(n)
    chunk = (k // g) % v  # forward k's chunk; backward k's is v - 1 - that
    chunks = np.arange(v)[:, None]
    mine = np.cumsum(chunk[None, :] == chunks, axis=1)[chunk, k]  # forward k's count in its chunk so far
    backs = np.zeros((v, n + 1), np.int64)  # per chunk, its backwards among the first t
    backs[:, 1:] = np.cumsum((v - 1 - chunk)[None, :] == chunks, axis=1)
    warmup = np.minimum((v - 1) * g + 2 * (num_ranks - 1 - np.arange(num_ranks)), n)[:, None]
    held = mine[None, :] - backs[chunk[None, :], np.clip(k[None, :] - warmup, 0, n)]  # rank x forward
    peak = held.reshape(num_ranks, rounds, v, g).max(axis=(1, 3))  # rank x chunk
    last_forward = (rounds - 1) * v * g + np.arange(v) * g + (g - 1)  # per chunk
    first_backward = (v - 1 - np.arange(v)) * g
    forward_at = np.where(last_forward < warmup, last_forward, 2 * last_forward - warmup)
    backward_at = np.where(first_backward < n - warmup, warmup + 2 * first_backward + 1, n + first_backward)
    defers = (forward_at < backward_at) & (m >= 2)  # rank x chunk
    # stage c R + r: chunk-major
    return tuple(peak.T.reshape(-1).tolist()), tuple(bool(x) for x in defers.T.reshape(-1).tolist())


def peak_in_flight(actions: Iterable[Action | Step]) -> int:
    """The most microbatches whose forward ran and backward did not end yet, along one list.

    A microbatch's activations are freed by its ``B``, or by its ``W`` when its backward is
    split (the weight gradients need the layer inputs; ``I`` frees nothing). Along a rank's
    merged order it counts the microbatches of all its stages.
    """
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind in ("B", "W"):
            held -= 1
    return peak
