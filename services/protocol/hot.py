"""The reply the coordinator reads every step, :class:`StepReply`, read from its frame in one C call.

:func:`read_step_frame` returns ``(id, reply as read)`` when a reply frame holds a plainly valid successful
:class:`StepReply` (the envelope and the body checked together, field by field, against the models' own
rules: exact types, list sizes, bounds, the packed timings' whole number of actions), and None for
anything else, which the caller then reads the usual way (msgpack, the envelope's and the body's
pydantic models, their errors): see [Note: a fast path that only accepts] in ``comm/rpc/hot.py``. The
pydantic models stay the schema of record; the msgspec structs here only mirror them, and each makes
the message it reads (``message()``; :func:`step_reply_frame` returns that).

[Note: a step reply kept as read]
The coordinator keeps what the C decoder built (:class:`StepRead`, :class:`WindowRead`: frozen structs the
collector does not track, their sequences tuples) and reads them as they are: everything that reads a
step's replies takes a :class:`~services.protocol.compute.StepReport`, which the model and the struct
both are. Making each the pydantic message (a map of its fields, the nested phases and counters made
messages too, four attribute writes each) was three quarters of a window's read per step reply
(4.6 of 6.1 us warm) and a fifth of the coordinator's busy time at 16 hollow workers of 4-stage pipelines
(sampled); the young collections over those objects another 6 %. What a record keeps of a window's
counters is each worker's latest, merged once (``comm.traffic.latest_by``).

[Note: why the step reply is decoded in C]
The coordinator reads one :class:`StepReply` per stage per step, and in a training step it reads it cold:
the workers' compute between two replies has evicted the caches, so what a read costs is how much code
and memory it touches, not how many instructions it runs. Profiled (the coordinator thread's CPU split by
hand around each piece; a 1-worker training step of bench/train.py, under load): the reply's read was the
largest piece of the step, 160-180 µs of about 500, against 8-12 µs warm. Reading the frame with msgpack
into maps and lists, checking them by hand in Python and building the messages touched a few dozen Python
objects and a few hundred lines of bytecode; a msgspec ``Decoder`` of the envelope with the body as a
typed ``Struct`` parses, checks and builds in one pass of C with no intermediate maps: ``bench/replies.py``
measures it at 16-23 µs cold against 74-110 µs for msgpack and the hand check (0.6-1.1 µs warm against
8-14). The structs then become the models without validation (:func:`comm.rpc.hot.trusted`), a dozen
attribute copies. The hand-written check of maps this replaces ran 20 % faster cold than pydantic's
validation; the C decoder runs 4-5x faster than that.

What the structs accept is a subset of what the models accept, giving an equal message
(``tests/unit/comm/rpc/test_hot.py``: random, mutated and seed frames): every field present (a missing
one, which the model fills with its default, is declined), no unknown field, the envelope successful
and without tensors, no checkpoint parts (rare: left to the model), the packed timings a whole number of
actions. msgspec converts an int sent for a float field as pydantic does. A field added to
:class:`StepReply` without its mirror here makes every reply take the models' path (correct, slower), and
that test fails.

[Note: a step reply's few objects]
What a reply costs the coordinator grows with the Python objects it is made of: msgpack builds each, the
check visits each, the collector tracks the containers, and cold (as a training step reads it) each is a
few cache misses. A 1F1B stage's reply of 32 actions held 64 timing floats in two lists and the
worker's traffic counters (three maps) on every step. So:

* the timings travel as one byte string, ``StepReply.times`` (``pack_times``: the starts, then the ends,
  float64 little-endian): one ``bin`` for msgpack, a length to check here, one object to keep; the
  ``starts`` / ``ends`` lists are made only when read (the run record's event log, the trace, the
  bubble: ``coordinator/runtime/records.py`` builds them on first access, never during the step);
* the traffic counters ride on a training reply only when they changed since that stage's last one
  (``TrafficReports``; the coordinator keeps each worker's latest, ``comm.traffic.latest_by`` skips
  None): a data-parallel stage without a pipeline sends them once, a pipeline stage still every step
  (its bytes sent grow), but a map of a few counts;
* what stays per step is what the coordinator reads every step (losses, the norm, what is not finite,
  held bytes, the commit's phases) and the saved parts (empty but after a checkpoint).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from comm.codec import MAX_CONTROL_BYTES, PROTOCOL_VERSION
from comm.rpc.hot import trusted
from comm.traffic import MAX_REASON_CHARS, MAX_REASONS, Backend, TrafficCounts
from services.protocol.compute import (
    MAX_NONFINITE_NAMED,
    MAX_TIMES_BYTES,
    MAX_WINDOW_STEPS,
    TIMING_BYTES,
    PhaseTiming,
    StepReply,
    Timed,
    WindowReply,
)

__all__ = ["PhaseRead", "StepRead", "TrafficRead", "WindowRead", "read_step_frame", "read_window_frame",
           "step_reply_frame", "window_reply_frame"]

_NAME_CHARS = 256  # comm.rpc.envelope.Name
_MAX_METRICS = 1 << 16  # StepReply.metric_sums
_Count = Annotated[int, msgspec.Meta(ge=0)]  # NonNegativeInt
_Reasons = Annotated[dict[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REASON_CHARS)], _Count],
                     msgspec.Meta(max_length=MAX_REASONS)]
_Empty = Annotated[list[None], msgspec.Meta(max_length=0)]
_asdict = msgspec.structs.asdict
_PHASE_FIELDS = frozenset(PhaseTiming.model_fields)
_STEP_FIELDS = frozenset(StepReply.model_fields)
_WINDOW_FIELDS = frozenset(WindowReply.model_fields)


class PhaseRead(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """:class:`PhaseTiming`, as read."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=_NAME_CHARS)]
    start: float
    end: float

    def message(self) -> PhaseTiming:
        return trusted(PhaseTiming, _asdict(self), _PHASE_FIELDS)


