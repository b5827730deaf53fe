"""The tensor wire format of the ZeroMQ data path: a small msgpack header frame, then raw bytes.

One data message is two frames, or one when its body is in shared memory::

    [header, body]
    header = msgpack array [version, group, src, kind, seq, tag, part, dtype, shape, offset, nbytes, slot]
    body   = nbytes raw bytes: bytes [offset, offset + nbytes) of the tensor's contiguous storage

``slot`` is -1 for a body in the message; a slot index ``>= 0`` means the message is the
header alone and the body is in that slot of the receiver's shared-memory inbox from this
peer (``comm/zmq/shm.py``, same-host peers only).

A tensor larger than :data:`comm.sockets.CHUNK_BYTES` travels as several messages
(parts), so libzmq never allocates one huge receive buffer and the receiver can work on
early parts while later ones are still on the wire. ``(group, kind, seq, tag, part)`` is
the message's *key*: concurrent operations between the same pair never mix because no two
in-flight messages share a key.

:func:`decode_header` checks everything before anything is acted on (and nothing is ever
allocated from a header): known dtype, sane rank and element count, offset and length
inside the tensor, and the body's real length. A bad message raises
:class:`~comm.errors.ProtocolError`; receivers log it and drop it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from comm.codec import PROTOCOL_VERSION
from comm.errors import ProtocolError
from comm.sockets import DATA_MAX_MESSAGE

__all__ = [
    "DTYPES",
    "KIND_COLLECTIVE",
    "KIND_P2P",
    "MAX_NDIM",
    "MAX_TENSOR_BYTES",
    "MessageKey",
    "TensorHeader",
    "decode_header",
    "dtype_name",
    "tensor_bytes",
]

KIND_P2P = 0
KIND_COLLECTIVE = 1
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 36  # 64 GiB: larger is refused as corrupt, not allocated
_MAX_GROUP_NAME = 256

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}

MessageKey = tuple[str, int, int, int, int]  # (group, kind, seq, tag, part)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported on the zmq backend; supported: {', '.join(DTYPES)}"
        ) from None


@dataclass(frozen=True, slots=True)
class TensorHeader:
    group: str
    src: int
    kind: int
    seq: int
    tag: int
    part: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    slot: int = -1  # >= 0: the body is in this shared-memory slot, not in the message

    @property
    def key(self) -> MessageKey:
        return (self.group, self.kind, self.seq, self.tag, self.part)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def total_bytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def encode(self) -> bytes:
        data = msgpack.packb(
            [
                PROTOCOL_VERSION,
                self.group,
                self.src,
                self.kind,
                self.seq,
                self.tag,
                self.part,
                self.dtype,
                list(self.shape),
                self.offset,
                self.nbytes,
                self.slot,
            ],
            use_bin_type=True,
        )
        assert isinstance(data, bytes)
        return data


def _int(value: Any, field: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int:
        raise ProtocolError(f"tensor header: {field} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(f"tensor header: {field}={value} is outside [{lo}, {hi}]")
    return value


def decode_header(frames_count: int, header: bytes, body_len: int) -> TensorHeader:
    """Validate and decode a data message's header (given the real body length).

    Raises:
        ProtocolError: naming what is wrong; nothing has been allocated.
    """
    if frames_count not in (1, 2):
        raise ProtocolError(f"data message has {frames_count} frames, expected 2 (header, body) or 1 "
                            "(a header whose body is in shared memory)")
    if len(header) > 4096:
        raise ProtocolError(f"tensor header of {len(header)} bytes is over the 4096-byte limit")
    try:
        fields = msgpack.unpackb(header, raw=False, max_array_len=64, max_str_len=1024, max_bin_len=0)
    except Exception as exc:
        raise ProtocolError(f"tensor header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(fields, list) or len(fields) != 12:
        raise ProtocolError("tensor header must be a msgpack array of 12 fields")
    version, group, src, kind, seq, tag, part, dtype, shape, offset, nbytes, slot = fields
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"tensor header: protocol version {version!r}, this process speaks {PROTOCOL_VERSION}"
        )
    if not isinstance(group, str) or len(group) > _MAX_GROUP_NAME:
        raise ProtocolError("tensor header: group must be a short string")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"tensor header: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(f"tensor header: shape must be a list of at most {MAX_NDIM} dims")
    dims = tuple(_int(d, "shape dim", 0, MAX_TENSOR_BYTES) for d in shape)
    total = math.prod(dims) * DTYPES[dtype].itemsize
    if total > MAX_TENSOR_BYTES:
        raise ProtocolError(
            f"tensor header: shape {list(dims)} of {dtype} is {total} bytes, over the "
            f"{MAX_TENSOR_BYTES}-byte limit"
        )
    n = _int(nbytes, "nbytes", 0, DATA_MAX_MESSAGE)
    off = _int(offset, "offset", 0, total)
    if off + n > total:
        raise ProtocolError(f"tensor header: bytes [{off}, {off + n}) run past the tensor's {total} bytes")
    in_shm = _int(slot, "slot", -1, 1 << 16) >= 0
    if in_shm != (frames_count == 1):
        raise ProtocolError(f"tensor header: slot {slot} with {frames_count} frames (a body in shared memory "
                            "comes without a body frame, any other with one)")
    if not in_shm and body_len != n:
        raise ProtocolError(f"tensor body is {body_len} bytes but its header says {n}")
    return TensorHeader(
        group=group,
        src=_int(src, "src", 0, 1 << 20),
        kind=_int(kind, "kind", 0, 1),
        seq=_int(seq, "seq"),
        tag=_int(tag, "tag", -(1 << 62)),
        part=_int(part, "part", 0, 1 << 40),
        dtype=dtype,
        shape=dims,
        offset=off,
        nbytes=n,
        slot=slot,
    )


def tensor_bytes(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A uint8 numpy view of a contiguous CPU tensor's memory (keeps the tensor alive)."""
    assert t.is_contiguous() and t.device.type == "cpu", "tensor_bytes needs a contiguous CPU tensor"
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a tensor of 0 or 1 elements contiguous whatever its stride; the byte view needs 1
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()
