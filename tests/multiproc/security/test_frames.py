"""The fuzzer's frames are what it claims: every message type is among them, and each frame is refused.

The fuzz test sends these frames with the job's own keys at a job whose parameters it then
compares with one process's training, so a frame that validated could change the outcome.
The fuzzer draws one stream per service kind and one per data peer, each from the fuzz
test's seed; here each of those streams, as long as the fuzzer may send of it, goes through
the checks the receivers run (the service host's envelope, method and body validation and
tensor decoding; the transport's header decoding and source check), and every frame must
fail one of them.
"""

from __future__ import annotations

import pytest
import zmq
from pydantic import ValidationError

from comm.codec import unpack, unpack_raw
from comm.errors import ProtocolError
from comm.rpc.envelope import RequestEnvelope
from comm.rpc.framing import decode_tensors
from comm.wire import decode_header
from comm.zmq import shm
from comm.zmq.door import ChannelRequest
from tests.multiproc.security.frames import (
    SEEDS,
    SERVICE_METHODS,
    STREAM_FRAMES,
    FrameMaker,
    message_types,
    request_type,
)

SEED = 20240611  # the fuzz test's
N = STREAM_FRAMES  # frames checked per stream; the fuzzer sends no more of each


def refusal_of_request(frames: list[bytes], kind: str) -> str | None:
    """Why a service host of ``kind`` refuses ``frames`` (None: it would run the handler)."""
    try:
        envelope = RequestEnvelope.model_validate(unpack_raw(frames[0], what="request envelope"))
        rtype = request_type(kind, envelope.method)
        if rtype is None:
            return "unknown_method"
        rtype.model_validate(envelope.body)
        decode_tensors(envelope.tensors, [zmq.Frame(f) for f in frames[1:]])
    except (ProtocolError, ValidationError) as exc:
        return type(exc).__name__
    return None


def refusal_of_data(frames: list[bytes], peer: int) -> str | None:
    """Why a rank's PULL socket for ``peer`` drops ``frames`` (None: it would take the message)."""
    try:
        header = decode_header(len(frames), frames[0], len(frames[1]) if len(frames) == 2 else -1)
    except ProtocolError:
        return "header"
    if header.src != peer:
        return "source"
    if header.slot >= shm.SLOTS:
        return "slot"
    return None


def test_every_message_type_has_a_seed() -> None:
    seeded = {type(m) for m in SEEDS}
    missing = [t.__name__ for t in message_types() if t not in seeded]
    assert not missing, f"add a seed message for {missing} to frames.SEEDS"
    for message in SEEDS:  # the seeds are valid messages: the mutations are what breaks them
        assert type(message).model_validate(message.model_dump(mode="python")) == message


def test_the_method_table_covers_the_services() -> None:
    assert {"assign", "release", "status"} <= set(SERVICE_METHODS["worker"])
    assert {"run_step", "parameters", "optimizer_step", "commit", "state"} <= set(SERVICE_METHODS["compute"])
    assert {"put", "cas", "delete", "lease_grant", "watch_poll"} <= set(SERVICE_METHODS["registry"])


@pytest.mark.parametrize("kind", sorted(SERVICE_METHODS))
def test_every_control_frame_is_refused(kind: str) -> None:
    maker = FrameMaker(SEED)
    reasons: dict[str, int] = {}
    for i in range(N):
        frames = maker.control(f"{kind}-svc", kind)
        reason = refusal_of_request(frames, kind)
        assert reason is not None, f"frame {i} would be served: {frames[0][:300]!r}"
        reasons[reason] = reasons.get(reason, 0) + 1
    assert reasons.get("ValidationError", 0) > N // 2, reasons  # most reach the models, not just msgpack


@pytest.mark.parametrize("peer", [0, 1])
def test_every_data_frame_is_dropped(peer: int) -> None:
    maker = FrameMaker(SEED)
    for i in range(N):
        frames = maker.data(peer)
        assert refusal_of_data(frames, peer) is not None, f"data message {i} would be taken: {frames[0]!r}"


def test_every_door_request_is_refused() -> None:
    maker = FrameMaker(SEED)
    for i in range(N):
        frames = maker.door()
        if len(frames) != 1:
            continue  # the door answers any request of more than one frame with an error
        with pytest.raises(ProtocolError):
            unpack(frames[0], ChannelRequest, what=f"door request {i}")


def test_the_stream_is_deterministic() -> None:
    a, b = FrameMaker(7), FrameMaker(7)
    assert [a.control("w", "worker") for _ in range(50)] == [b.control("w", "worker") for _ in range(50)]
    assert [a.data(1) for _ in range(50)] == [b.data(1) for _ in range(50)]
    assert [a.door() for _ in range(50)] == [b.door() for _ in range(50)]
