"""Hand-written checks of the replies the coordinator reads every step: :class:`StepReply` and its parts.

Each returns the message when the map (as msgpack decoded it) is plainly valid, checked field by field
against the model's own rules (exact types, list sizes, bounds, the packed timings' whole number of
actions), and None for anything else, which the caller then validates with the model: see [Note: a
fast path that only accepts] in ``comm/rpc/hot.py``. :data:`HOT_BODIES` maps a reply type to its check; the
coordinator's event loop looks a request's reply type up there (``coordinator/runtime/loop.py``).

[Note: why the step reply is checked by hand]
The coordinator reads one :class:`StepReply` per stage per step, and in a training step it reads it cold:
the workers' compute between two replies has evicted the caches, and a reply's read (msgpack, the
envelope's and the body's validation) costs 100-170 µs of the coordinator's CPU instead of the 12 µs it
costs right after another (coordinator/runtime/driver.py's step, measured; ``bench/replies.py``). Warm,
pydantic-core validates as fast as these checks (12.1 against 12.3 µs for a 1F1B stage's reply, msgpack
included); cold, the checks read it in 81-111 µs against the models' 103-137 (``bench/replies.py``
with the caches evicted before each read: 20 % less, as less code and data is touched). What they accept
is a subset of what the model accepts, giving an equal message (``tests/unit/comm/rpc/test_hot.py``);
everything else (an int where a float goes, a non-empty list of checkpoint parts, an unknown field, a
bad value) takes the model's validation and gets its error. A field added to :class:`StepReply`
without a check here makes every reply take that path (correct, slower), and that test fails.
(The profile that pointed here, "pydantic validation 48 %" at 128 hollow workers, was mostly the full
garbage collections that the allocations inside the validation triggered: ``coordinator/runtime/heap.py``.)

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

from typing import Any

from comm.rpc.hot import BodyDecoder, trusted
from comm.traffic import BACKENDS, MAX_REASON_CHARS, MAX_REASONS, TrafficCounts
from services.protocol.compute import (
    MAX_NONFINITE_NAMED,
    MAX_TIMES_BYTES,
    TIMING_BYTES,
    PhaseTiming,
    StepReply,
)

__all__ = ["HOT_BODIES", "phase_timing", "step_reply", "traffic_counts"]

_is_float = float.__instancecheck__
_is_str = str.__instancecheck__
_NAME_CHARS = 256  # comm.rpc.envelope.Name
_MAX_METRICS = 1 << 16  # StepReply.metric_sums
_BACKENDS = frozenset(BACKENDS)
_STEP_FIELDS = tuple(StepReply.model_fields)
_STEP_KEYS = frozenset(_STEP_FIELDS)
_PHASE_KEYS = frozenset(PhaseTiming.model_fields)
_TRAFFIC_KEYS = frozenset(TrafficCounts.model_fields)


def _floats(value: object) -> bool:
    """A ``list[float]`` as msgpack gives it: floats only (ints, which the model converts, are declined)."""
    return type(value) is list and all(map(_is_float, value))


def _count(value: object) -> bool:
    """A ``NonNegativeInt`` (strict: not a bool)."""
    return type(value) is int and value >= 0


def _optional_count(value: object) -> bool:
    return value is None or (type(value) is int and value >= 0)


def phase_timing(fields: object) -> PhaseTiming | None:
    """A :class:`PhaseTiming` from its map, or None (see the module docstring)."""
    if type(fields) is not dict or fields.keys() != _PHASE_KEYS:
        return None
    name, start, end = fields["name"], fields["start"], fields["end"]
    if type(name) is not str or not 1 <= len(name) <= _NAME_CHARS or type(start) is not float \
            or type(end) is not float:
        return None
    return trusted(PhaseTiming, {"name": name, "start": start, "end": end})


def _reasons(value: object) -> bool:
    """A map of refusal reasons to counts: at most MAX_REASONS, each reason 1..MAX_REASON_CHARS long."""
    if type(value) is not dict or len(value) > MAX_REASONS:
        return False
    return all(type(k) is str and 1 <= len(k) <= MAX_REASON_CHARS and _count(n) for k, n in value.items())


def traffic_counts(fields: object) -> TrafficCounts | None:
    """A :class:`~comm.traffic.TrafficCounts` from its map, or None (see the module docstring)."""
    if type(fields) is not dict or fields.keys() != _TRAFFIC_KEYS:
        return None
    sent, frames, connections = fields["bytes_sent"], fields["refused_frames"], fields["refused_connections"]
    if type(sent) is not dict or not sent.keys() <= _BACKENDS or not all(map(_count, sent.values())):
        return None
    if not (_reasons(frames) and _reasons(connections)):
        return None
    return trusted(TrafficCounts, {"bytes_sent": sent, "refused_frames": frames,
                                   "refused_connections": connections})


def step_reply(body: dict[str, Any]) -> StepReply | None:
    """A :class:`StepReply` from its map (every field given, as a worker sends it), or None."""
    if body.keys() != _STEP_KEYS:
        return None
    step, stage, times = body["step"], body["stage"], body["times"]
    if type(step) is not int or type(stage) is not int:
        return None
    if type(times) is not bytes or len(times) % TIMING_BYTES or len(times) > MAX_TIMES_BYTES:
        return None
    if not _floats(body["losses"]):
        return None
    metrics, grads, saved = body["metric_sums"], body["nonfinite_grads"], body["saved"]
    norm = body["grad_sq_norm"]
    if not _floats(metrics) or len(metrics) > _MAX_METRICS:
        return None
    if type(grads) is not list or len(grads) > MAX_NONFINITE_NAMED or not all(map(_is_str, grads)):
        return None
    if saved != [] or type(saved) is not list:  # checkpoint parts: rare, left to the model
        return None
    if not (norm is None or type(norm) is float):
        return None
    if not (_optional_count(body["held_bytes"]) and _optional_count(body["peak_bytes"])
            and _optional_count(body["lead"])):
        return None
    raw_phases = body["phases"]
    if type(raw_phases) is not list:
        return None
    phases = []
    for raw in raw_phases:
        phase = phase_timing(raw)
        if phase is None:
            return None
        phases.append(phase)
    traffic = body["traffic"]
    if traffic is not None:
        traffic = traffic_counts(traffic)
        if traffic is None:
            return None
    values = {name: body[name] for name in _STEP_FIELDS}
    values["phases"], values["traffic"] = phases, traffic
    return trusted(StepReply, values)


HOT_BODIES: dict[type, BodyDecoder] = {StepReply: step_reply}
"""Reply type -> its hand-written check (the replies read every step)."""
