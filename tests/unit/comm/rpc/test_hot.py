"""The C decoder of the step reply against the pydantic models it stands in for; requests packed once.

[Note: a fast path that only accepts] (``comm/rpc/hot.py``): whatever the decoder accepts, the models
accept too (the envelope, then the body) and build an equal message (same values, same nested types,
same fields given); what it declines the caller validates with the models. Proven here on random maps
(hypothesis), on real messages mutated the way the security fuzzer mutates them
(``tests/multiproc/security/frames.py``), and on every seed message of the protocol, each put in a reply
frame as a worker's host frames it. Everything goes through msgpack first, so the values are the types a
wire gives. And the decoder must be worth having: a reply as a worker sends it is accepted.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from comm.codec import MAX_CONTROL_BYTES, unpack_raw
from comm.rpc.envelope import ReplyEnvelope
from comm.rpc.framing import reply_frames, request_frames
from comm.rpc.hot import PackedBody, RequestHeads, trusted
from comm.traffic import TrafficCounts, latest_by
from services.protocol import PhaseTiming, SavedPart, StepReply, TrafficReports, WindowReply, pack_times
from services.protocol.compute import MAX_TIMES_BYTES, TIMING_BYTES, StepReport, step_end
from services.protocol.hot import read_step_frame, read_window_frame, step_reply_frame, window_reply_frame
from tests.multiproc.security.frames import SEEDS, FrameMaker

_TRAFFIC = {"bytes_sent": {"zmq": 10240, "gloo": 0}, "refused_frames": {"bad header": 2},
            "refused_connections": {}}


def _worker_reply(**changes: Any) -> dict[str, Any]:
    """A StepReply as a worker dumps it (every field given), through msgpack."""
    body = StepReply(step=7, stage=1, losses=[0.25, float("nan")], metric_sums=[1.5],
                     times=pack_times([1.0, 2.0, 3.0], [1.5, 2.5, 3.5]),
                     phases=[PhaseTiming(name="all_reduce", start=4.0, end=4.25)],
                     nonfinite_grads=["cell0.weight"], traffic=TrafficCounts.model_validate(_TRAFFIC),
                     grad_sq_norm=0.5, held_bytes=1024, peak_bytes=0, lead=None).model_dump(mode="python")
    body.update(changes)
    return _wire(body)


def _frame(body: Any, **envelope: Any) -> bytes:
    """A reply frame carrying ``body`` as a service host frames a successful reply (comm/rpc/framing.py)."""
    fields = {"id": 3, "ok": True, "body": body, "error": None, "tensors": [], "v": 1, **envelope}
    return msgpack.packb(fields, use_bin_type=True)


def step_reply(body: Any) -> StepReply | None:
    """The decoder on ``body`` in a plain reply's frame: the message, or None (declined)."""
    read = step_reply_frame(_frame(body))
    if read is not None:
        assert read[0] == 3
    return None if read is None else read[1]


def phase_timing(value: Any) -> PhaseTiming | None:
    """The decoder on a phase, in a worker's reply."""
    read = step_reply(_worker_reply(phases=[value]))
    return None if read is None else read.phases[0]


def traffic_counts(value: Any) -> TrafficCounts | None:
    """The decoder on traffic counters, in a worker's reply (None there is no counters: declined here)."""
    read = step_reply(_worker_reply(traffic=value))
    return None if read is None or read.traffic is None else read.traffic


