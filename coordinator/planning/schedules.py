"""Pipeline schedules as data: an action IR, GPipe and 1F1B generators, printing, parsing, validation.

A schedule is, for every pipeline stage, the ordered list of what that stage does. There
are four kinds of action, each naming one microbatch:

==========  ==========  =====================================================
kind        printed     meaning
==========  ==========  =====================================================
FORWARD     ``0F3``     stage 0 runs the forward of microbatch 3
BACKWARD    ``1B2``     stage 1 runs the backward of microbatch 2
SEND        ``0S3->1``  stage 0 sends microbatch 3's boundary tensors to stage 1
RECV        ``1R3<-0``  stage 1 receives microbatch 3's boundary tensors from stage 0
==========  ==========  =====================================================

A send or receive towards a higher stage carries activations, towards a lower stage
gradients (:attr:`Action.carries_gradient`); which tensors travel is the cut's business
(``Plan.stages[s].outgoing``), not the schedule's. Actions hold only ints and a one-letter
kind, so a schedule goes on a wire as msgpack (:meth:`Schedule.to_wire`).

[Note: send semantics] A SEND is *eager*: it never waits for its receiver to be ready; it
hands its tensors to the transport (an ``isend``, or a send into the peer's buffer) and
the stage goes on (the simulator charges the sender the transfer time, see [Note:
transfer cost] in ``coordinator/planning/cutting.py``). A RECV blocks until the matching SEND has
been posted. Validation checks
deadlock freedom under exactly these semantics. Under rendezvous sends (a send that waits
for its receive to be posted) 1F1B's steady state would deadlock: stage s sends
activations up while stage s+1 sends gradients down.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "gpipe",
    "one_f_one_b",
    "peak_in_flight",
    "validate_schedule",
]


class ScheduleError(ValueError):
    """An action list breaks a schedule rule; the message names the stage and action."""


class ActionKind(str, enum.Enum):
    """What an action does; the value is its one-letter printed form."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND = "S"
    RECV = "R"


