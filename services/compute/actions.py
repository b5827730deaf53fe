"""The rules of a pipeline schedule, written once: per stage (each worker checks its list) and across stages.

A schedule is, for every stage of a chain pipeline, the ordered list of its
:class:`~services.protocol.Action` s (the six kinds and the printed form are there). A stage
executes its list as given, one action after the other, and never reorders it.

Per stage (:func:`validate_stage`; a worker runs it on every ``RunStep`` before anything
runs, and :func:`validate_schedule` on every list). For stage ``s`` of ``p`` and every
microbatch ``i`` of the step's ``m``, with ``<`` the position in the list::

    RECV_F(i) < F(i) < SEND_F(i)          F: exactly once
    F(i) < B(i)                           a backward for every microbatch or for none
    RECV_B(i) < B(i) < SEND_B(i)
    F(i) < I(i) < W(i), RECV_B(i) < I(i) < SEND_B(i)

A microbatch's backward is either one ``B`` or its two halves: ``I`` (the input gradients,
what ``SEND_B`` sends) then ``W`` (the weight gradients), as zero-bubble schedules split it;
never both.

Every action names stage ``s`` and a microbatch below ``m``, and none repeats.
``RECV_F``/``SEND_B`` exist exactly on stages with a previous stage, ``SEND_F``/``RECV_B``
exactly on stages with a next stage, and the gradient transfers only in a list with
backwards (a list without any is an evaluation step). ``RECV_B(i)`` may come before
``F(i)`` (its buffers are known from the plan), so a list can post gradient receives early.

Across stages (:func:`validate_schedule`; the coordinator's schedules go through it): one
list per stage, each valid on its own; every send has its matching receive on the peer
and every receive its send; and played with eager sends (see [Note: send semantics]) no
stage waits forever.

[Note: send semantics]
A send is *eager*: it never waits for its receiver to be ready; it hands its tensors to
the transport (an ``isend``) and the stage goes on. A receive blocks until the matching
send has been posted. Deadlock freedom is checked under exactly these semantics. Under
rendezvous sends (a send that waits for its receive to be posted) 1F1B's steady state
would deadlock: stage s sends activations up while stage s+1 sends gradients down.

A schedule is data: :func:`format_schedule` prints it as a step-by-stage table (every
action one step long, a receive at the earliest one step after its send). A
:class:`ScheduleError` names the broken rule and the offending actions (also as
:attr:`ScheduleError.actions`); :func:`validate_schedule` appends the table with them marked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.protocol import Action, ActionKind

__all__ = ["ScheduleError", "format_schedule", "play", "validate_schedule", "validate_stage"]

# the kinds in the order their absence is reported
_KINDS: tuple[ActionKind, ...] = ("F", "RECV_F", "SEND_F", "B", "RECV_B", "SEND_B")
# the kinds only a list that trains has
_BACKWARD: frozenset[ActionKind] = frozenset({"B", "I", "W", "RECV_B", "SEND_B"})
# kind -> the kinds of the same microbatch that must come earlier in the list (those the stage has);
# SEND_B needs the input gradients, from B or from I (see validate_stage)
_NEEDS: dict[ActionKind, tuple[ActionKind, ...]] = {
    "F": ("RECV_F",), "SEND_F": ("F",), "B": ("F", "RECV_B"), "I": ("F", "RECV_B"), "W": ("I",),
    "SEND_B": (), "RECV_F": (), "RECV_B": ()}
# a transfer's kind -> the kind of its other end (on the peer)
_PARTNER: dict[ActionKind, ActionKind] = {
    "SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}
_MARK = "*"  # around an offending action in format_schedule's table
_MAX_ROWS = 40  # a longer table shows only the rows near marked actions...
_CONTEXT_ROWS = 4  # ... this many on either side (or the first _MAX_ROWS if none is marked)


class ScheduleError(ValueError):
    """An action list or a schedule breaks a rule; the message names the rule and the offending actions.

    Attributes:
        actions: The offending actions (empty if the error is about the shape, e.g. a
            missing stage).
    """

    def __init__(self, message: str, actions: Iterable[Action] = ()) -> None:
        super().__init__(message)
        self.actions = tuple(actions)


def validate_stage(actions: Sequence[Action], *, stage: int, num_stages: int, num_microbatches: int) -> bool:
    """Check stage ``stage``'s list against the per-stage rules (see the module docstring).

    Returns:
        True if the list trains (runs every microbatch's backward), False if it only
        evaluates (runs none).

    Raises:
        ScheduleError: Naming the stage, the first offending action (and its position) and the rule.
    """
    s, m = stage, num_microbatches
    if not 0 <= s < num_stages:
        raise ScheduleError(f"stage {s} is not one of the pipeline's {num_stages} stages")
    has: set[ActionKind] = {"F", "B", "I", "W"}
    if s > 0:
        has |= {"RECV_F", "SEND_B"}
    if s < num_stages - 1:
        has |= {"SEND_F", "RECV_B"}
    seen: dict[tuple[ActionKind, int], int] = {}  # (kind, microbatch) -> position
    for k, a in enumerate(actions):
        kind, i = a.kind, a.microbatch
        if a.stage != s or i >= m or kind not in has or (kind, i) in seen:
            raise _misplaced(k, a, s, num_stages, m, seen)
        needs = _NEEDS[kind]
        if kind == "SEND_B" and ("I", i) not in seen and ("B", i) not in seen:
            raise ScheduleError(f"stage {s}, action #{k} ({a}): {s}B{i} (or {s}I{i}) must come before it",
                                [a, Action(stage=s, kind="B", microbatch=i)])
        for need in needs:
            if need in has and (need, i) not in seen:
                before = Action(stage=s, kind=need, microbatch=i)
                raise ScheduleError(f"stage {s}, action #{k} ({a}): {before} must come before it",
                                    [a, before])
        if kind in ("B", "I") and ({"B", "I"} - {kind}).pop() in {kd for kd, j in seen if j == i}:
            raise ScheduleError(f"stage {s}, action #{k} ({a}): microbatch {i}'s backward is either B or "
                                "I then W, not both", [a])
        seen[(kind, i)] = k
    trains = any(kind in ("B", "I") for kind, _ in seen)
    for kind in _KINDS:
        if kind not in has:
            continue
        if trains or kind not in _BACKWARD:
            if kind == "B":  # a microbatch's backward: B, or I and W
                missing = [Action(stage=s, kind="B" if ("I", i) not in seen else "W", microbatch=i)
                           for i in range(m) if ("B", i) not in seen and ("W", i) not in seen]
            else:
                missing = [Action(stage=s, kind=kind, microbatch=i) for i in range(m)
                           if (kind, i) not in seen]
            if missing:
                why = " (a step runs the backward of every microbatch or of none)" if trains else ""
                raise ScheduleError(f"stage {s}: the list has no {', '.join(map(str, missing))}{why}",
                                    missing)
        elif kind == "RECV_B" and (stray := sorted(k for (kd, _), k in seen.items() if kd == kind)):
            a = actions[stray[0]]
            raise ScheduleError(f"stage {s}, action #{stray[0]} ({a}): a list without backwards is an "
                                "evaluation step; it receives no gradients", [a])
    return trains


def _misplaced(k: int, a: Action, s: int, p: int, m: int, seen: dict[tuple[ActionKind, int], int]
               ) -> ScheduleError:
    """The error of an action that has no place in stage ``s``'s list at all."""
    where = f"stage {s}, action #{k} ({a})"
    if a.stage != s:
        return ScheduleError(f"{where}: names stage {a.stage}; stage {s}'s list holds only its own "
                             "actions", [a])
    if a.microbatch >= m:
        return ScheduleError(f"{where}: microbatch {a.microbatch} is not one of the step's {m} "
                             "microbatches", [a])
    if (a.kind, a.microbatch) in seen:
        return ScheduleError(f"{where}: repeats action #{seen[(a.kind, a.microbatch)]} (each action runs at "
                             "most once per step)", [a])
    side = (f"stage {s} is the first stage; it has no previous stage" if a.peer is not None and a.peer < s
            else f"stage {s} is the last of {p}; it has no next stage")
    return ScheduleError(f"{where}: {side}", [a])


def validate_schedule(actions: Sequence[Sequence[Action]], num_microbatches: int,
                      order: Sequence[Sequence[Action]] | None = None) -> None:
    """Check a whole schedule: every stage's list (:func:`validate_stage`), then the rules across stages.

    Args:
        actions: ``actions[s]`` is stage ``s``'s ordered list.
        num_microbatches: The step's microbatches.
        order: When a worker (a *rank*) runs several stages (virtual stages: interleaved and V
            schedules), ``order[r]`` is every action rank ``r`` runs, in the order it runs them
            (the stages' lists merged): the deadlock check plays these, one action at a time per
            rank. None: each stage runs on a rank of its own.

    Raises:
        ScheduleError: Naming the first broken rule and its actions, followed by the
            schedule's table (:func:`format_schedule`) with those actions marked.
    """
    p = len(actions)
    if p < 1:
        raise ScheduleError("a schedule needs at least one stage's list")
    try:
        for s, acts in enumerate(actions):
            validate_stage(acts, stage=s, num_stages=p, num_microbatches=num_microbatches)
        transfers = {a for acts in actions for a in acts if a.peer is not None}
        for acts in actions:
            for a in acts:
                if a.peer is not None and (other := _other_end(a)) not in transfers:
                    raise ScheduleError(f"{a} has no other end: stage {a.peer}'s list has no {other}", [a])
        lists = actions if order is None else order
        ticks = play(lists)
        stuck = [acts[t.index(None)] for acts, t in zip(lists, ticks, strict=True) if None in t]
        if stuck:
            waits = "; ".join(f"stage {a.stage} waits at {a}" for a in stuck)
            raise ScheduleError(f"deadlock: {waits}", stuck)
    except ScheduleError as exc:
        shown = actions if order is None else order
        raise ScheduleError(f"{exc}\n{format_schedule(shown, mark=exc.actions)}", exc.actions) from None


def _other_end(a: Action) -> Action:
    """The peer's action that matches transfer ``a`` (a valid stage's transfer has a peer in range)."""
    assert a.peer is not None
    return Action(stage=a.peer, kind=_PARTNER[a.kind], microbatch=a.microbatch)


def play(actions: Sequence[Sequence[Action]]) -> list[list[int | None]]:
    """The step at which each action runs when every action takes one step and sends are eager.

    ``actions[r]`` is what rank ``r`` runs in order: one stage's list, or the merged lists of the
    stages one rank holds. At each step every rank runs its next action, unless it is a receive whose send has
    not run at an earlier step; then the stage waits. Returns ``ticks[s][k]``, the step of
    stage ``s``'s action ``k``, or None for the actions a deadlock never reaches.
    """
    ticks: list[list[int | None]] = [[None] * len(acts) for acts in actions]
    sent: dict[tuple[int, str, int], int] = {}  # (sender, kind, microbatch) of a send -> its step
    pos, step = [0] * len(actions), 0
    while True:
        ran = False
        for s, acts in enumerate(actions):
            if pos[s] == len(acts):
                continue
            a = acts[pos[s]]
            if a.kind in ("RECV_F", "RECV_B"):
                assert a.peer is not None
                if sent.get((a.peer, _PARTNER[a.kind], a.microbatch), step) >= step:
                    continue
            elif a.kind in ("SEND_F", "SEND_B"):
                sent[(a.stage, a.kind, a.microbatch)] = step
            ticks[s][pos[s]] = step
            pos[s] += 1
            ran = True
        if not ran:
            return ticks
        step += 1


def format_schedule(actions: Sequence[Sequence[Action]], *, mark: Iterable[Action] = ()) -> str:
    """The schedule as a step-by-stage table (see :func:`play`); ``mark``'s actions are starred.

    Actions a deadlock never reaches follow the table under a ``never runs`` line. A table
    of more than 40 rows shows only the rows near the marked actions (the first 40 if none is).
    """
    marked = set(mark)
    ticks = play(actions)
    label = [[f"{_MARK}{a}{_MARK}" if a in marked else str(a) for a in acts] for acts in actions]
    width = max([len(f"stage {len(actions) - 1}"), *(len(x) for row in label for x in row)])
    steps = 1 + max((t for row in ticks for t in row if t is not None), default=-1)
    grid = [[""] * len(actions) for _ in range(steps)]
    stuck: list[list[str]] = [[] for _ in actions]
    for s, row in enumerate(ticks):
        for k, t in enumerate(row):
            if t is None:
                stuck[s].append(label[s][k])
            else:
                grid[t][s] = label[s][k]
    rows = [(f"{t:>5}", cells) for t, cells in enumerate(grid)]
    if any(stuck):
        rows.append(("never runs:", []))
        rows += [("", [col[k] if k < len(col) else "" for col in stuck]) for k in range(max(map(len, stuck)))]
    near = [i for i, (_, cells) in enumerate(rows) if any(_MARK in c for c in cells)]
    keep = set(range(min(len(rows), _MAX_ROWS)))
    if len(rows) > _MAX_ROWS and near:
        keep = {j for i in near for j in range(i - _CONTEXT_ROWS, i + _CONTEXT_ROWS + 1)}
    lines = [("step  " + "  ".join(f"{f'stage {s}':<{width}}" for s in range(len(actions)))).rstrip()]
    for i, (head, cells) in enumerate(rows):
        if i not in keep:
            if lines[-1] != "  ...":
                lines.append("  ...")
            continue
        lines.append((f"{head:<5} " + "  ".join(f"{c:<{width}}" for c in cells)).rstrip())
    return "\n".join(lines)