def _wire(value: Any) -> Any:
    """``value`` as the other end reads it: msgpack and back (tuples become lists, and so on)."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)


def _equal(a: Any, b: Any) -> bool:
    """Same type and value (NaN equal to NaN), nested messages field by field."""
    if isinstance(b, BaseModel):
        _same(a, b)
        return True
    if isinstance(b, list | dict):
        keys = range(len(b)) if isinstance(b, list) else b.keys()
        return type(a) is type(b) and len(a) == len(b) and all(_equal(a[k], b[k]) for k in keys)
    return type(a) is type(b) and (a == b or (isinstance(b, float) and math.isnan(a) and math.isnan(b)))


def _same(fast: BaseModel, ref: BaseModel) -> None:
    assert type(fast) is type(ref)
    assert fast.model_fields_set == ref.model_fields_set
    for name in type(ref).model_fields:
        assert _equal(getattr(fast, name), getattr(ref, name)), name
    assert repr(fast) == repr(ref)
    assert fast.model_dump_json() == ref.model_dump_json()


def _conforms(check: Any, model: type[BaseModel], value: Any) -> bool:
    """Whether ``check`` accepted ``value``; asserts the model accepts it too and builds the same."""
    fast = check(value)
    if fast is None:
        return False
    ref = model.model_validate(value)  # raises if the check accepted what the model refuses
    _same(fast, ref)
    return True


def test_a_reply_as_a_worker_sends_it_takes_the_fast_path() -> None:
    body = _worker_reply()
    framed = bytes(reply_frames(9, StepReply.model_validate(body))[0])  # the worker's own framing
    read = step_reply_frame(framed)
    assert read is not None and read[0] == 9
    _same(read[1], StepReply.model_validate(body))
    assert _conforms(step_reply, StepReply, body)
    assert _conforms(step_reply, StepReply, _worker_reply(traffic=None, grad_sq_norm=None, phases=[],
                                                          losses=[], held_bytes=None))


def test_the_decoder_knows_every_field_of_the_model() -> None:
    """A field added to StepReply without its mirror makes every reply take the slow path: caught here."""
    assert set(_worker_reply()) == set(StepReply.model_fields)
    assert step_reply(_worker_reply()) is not None


@pytest.mark.parametrize(("field", "value", "converted"), [
    ("step", True, False), ("step", 1.0, False), ("step", "1", False), ("stage", None, False),
    ("losses", [True], False), ("times", b"\0" * 8, False),
    ("times", [1.0, 2.0], False), ("times", "0123456789abcdef", False), ("times", None, False),
    ("times", b"\0" * (MAX_TIMES_BYTES + TIMING_BYTES), False), ("metric_sums", None, False),
    ("metric_sums", [0.0] * ((1 << 16) + 1), False), ("nonfinite_grads", ["a"] * 9, False),
    ("nonfinite_grads", [1], False),
    ("saved", [SavedPart(step=3, part="r0-s0", model=True).model_dump()], True),
    ("saved", None, False), ("grad_sq_norm", "1.0", False),
    ("held_bytes", -1, False),
    ("held_bytes", True, False), ("peak_bytes", 0.0, False), ("lead", -3, False),
    ("phases", [{"name": "", "start": 0.0, "end": 1.0}], False),
    ("phases", [{"name": "x" * 257, "start": 0.0, "end": 1.0}], False),
    ("phases", [{"name": "x", "start": 0.0}], False),
    ("phases", [{"name": "x", "start": 0, "end": 1.0, "more": 1}], False),
    ("phases", {}, False), ("traffic", {}, True),
    ("traffic", {**_TRAFFIC, "bytes_sent": {"tcp": 1}}, False),
    ("traffic", {**_TRAFFIC, "bytes_sent": {"zmq": -1}}, False),
    ("traffic", {**_TRAFFIC, "bytes_sent": {"zmq": False}}, False),
    ("traffic", {**_TRAFFIC, "refused_frames": {"": 1}}, False),
    ("traffic", {**_TRAFFIC, "refused_frames": {"r" * 81: 1}}, False),
    ("traffic", {**_TRAFFIC, "refused_frames": {f"r{i}": 1 for i in range(33)}}, False),
    ("traffic", {**_TRAFFIC, "extra": {}}, False),
    ("traffic", {**_TRAFFIC, "refused_frames": {b"r": 1}}, False),
])
def test_each_rule_of_the_model_is_declined_when_broken(field: str, value: Any, converted: bool) -> None:
    """Every rule of the model broken alone: the decoder declines, and the model decides (refusing it, or
    for the few the decoder leaves to it, as checkpoint parts, accepting it)."""
    body = _worker_reply(**{field: value})
    assert step_reply(body) is None
    if converted:
        StepReply.model_validate(body)
    else:
        with pytest.raises(ValidationError):
            StepReply.model_validate(body)


@pytest.mark.parametrize(("field", "value"), [("losses", [1, 2.5]), ("grad_sq_norm", 1),
                                               ("phases", [{"name": "x", "start": 0, "end": 1.0}])])
def test_an_int_where_a_float_goes_is_read_as_the_model_reads_it(field: str, value: Any) -> None:
    """msgspec converts it as pydantic does: a float in the message either way."""
    assert _conforms(step_reply, StepReply, _worker_reply(**{field: value}))


def test_unknown_and_missing_fields_are_declined() -> None:
    assert step_reply({**_worker_reply(), "extra": 1}) is None
    for name in StepReply.model_fields:
        body = _worker_reply()
        del body[name]
        assert step_reply(body) is None  # the model fills defaults and decides


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=300),
                     st.binary(max_size=8))
_VALUES = st.recursive(
    _SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                      st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
_FLOATS = st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6)
_PHASE = st.fixed_dictionaries({"name": st.text(min_size=0, max_size=258), "start": st.floats(),
                                "end": st.one_of(st.floats(), st.integers(-2, 2))})
_REASONS = st.dictionaries(st.text(min_size=0, max_size=82), st.integers(-2, 1 << 40), max_size=34)
_SENT = st.dictionaries(st.sampled_from(["zmq", "gloo", "nccl", "x"]),
                        st.one_of(st.integers(-1, 1 << 50), st.booleans()))
_TRAFFIC_ST = st.fixed_dictionaries({"bytes_sent": _SENT, "refused_frames": _REASONS,
                                     "refused_connections": _REASONS})


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the field's kind of value, sometimes anything."""
    return st.one_of(valid, valid, valid, _VALUES)