_ACTION_RE = re.compile(r"^(\d+)([FBSR])(\d+)(?:(->|<-)(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage.

    Args:
        stage: The stage that performs the action (>= 0).
        kind: Forward, backward, send or receive.
        microbatch: The microbatch it concerns (>= 0).
        peer: For SEND the destination stage, for RECV the source stage; None otherwise.

    Raises:
        ScheduleError: If a field is negative, a peer is missing, present where it has no
            meaning, or equal to ``stage``.
    """

    stage: int
    kind: ActionKind
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"negative stage or microbatch in {self._text()}")
        comm = self.kind in (ActionKind.SEND, ActionKind.RECV)
        if comm and self.peer is None:
            raise ScheduleError(f"{self.kind.name} action of stage {self.stage} needs a peer")
        if not comm and self.peer is not None:
            raise ScheduleError(f"{self.kind.name} action of stage {self.stage} takes no peer")
        if self.peer is not None and (self.peer < 0 or self.peer == self.stage):
            raise ScheduleError(f"{self._text()}: a stage cannot send to or receive from {self.peer}")

    @property
    def carries_gradient(self) -> bool:
        """True for a send to / receive from a *lower* / *higher* stage (gradients flow down)."""
        if self.kind is ActionKind.SEND:
            return self.peer is not None and self.peer < self.stage
        if self.kind is ActionKind.RECV:
            return self.peer is not None and self.peer > self.stage
        return False

    @property
    def stage_kind(self) -> str:
        """The action in the compute service's words: ``forward``, ``backward``, ``send_act``,
        ``recv_act``, ``send_grad`` or ``recv_grad`` (``services.protocol.StageActionKind``)."""
        if self.kind is ActionKind.FORWARD:
            return "forward"
        if self.kind is ActionKind.BACKWARD:
            return "backward"
        direction = "send" if self.kind is ActionKind.SEND else "recv"
        return f"{direction}_{'grad' if self.carries_gradient else 'act'}"

    def _text(self) -> str:
        if self.kind is ActionKind.SEND:
            return f"{self.stage}S{self.microbatch}->{self.peer}"
        if self.kind is ActionKind.RECV:
            return f"{self.stage}R{self.microbatch}<-{self.peer}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __str__(self) -> str:
        return self._text()

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parses the printed form (``"0F3"``, ``"1B2"``, ``"0S3->1"``, ``"1R3<-0"``).

        Raises:
            ScheduleError: If ``text`` is not one action.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r}; expected e.g. 0F3, 1B2, 0S3->1, 1R3<-0")
        stage, kind, mb, arrow, peer = match.groups()
        action_kind = ActionKind(kind)
        expected = {ActionKind.SEND: "->", ActionKind.RECV: "<-"}.get(action_kind)
        if arrow != expected:
            raise ScheduleError(f"cannot parse action {text!r}: {action_kind.name} takes "
                                f"{expected or 'no peer'}")
        return cls(int(stage), action_kind, int(mb), None if peer is None else int(peer))


@dataclass(frozen=True)
class Schedule:
    """Every stage's ordered action list; ``actions[s]`` is what stage ``s`` does, in order.

    Prints as one line per stage and parses back (:meth:`parse`); :meth:`to_wire` and
    :meth:`from_wire` give a msgpack-ready dict.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        head = f"{self.name}: {self.num_stages} stages x {self.num_microbatches} microbatches"
        width = len(str(self.num_stages - 1))
        lines = [f"stage {s:>{width}}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.actions)]
        return "\n".join([head, *lines])

    def compute_only(self) -> tuple[tuple[Action, ...], ...]:
        """The FORWARD/BACKWARD actions of every stage, in order (sends/receives dropped)."""
        keep = (ActionKind.FORWARD, ActionKind.BACKWARD)
        return tuple(tuple(a for a in acts if a.kind in keep) for acts in self.actions)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Parses :meth:`__str__` output back (the result is not validated; call
        :func:`validate_schedule`).

        Raises:
            ScheduleError: If the header or an action does not parse.
        """
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        head = re.match(r"^(\S+): (\d+) stages x (\d+) microbatches$", lines[0].strip()) if lines else None
        if head is None:
            raise ScheduleError("a schedule starts with '<name>: <p> stages x <m> microbatches'")
        stages: list[tuple[Action, ...]] = []
        for line in lines[1:]:
            label, _, rest = line.partition(":")
            if not label.strip().startswith("stage"):
                raise ScheduleError(f"expected 'stage <s>: <actions>', got {line!r}")
            stages.append(tuple(Action.parse(tok) for tok in rest.split()))
        return cls(head.group(1), int(head.group(2)), int(head.group(3)), tuple(stages))

    def to_wire(self) -> dict[str, Any]:
        """A dict of str/int/lists only, for msgpack."""
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "actions": [[str(a) for a in acts] for acts in self.actions],
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Schedule:
        """Rebuilds and validates a schedule from :meth:`to_wire` output.

        Raises:
            ScheduleError: If the data is malformed or the schedule is invalid.
        """
        try:
            sched = cls(
                str(data["name"]), int(data["num_stages"]), int(data["num_microbatches"]),
                tuple(tuple(Action.parse(str(t)) for t in acts) for acts in data["actions"]),
            )
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"malformed schedule on the wire: {exc!r}") from None
        validate_schedule(sched)
        return sched


def _forward_step(s: int, i: int, p: int) -> list[Action]:
    out = [Action(s, ActionKind.RECV, i, s - 1)] if s > 0 else []
    out.append(Action(s, ActionKind.FORWARD, i))
    if s < p - 1:
        out.append(Action(s, ActionKind.SEND, i, s + 1))
    return out


def _backward_step(s: int, i: int, p: int) -> list[Action]:
    out = [Action(s, ActionKind.RECV, i, s + 1)] if s < p - 1 else []
    out.append(Action(s, ActionKind.BACKWARD, i))
    if s > 0:
        out.append(Action(s, ActionKind.SEND, i, s - 1))
    return out


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
    p, m = num_stages, num_microbatches
    stages = []
    for s in range(p):
        acts = [a for i in range(m) for a in _forward_step(s, i, p)]
        acts += [a for i in range(m) for a in _backward_step(s, i, p)]
        stages.append(tuple(acts))
    return Schedule("gpipe", p, m, tuple(stages))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up with ``p - s - 1`` forwards, alternate, cool down.

    Stage ``s`` holds at most ``min(p - s, m)`` microbatches of activations.

    Raises:
        ValueError: If either count is < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    stages = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [a for i in range(warmup) for a in _forward_step(s, i, p)]
        for i in range(m - warmup):  # steady state: forward of i + warmup, then backward of i
            acts += _forward_step(s, i + warmup, p) + _backward_step(s, i, p)
        acts += [a for i in range(m - warmup, m) for a in _backward_step(s, i, p)]
        stages.append(tuple(acts))
    return Schedule("1f1b", p, m, tuple(stages))


ScheduleFn = Callable[[int, int], Schedule]
SCHEDULES: dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Builds a registered schedule by name (see :data:`SCHEDULES`).

    Raises:
        ValueError: If the name is unknown or a count is < 1.
    """
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}") from None
    return fn(num_stages, num_microbatches)


def peak_in_flight(actions: Iterable[Action]) -> int:
    """The most microbatches whose forward ran and backward did not yet, along one list."""
    held = peak = 0
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.kind is ActionKind.BACKWARD:
            held -= 1
    return peak


def _check_stage(s: int, acts: Sequence[Action], p: int, m: int) -> None:
    done: set[tuple[ActionKind, int, int | None]] = set()
    for a in acts:
        where = f"stage {s}, action {a}"
        if a.stage != s:
            raise ScheduleError(f"{where}: listed under stage {s} but names stage {a.stage}")
        if a.microbatch >= m or (a.peer is not None and a.peer >= p):
            raise ScheduleError(f"{where}: microbatch or peer out of range ({p} stages, {m} microbatches)")
        if a.peer is not None and abs(a.peer - s) != 1:
            raise ScheduleError(f"{where}: a chain pipeline only talks to adjacent stages")
        key = (a.kind, a.microbatch, a.peer)
        if key in done:
            raise ScheduleError(f"{where}: duplicate action")
        i, up, down = a.microbatch, s - 1, s + 1
        need: tuple[ActionKind, int, int | None] | None = None
        if a.kind is ActionKind.FORWARD and s > 0:
            need = (ActionKind.RECV, i, up)
        elif a.kind is ActionKind.BACKWARD:
            need = (ActionKind.RECV, i, down) if s < p - 1 else (ActionKind.FORWARD, i, None)
            if (ActionKind.FORWARD, i, None) not in done:
                raise ScheduleError(f"{where}: backward before the forward of microbatch {i}")
        elif a.kind is ActionKind.SEND:
            need = (ActionKind.FORWARD, i, None) if a.peer == down else (ActionKind.BACKWARD, i, None)
        if need is not None and need not in done:
            raise ScheduleError(f"{where}: comes before {Action(s, need[0], need[1], need[2])}")
        done.add(key)
    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
        missing = [i for i in range(m) if (kind, i, None) not in done]
        if missing:
            raise ScheduleError(f"stage {s}: no {kind.name} for microbatches {missing}")


def _check_deadlock(actions: Sequence[Sequence[Action]]) -> None:
    posted: set[tuple[int, int, int]] = set()  # (src, dst, microbatch) of executed sends
    pos = [0] * len(actions)
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(actions):
            while pos[s] < len(acts):
                a = acts[pos[s]]
                if a.kind is ActionKind.RECV and (a.peer, s, a.microbatch) not in posted:
                    break
                if a.kind is ActionKind.SEND:
                    assert a.peer is not None
                    posted.add((s, a.peer, a.microbatch))
                pos[s] += 1
                progress = True
    stuck = [f"stage {s} waits at {acts[pos[s]]}" for s, acts in enumerate(actions) if pos[s] < len(acts)]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))


