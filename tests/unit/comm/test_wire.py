"""The tensor header: round trip, and every kind of garbage refused before anything is allocated."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comm.codec import PROTOCOL_VERSION
from comm.errors import ProtocolError
from comm.sockets import DATA_MAX_MESSAGE
from comm.wire import DTYPES, MAX_TENSOR_BYTES, TensorHeader, WireError, decode_header


def _header(**kw: object) -> TensorHeader:
    fields: dict[str, object] = dict(group="w", src=1, kind=1, seq=7, tag=3, part=0, dtype="float32",
                                     shape=(4, 5), offset=0, nbytes=80)
    fields.update(kw)
    return TensorHeader(**fields)  # type: ignore[arg-type]


def _raw(*fields: object) -> bytes:
    data = msgpack.packb(list(fields), use_bin_type=True)
    assert isinstance(data, bytes)
    return data


GOOD = [PROTOCOL_VERSION, "w", 1, 1, 7, 3, 0, "float32", [4, 5], 0, 80, -1]


def test_round_trip() -> None:
    h = _header()
    assert decode_header(2, h.encode(), 80) == h
    in_shm = _header(slot=3)
    assert decode_header(1, in_shm.encode(), -1) == in_shm
    assert h.total_bytes == 80 and h.torch_dtype == torch.float32


@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.lists(st.integers(0, 50), max_size=4),
    seq=st.integers(0, 1 << 40),
    tag=st.integers(-(1 << 40), 1 << 40),
)
def test_round_trip_any_valid(dtype: str, shape: list[int], seq: int, tag: int) -> None:
    total = torch.empty(shape, dtype=DTYPES[dtype]).nbytes
    n = min(total, 100)
    h = _header(dtype=dtype, shape=tuple(shape), seq=seq, tag=tag, nbytes=n)
    assert decode_header(2, h.encode(), n) == h


@pytest.mark.parametrize(
    ("frames", "header", "body_len", "message", "reason"),
    [
        (1, _raw(*GOOD), 80, "frames", "frames"),  # a body-less message must name its shared-memory slot
        (2, _raw(*GOOD[:11], 2), 80, "frames", "frames"),  # and a message with a body must not
        (3, _raw(*GOOD), 80, "frames", "frames"),
        (0, _raw(*GOOD), 80, "frames", "frames"),
        (1, _raw(*GOOD[:11], -2), -1, "outside", "range"),
        (1, _raw(*GOOD[:11], 1 << 20), -1, "outside", "range"),
        (2, b"\xc1\xc1garbage", 80, "not msgpack", "encoding"),
        (2, b"", 80, "not msgpack", "encoding"),
        (2, _raw(*GOOD[:-1]), 80, "12 fields", "encoding"),
        (2, msgpack.packb({"a": 1}), 80, "12 fields", "encoding"),
        (2, _raw(99, *GOOD[1:]), 80, "protocol version", "version"),
        (2, _raw(True, *GOOD[1:]), 80, "protocol version", "version"),  # True == 1, but it is no version
        (2, _raw(1.0, *GOOD[1:]), 80, "protocol version", "version"),
        (2, _raw(*GOOD[:7], "complex512", *GOOD[8:]), 80, "unknown dtype", "dtype"),
        (2, _raw(*GOOD[:8], [-1, 5], *GOOD[9:]), 80, "outside", "range"),
        (2, _raw(*GOOD[:8], [1 << 40], 0, 80, -1), 80, "over the", "size"),
        (2, _raw(*GOOD[:8], [1 << 20, 1 << 20], 0, 80, -1), 80, "over the", "size"),
        (2, _raw(*GOOD[:8], [0, 1 << 33, 1 << 33], 0, 0, -1), 0, "counting each 0 dim as 1", "size"),
        (2, _raw(*GOOD[:8], list(range(1, 20)), 0, 80, -1), 80, "at most", "shape"),
        (2, _raw(*GOOD[:8], ["4", 5], 0, 80, -1), 80, "must be an int", "encoding"),
        (2, _raw(*GOOD[:9], 40, 80, -1), 80, "run past", "range"),
        (2, _raw(*GOOD[:9], -1, 80, -1), 80, "outside", "range"),
        (2, _raw(*GOOD[:10], DATA_MAX_MESSAGE + 1, -1), DATA_MAX_MESSAGE + 1, "outside", "size"),
        (2, _raw(*GOOD), 79, "header says", "length"),
        (2, _raw(*GOOD[:2], True, *GOOD[3:]), 80, "must be an int", "encoding"),
        (2, b"x" * 5000, 80, "limit", "size"),
    ],
)
def test_garbage_is_refused(frames: int, header: bytes, body_len: int, message: str, reason: str) -> None:
    with pytest.raises(WireError, match=message) as refused:
        decode_header(frames, header, body_len)
    assert refused.value.reason == reason
    assert isinstance(refused.value, ProtocolError)  # what every receiver of a message catches


def test_limit_is_well_above_real_tensors() -> None:
    assert MAX_TENSOR_BYTES >= 1 << 34