_BODY = st.fixed_dictionaries({
    "step": _maybe(st.integers(-5, 1 << 40)), "stage": _maybe(st.integers(-1, 9)), "losses": _maybe(_FLOATS),
    "metric_sums": _maybe(_FLOATS), "times": _maybe(st.binary(max_size=50)),
    "phases": _maybe(st.lists(st.one_of(_PHASE, _VALUES), max_size=3)),
    "nonfinite_grads": _maybe(st.lists(st.text(max_size=5), max_size=10)),
    "traffic": _maybe(st.one_of(st.none(), _TRAFFIC_ST)), "saved": _maybe(st.just([])),
    "grad_sq_norm": _maybe(st.one_of(st.none(), st.floats())),
    "held_bytes": _maybe(st.one_of(st.none(), st.integers(-2, 1 << 40))),
    "peak_bytes": _maybe(st.one_of(st.none(), st.integers(-2, 1 << 40))),
    "lead": _maybe(st.one_of(st.none(), st.integers(-2, 9))),
})


@settings(max_examples=250, deadline=None)
@given(_BODY, st.lists(st.sampled_from(sorted(StepReply.model_fields)), max_size=2), st.booleans())
def test_random_step_replies(body: dict[str, Any], dropped: list[str], extra: bool) -> None:
    for name in dropped:
        body.pop(name, None)
    if extra:
        body["surplus"] = 1
    _conforms(step_reply, StepReply, _wire(body))


@settings(max_examples=150, deadline=None)
@given(st.one_of(_PHASE, _VALUES))
def test_random_phases(value: Any) -> None:
    _conforms(phase_timing, PhaseTiming, _wire(value))


@settings(max_examples=150, deadline=None)
@given(st.one_of(_TRAFFIC_ST, _VALUES))
def test_random_traffic(value: Any) -> None:
    _conforms(traffic_counts, TrafficCounts, _wire(value))


def test_mutated_replies_and_every_seed() -> None:
    """The security fuzzer's mutations of a worker's reply, and every seed message's body, as a step reply."""
    maker = FrameMaker(2026)
    accepted = 0
    for _ in range(1500):
        body = copy.deepcopy(_worker_reply())
        for _ in range(maker.rng.randrange(1, 3)):
            maker._mutate_value(body)
        accepted += _conforms(step_reply, StepReply, _wire(body))
        part = body.get("traffic") if isinstance(body.get("traffic"), dict) else dict(_TRAFFIC)
        maker._mutate_value(part)
        _conforms(traffic_counts, TrafficCounts, _wire(part))
    assert accepted > 50  # a noise value is often still valid (a float for a float): those take the fast path
    for seed in SEEDS:
        body = _wire(seed.model_dump(mode="python"))
        assert _conforms(step_reply, StepReply, body) == isinstance(seed, StepReply)
        _conforms(phase_timing, PhaseTiming, body)
        _conforms(traffic_counts, TrafficCounts, body)