def validate_schedule(schedule: Schedule) -> None:
    """Checks every rule a runtime relies on; returns None or raises.

    Rules: one list per stage; each action names its own stage and an adjacent peer; each
    stage runs every microbatch's forward and backward exactly once, the backward after the
    forward; a forward (backward) comes after the receive of its activations (gradients),
    a send after the compute that produced what it sends; every send has exactly one
    matching receive and vice versa; and played with eager sends (see [Note: send
    semantics]) no stage waits forever.

    Raises:
        ScheduleError: Naming the first broken rule, the stage and the action.
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"{len(schedule.actions)} action lists for {p} stages")
    for s, acts in enumerate(schedule.actions):
        _check_stage(s, acts, p, m)
    sends: Counter[tuple[int, int, int]] = Counter()  # (src, dst, microbatch)
    recvs: Counter[tuple[int, int, int]] = Counter()
    for acts in schedule.actions:
        for a in acts:
            if a.peer is not None:
                pair = (a.stage, a.peer) if a.kind is ActionKind.SEND else (a.peer, a.stage)
                (sends if a.kind is ActionKind.SEND else recvs)[(*pair, a.microbatch)] += 1
    for src, dst, i in sorted((sends - recvs).keys()):
        raise ScheduleError(f"send {Action(src, ActionKind.SEND, i, dst)} has no matching receive")
    for src, dst, i in sorted((recvs - sends).keys()):
        raise ScheduleError(f"receive {Action(dst, ActionKind.RECV, i, src)} has no matching send")
    _check_deadlock(schedule.actions)
