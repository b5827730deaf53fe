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
allocated from a header): known dtype, sane rank and size, offset and length inside the
tensor, and the body's real length. A bad message raises :class:`WireError`, whose
``reason`` names the broken rule in one word; receivers count it by reason and drop it.

The size limit. Every tensor a peer announces is checked by :func:`tensor_nbytes`: a data
message's header here, an RPC tensor spec (``comm/rpc/envelope.py``), a parameter or
boundary tensor of a control message (``services/protocol/``). So the limit means one
thing everywhere: at most :data:`MAX_NDIM` dims and :data:`MAX_TENSOR_BYTES` bytes, where a
dim of 0 counts as 1 — an empty tensor may not carry a dim that no allocator could stride
over (torch refuses ``[0, 2**33, 2**33]``: its strides overflow).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal, NamedTuple

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
    "WireError",
    "WireReason",
    "decode_header",
    "dtype_name",
    "encode_header",
    "tensor_bytes",
    "tensor_nbytes",
]

KIND_P2P = 0
KIND_COLLECTIVE = 1
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 36  # 64 GiB: larger is refused as corrupt, not allocated
_MAX_GROUP_NAME = 256
_MAX_HEADER = 4096  # bytes of a header frame

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
_packb = partial(msgpack.packb, use_bin_type=True)

MessageKey = tuple[str, int, int, int, int]  # (group, kind, seq, tag, part)

WireReason = Literal["frames", "encoding", "version", "dtype", "shape", "size", "range", "length", "source",
                     "slot"]
"""Which rule of the wire format a message broke (a fixed set: receivers count faults by it).

``source`` and ``slot`` are the receiver's own checks: the header names another sender
than the channel's, or a shared-memory slot that is not there or not full."""


class WireError(ProtocolError):
    """A tensor header or spec that breaks the wire format.

    Attributes:
        reason: the rule it broke (:data:`WireReason`); the message says how, with the values.
    """

    def __init__(self, reason: WireReason, message: str) -> None:
        super().__init__(message)
        self.reason: WireReason = reason


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """The bytes of a ``dtype`` tensor of ``shape``, once the shape passed the one size limit.

    The limit (see the module docstring): a known dtype, at most :data:`MAX_NDIM` dims, none
    negative, and at most :data:`MAX_TENSOR_BYTES` bytes counting every 0 dim as 1.

    Raises:
        WireError: naming the dtype, the shape and the limit it breaks.
    """
    if dtype not in DTYPES:
        raise WireError("dtype", f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if len(shape) > MAX_NDIM:
        raise WireError("shape", f"shape {list(shape)} has {len(shape)} dims, over the limit of {MAX_NDIM}")
    if any(d < 0 for d in shape):
        raise WireError("shape", f"shape {list(shape)} has a negative dim")
    itemsize = DTYPES[dtype].itemsize
    spanned = math.prod(max(d, 1) for d in shape) * itemsize
    if spanned > MAX_TENSOR_BYTES:
        zero = " (counting each 0 dim as 1)" if 0 in shape else ""
        raise WireError("size", f"a {dtype} tensor of shape {list(shape)} spans {spanned} bytes{zero}, over "
                                f"the {MAX_TENSOR_BYTES}-byte limit")
    return math.prod(shape) * itemsize


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported on the zmq backend; supported: {', '.join(DTYPES)}"
        ) from None


class TensorHeader(NamedTuple):
    """A data message's header, as :func:`decode_header` accepted it (a tuple: cheap to build)."""

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

    def encode(self, slot: int | None = None) -> bytes:
        """The msgpack header; ``slot`` overrides the header's own (the shared-memory slot the body took)."""
        return encode_header(self.group, self.src, self.kind, self.seq, self.tag, self.part, self.dtype,
                             self.shape, self.offset, self.nbytes, self.slot if slot is None else slot)


def encode_header(group: str, src: int, kind: int, seq: int, tag: int, part: int, dtype: str,
                  shape: Sequence[int], offset: int, nbytes: int, slot: int = -1) -> bytes:
    """A data message's msgpack header (the fields of :class:`TensorHeader`, without building one)."""
    data = _packb([PROTOCOL_VERSION, group, src, kind, seq, tag, part, dtype, list(shape), offset, nbytes,
                   slot])
    assert isinstance(data, bytes)
    return data


def _int(value: Any, field: str, lo: int = 0, hi: int = 1 << 62, reason: WireReason = "range") -> int:
    if type(value) is not int:
        raise WireError("encoding", f"tensor header: {field} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError(reason, f"tensor header: {field}={value} is outside [{lo}, {hi}]")
    return value


def decode_header(frames_count: int, header: bytes, body_len: int) -> TensorHeader:
    """Validate and decode a data message's header (given the real body length).

    Raises:
        WireError: naming what is wrong (and, in ``reason``, which rule); nothing has been allocated.
    """
    if frames_count not in (1, 2):
        raise WireError("frames", f"data message has {frames_count} frames, expected 2 (header, body) or 1 "
                                  "(a header whose body is in shared memory)")
    if len(header) > _MAX_HEADER:
        raise WireError("size", f"tensor header of {len(header)} bytes is over the {_MAX_HEADER}-byte limit")
    try:
        fields = msgpack.unpackb(header, raw=False, max_array_len=64, max_str_len=1024, max_bin_len=0)
    except Exception as exc:
        raise WireError("encoding", f"tensor header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(fields, list) or len(fields) != 12:
        raise WireError("encoding", "tensor header must be a msgpack array of 12 fields")
    version, group, src, kind, seq, tag, part, dtype, shape, offset, nbytes, slot = fields
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise WireError("version", f"tensor header: protocol version {version!r}, this process speaks "
                                   f"{PROTOCOL_VERSION}")
    if not isinstance(group, str) or len(group) > _MAX_GROUP_NAME:
        raise WireError("encoding", "tensor header: group must be a short string")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError("dtype", f"tensor header: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise WireError("shape", f"tensor header: shape must be a list of at most {MAX_NDIM} dims")
    for d in shape:
        _int(d, "shape dim")
    dims = tuple(shape)
    try:
        total = tensor_nbytes(dtype, dims)
    except WireError as exc:
        raise WireError(exc.reason, f"tensor header: {exc}") from None
    n = _int(nbytes, "nbytes", 0, DATA_MAX_MESSAGE, reason="size")
    off = _int(offset, "offset", 0, total)
    if off + n > total:
        raise WireError("range", f"tensor header: bytes [{off}, {off + n}) run past the tensor's {total} "
                                 "bytes")
    in_shm = _int(slot, "slot", -1, 1 << 16) >= 0
    if in_shm != (frames_count == 1):
        raise WireError("frames", f"tensor header: slot {slot} with {frames_count} frames (a body in shared "
                                  "memory comes without a body frame, any other with one)")
    if not in_shm and body_len != n:
        raise WireError("length", f"tensor body is {body_len} bytes but its header says {n}")
    return TensorHeader(group, _int(src, "src", 0, 1 << 20), _int(kind, "kind", 0, 1), _int(seq, "seq"),
                        _int(tag, "tag", -(1 << 62)), _int(part, "part", 0, 1 << 40), dtype, dims, off, n,
                        slot)


def tensor_bytes(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A uint8 numpy view of a contiguous CPU tensor's memory (keeps the tensor alive)."""
    assert t.is_contiguous() and t.is_cpu, "tensor_bytes needs a contiguous CPU tensor"
    flat = t.view(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a tensor of 0 or 1 elements contiguous whatever its stride; the byte view needs 1
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()