def _envelope_conforms(fields: Any) -> bool:
    """Whether the decoder accepted the frame of ``fields`` (an envelope's map without the version);
    asserts the models accept it too (the envelope, then its body) and build the same."""
    read = step_reply_frame(msgpack.packb({**fields, "v": 1}, use_bin_type=True))
    if read is None:
        return False
    ref = ReplyEnvelope.model_validate(fields)
    assert ref.ok and ref.error is None and ref.tensors == [] and ref.id == read[0]
    _same(read[1], StepReply.model_validate(ref.body))
    return True


_ENVELOPE = st.fixed_dictionaries({"id": _maybe(st.integers(-1, 1 << 40)), "ok": _maybe(st.booleans()),
                                   "body": _maybe(st.just(_worker_reply())),
                                   "error": _maybe(st.none()), "tensors": _maybe(st.just([]))})


@settings(max_examples=200, deadline=None)
@given(_ENVELOPE, st.lists(st.sampled_from(["id", "ok", "body", "error", "tensors"]), max_size=2),
       st.booleans())
def test_random_envelopes(fields: dict[str, Any], dropped: list[str], extra: bool) -> None:
    for name in dropped:
        fields.pop(name, None)
    if extra:
        fields["v2"] = 1
    _envelope_conforms(unpack_raw(msgpack.packb({**fields, "v": 1}, use_bin_type=True)))


def test_envelopes_the_fuzzer_breaks() -> None:
    rng = random.Random(7)
    maker = FrameMaker(7)
    plain = {"id": 3, "ok": True, "body": _worker_reply(), "error": None, "tensors": []}
    assert _envelope_conforms(plain)
    spec = {"name": "x", "dtype": "float32", "shape": [1], "frames": 1}
    for fields in ({**plain, "ok": False}, {**plain, "tensors": [spec]}, {**plain, "body": None},
                   {**plain, "error": {"code": "x", "message": "y"}}, {**plain, "id": -1},
                   {**plain, "id": True}, {**plain, "tensors": None}):
        assert not _envelope_conforms(_wire(fields))
    assert not _envelope_conforms({**plain, "body": {b"k": 1}})  # msgpack's bin keys: not a dict[str, Any]
    for _ in range(1000):
        fields = copy.deepcopy(plain)
        for _ in range(rng.randrange(1, 3)):
            maker._mutate_value(fields)
        _envelope_conforms(_wire(fields))


def test_a_key_given_twice_reads_as_msgpack_reads_it() -> None:
    """msgpack keeps a map's last value of a key; the decoder too, or declines (it checks every value)."""
    body = _worker_reply()
    del body["held_bytes"]
    head = msgpack.packb(body, use_bin_type=True)
    assert head[0] == 0x8C  # a fixmap of 12
    twice = [b"\x8e" + head[1:] + msgpack.packb("held_bytes") + msgpack.packb(first)
             + msgpack.packb("held_bytes") + msgpack.packb(7) for first in (5, -1)]  # 14 entries
    for frame_body, accepted in zip(twice, (True, False), strict=True):
        assert msgpack.unpackb(frame_body)["held_bytes"] == 7
        frame = (b"\x86" + msgpack.packb("id") + msgpack.packb(3) + msgpack.packb("ok") + msgpack.packb(True)
                 + msgpack.packb("error") + msgpack.packb(None) + msgpack.packb("tensors") + msgpack.packb([])
                 + msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("body") + frame_body)
        read = step_reply_frame(frame)
        assert (read is not None) == accepted
        if read is not None:
            _same(read[1], StepReply.model_validate(msgpack.unpackb(frame_body)))