class TrafficRead(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """:class:`~comm.traffic.TrafficCounts`, as read."""

    bytes_sent: dict[Backend, _Count]
    refused_frames: _Reasons
    refused_connections: _Reasons

    def message(self) -> TrafficCounts:
        return trusted(TrafficCounts, _asdict(self))


class StepRead(msgspec.Struct, Timed, frozen=True, forbid_unknown_fields=True, gc=False):
    """:class:`StepReply` as read, every field given (in its order: the tests compare); a
    :class:`~services.protocol.compute.StepReport` ([Note: a step reply kept as read])."""

    step: int
    stage: int
    losses: tuple[float, ...]
    metric_sums: Annotated[tuple[float, ...], msgspec.Meta(max_length=_MAX_METRICS)]
    times: Annotated[bytes, msgspec.Meta(max_length=MAX_TIMES_BYTES)]
    phases: tuple[PhaseRead, ...]
    nonfinite_grads: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_NONFINITE_NAMED)]
    traffic: TrafficRead | None
    saved: tuple[()]  # checkpoint parts: rare, left to the model
    grad_sq_norm: float | None
    held_bytes: _Count | None
    peak_bytes: _Count | None
    lead: _Count | None

    def message(self) -> StepReply:
        """The :class:`StepReply` this reads (what the models' path would have returned)."""
        values = _asdict(self)  # the fields by name, in the model's order (C); then the nested messages
        values["losses"], values["metric_sums"] = list(self.losses), list(self.metric_sums)
        values["phases"] = [p.message() for p in self.phases]
        values["nonfinite_grads"], values["saved"] = list(self.nonfinite_grads), []
        if self.traffic is not None:
            values["traffic"] = self.traffic.message()
        return trusted(StepReply, values, _STEP_FIELDS)


class _StepEnvelope(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A successful :class:`~comm.rpc.envelope.ReplyEnvelope` without tensors, carrying a
    :class:`StepRead`."""

    v: Literal[PROTOCOL_VERSION]  # type: ignore[valid-type]  # an int constant: a Literal of it
    id: _Count
    ok: Literal[True]
    body: StepRead
    error: None
    tensors: _Empty


class WindowRead(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """:class:`WindowReply`, as read."""

    steps: Annotated[tuple[StepRead, ...], msgspec.Meta(min_length=1, max_length=MAX_WINDOW_STEPS)]
    committed: Annotated[tuple[bool, ...], msgspec.Meta(max_length=MAX_WINDOW_STEPS)]

    def message(self) -> WindowReply:
        """The :class:`WindowReply` this reads."""
        return trusted(WindowReply, {"steps": [s.message() for s in self.steps],
                                     "committed": list(self.committed)}, _WINDOW_FIELDS)


class _WindowEnvelope(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """:class:`_StepEnvelope` carrying a :class:`WindowRead`."""

    v: Literal[PROTOCOL_VERSION]  # type: ignore[valid-type]
    id: _Count
    ok: Literal[True]
    body: WindowRead
    error: None
    tensors: _Empty


_decode = msgspec.msgpack.Decoder(_StepEnvelope).decode
_decode_window = msgspec.msgpack.Decoder(_WindowEnvelope).decode
_DecodeError = msgspec.DecodeError  # ValidationError is one


def read_step_frame(frame: bytes) -> tuple[int, StepRead] | None:
    """``(request id, the reply as read)`` of a reply frame holding a plain successful :class:`StepReply`,
    else None (see the module docstring): the caller reads it the usual way then, which logs or refuses
    it."""
    if len(frame) > MAX_CONTROL_BYTES:
        return None
    try:
        envelope = _decode(frame)
    except _DecodeError:
        return None
    return None if len(envelope.body.times) % TIMING_BYTES else (envelope.id, envelope.body)


def read_window_frame(frame: bytes) -> tuple[int, WindowRead] | None:
    """:func:`read_step_frame` for a :class:`WindowReply` (a window of steps' replies)."""
    if len(frame) > MAX_CONTROL_BYTES:
        return None
    try:
        envelope = _decode_window(frame)
    except _DecodeError:
        return None
    window = envelope.body
    if len(window.committed) != len(window.steps) - 1:
        return None
    for step in window.steps:
        if len(step.times) % TIMING_BYTES:
            return None
    return envelope.id, window


def step_reply_frame(frame: bytes) -> tuple[int, StepReply] | None:
    """:func:`read_step_frame`, the reply made its message."""
    read = read_step_frame(frame)
    return None if read is None else (read[0], read[1].message())


def window_reply_frame(frame: bytes) -> tuple[int, WindowReply] | None:
    """:func:`read_window_frame`, the reply made its message."""
    read = read_window_frame(frame)
    return None if read is None else (read[0], read[1].message())