def test_frames_the_usual_reading_refuses_are_declined() -> None:
    """Another protocol version, no version, not msgpack, not a map, over the size limit: declined, so the
    usual reading (comm/rpc/framing.py's reply_fields) refuses them with its reason."""
    body = _worker_reply()
    assert step_reply_frame(_frame(body)) is not None
    for frame in (_frame(body, v=2), msgpack.packb({"id": 3, "ok": True, "body": body, "error": None,
                                                    "tensors": []}), b"\xc1garbage", msgpack.packb([1, 2]),
                  b"", _frame(body)[:-3], _frame({**body, "losses": [0.5] * (MAX_CONTROL_BYTES // 9)})):
        assert step_reply_frame(frame) is None


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _VALUES, max_size=6), st.integers(0, 1 << 62),
       st.text(min_size=1, max_size=20))
def test_a_request_packed_once_reads_as_the_usual_frame(body: dict[str, Any], request_id: int,
                                                        service: str) -> None:
    """[Note: a request packed once]: the same map as request_frames' (the receiver cannot tell them
    apart), for any body, id and service, the head cached or not."""
    heads = RequestHeads()
    usual = unpack_raw(request_frames(request_id, service, "run_step", body)[0])
    for _ in range(2):
        packed = heads.frame(request_id, service, "run_step", PackedBody(body))
        assert _equal(unpack_raw(packed), usual)  # NaN equal to NaN


def test_the_timings_travel_packed_and_read_back_as_lists() -> None:
    """``times`` is one bin of float64 (the starts, then the ends): the reply as read gives the same floats
    the worker timed, each action's start and end at its index, and an uneven pair is refused on both
    sides of the wire."""
    starts, ends = [1_795_880_974.828326, 2.5, float("inf")], [1_795_880_974.9, 3.0, float("nan")]
    body = _worker_reply(times=pack_times(starts, ends))
    assert type(body["times"]) is bytes and len(body["times"]) == 3 * TIMING_BYTES
    read = step_reply(body)
    assert read is not None and read.num_timed == 3
    assert read.starts == starts and read.ends[:2] == ends[:2] and math.isnan(read.ends[2])
    assert StepReply.model_validate(body).starts == starts
    with pytest.raises(ValueError, match="3 action starts but 2 ends"):
        pack_times(starts, ends[:2])
    assert StepReply(step=0, stage=0, losses=[]).starts == [] == StepReply(step=0, stage=0, losses=[]).ends


def test_the_traffic_counters_ride_on_a_reply_when_they_changed() -> None:
    reports = TrafficReports()
    first = TrafficCounts.model_validate(_TRAFFIC)
    assert reports.report(first) is first  # a stage's first reply carries them
    assert reports.report(TrafficCounts.model_validate(_TRAFFIC)) is None  # unchanged
    assert reports.report(first, training=False) is first  # an evaluation's reply always does
    assert reports.report(first) is None  # ... and does not count as sent
    more = TrafficCounts.model_validate({**_TRAFFIC, "bytes_sent": {"zmq": 10241, "gloo": 0}})
    assert reports.report(more) is more and reports.report(more) is None
    assert TrafficReports().report(more) is more  # a stage placed anew reports at once


def window_reply(body: Any) -> WindowReply | None:
    """The window decoder on ``body`` in a plain reply's frame: the message, or None (declined)."""
    read = window_reply_frame(_frame(body))
    if read is not None:
        assert read[0] == 3
    return None if read is None else read[1]


def test_a_window_reply_as_a_worker_sends_it_takes_the_fast_path() -> None:
    steps = [_worker_reply(step=7 + k) for k in range(3)]
    model = WindowReply.model_validate({"steps": steps, "committed": [True, False]})
    read = window_reply_frame(bytes(reply_frames(9, model)[0]))
    assert read is not None and read[0] == 9
    _same(read[1], model)
    assert set(WindowReply.model_fields) == {"steps", "committed"}  # the decoder's mirror, field by field


def test_the_messages_read_share_one_set_of_fields_given_and_nothing_changes_it() -> None:
    """trusted() gives every message of a model one set of fields given (all of them): sound only while no
    message can change it. A reply is frozen, and a copy with changes gets a set of its own."""
    steps = [_worker_reply(step=7 + k) for k in range(3)]
    frame = bytes(reply_frames(9, WindowReply.model_validate({"steps": steps, "committed": [True, True]}))[0])
    first, second = window_reply_frame(frame), window_reply_frame(frame)
    assert first is not None and second is not None
    replies = [*first[1].steps, *second[1].steps]
    shared = replies[0].model_fields_set
    assert all(r.model_fields_set is shared for r in replies) and shared == set(StepReply.model_fields)
    phases = [p for r in replies for p in r.phases]
    assert phases and all(p.model_fields_set is phases[0].model_fields_set for p in phases)
    with pytest.raises(ValidationError):
        replies[0].step = 3  # frozen: no assignment reaches the set
    changed = replies[0].model_copy(update={"step": 3})
    assert changed.step == 3 and changed.model_fields_set is not shared
    assert shared == set(StepReply.model_fields) and replies[1].step == 8

    class Open(BaseModel):  # a model whose messages can change: a set of its own each
        a: int = 0

    one, two = (trusted(Open, {"a": 1}, frozenset(Open.model_fields)) for _ in range(2))
    assert one.model_fields_set == {"a"} and one.model_fields_set is not two.model_fields_set


@pytest.mark.parametrize("body", [
    {"steps": [], "committed": []},  # no step
    {"steps": [{}], "committed": []},  # a step without its fields
    {"steps": [_worker_reply(), _worker_reply()], "committed": []},  # a verdict short
    {"steps": [_worker_reply()], "committed": [True]},  # a verdict too many
    {"steps": [_worker_reply()] * 65, "committed": [True] * 64},  # past MAX_WINDOW_STEPS
    {"steps": [_worker_reply(times=b"\0" * 8)], "committed": []},  # a timing cut short
    {"steps": [_worker_reply()], "committed": [], "extra": 1},
    {"steps": [_worker_reply()], "committed": "no"},
])
def test_a_bad_window_is_declined_and_the_model_refuses_it_too(body: Any) -> None:
    assert window_reply(_wire(body)) is None
    with pytest.raises(ValidationError):
        WindowReply.model_validate(_wire(body))


def test_a_step_reply_is_no_window_and_a_window_no_step_reply() -> None:
    assert window_reply(_worker_reply()) is None
    assert step_reply({"steps": [_worker_reply()], "committed": []}) is None
    assert _conforms(window_reply, WindowReply, {"steps": [_worker_reply()], "committed": []})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(allow_nan=False), st.floats(allow_nan=False)), max_size=40))
def test_a_reply_s_last_end_is_its_ends_maximum_read_in_place(timings: list[tuple[float, float]]) -> None:
    starts, ends = [s for s, _ in timings], [e for _, e in timings]
    reply = StepReply(step=0, stage=0, losses=[], times=pack_times(starts, ends))
    assert reply.last_end == (max(ends) if ends else None)
    assert reply.last_end == (max(reply.ends) if reply.ends else None)  # the unpacked view agrees


def _report(r: StepReport) -> dict[str, Any]:
    """What a reader of a step's reply sees through :class:`StepReport`, in plain values."""
    traffic = None if r.traffic is None else (dict(r.traffic.bytes_sent), dict(r.traffic.refused_frames),
                                              dict(r.traffic.refused_connections))
    return {"step": r.step, "stage": r.stage, "losses": repr(list(r.losses)),  # repr: NaN equals NaN
            "metric_sums": repr(list(r.metric_sums)), "times": r.times,
            "phases": repr([(p.name, p.start, p.end) for p in r.phases]),
            "nonfinite_grads": list(r.nonfinite_grads), "traffic": traffic, "saved": list(r.saved),
            "grad_sq_norm": repr(r.grad_sq_norm), "held_bytes": r.held_bytes, "peak_bytes": r.peak_bytes,
            "lead": r.lead, "num_timed": r.num_timed, "starts": repr(r.starts), "ends": repr(r.ends),
            "last_end": repr(r.last_end), "step_end": repr(step_end(r))}


@settings(max_examples=250, deadline=None)
@given(_BODY)
def test_a_reply_kept_as_read_reads_as_its_message(body: dict[str, Any]) -> None:
    """What the coordinator keeps (StepRead) reads, field by field and through every property, as the model
    validated from the same frame; so do the windows; the counters of several replies merge alike."""
    read = read_step_frame(_frame(_wire(body)))
    if read is None:
        return
    model = StepReply.model_validate(_wire(body))
    assert set(_report(read[1])) - {"num_timed", "starts", "ends", "last_end", "step_end"} == set(
        StepReply.model_fields)  # the check sees every field
    assert _report(read[1]) == _report(model) == _report(read[1].message())
    window = read_window_frame(_frame(_wire({"steps": [body, body], "committed": [False]})))
    assert window is not None and window[1].committed == (False,)
    assert [_report(s) for s in window[1].steps] == [_report(model)] * 2
    if model.traffic is not None:
        later = TrafficCounts(bytes_sent={"zmq": 7}, refused_frames={"zz": 1})
        assert latest_by([("w", read[1].traffic), ("v", None), ("w", later)]) == latest_by(
            [("w", model.traffic), ("w", later)]) == {"w": model.traffic.latest(later)}
        assert latest_by([("w", read[1].traffic)]) == {"w": model.traffic}
