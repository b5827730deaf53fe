"""One size limit for every tensor a peer announces, checked at its edge by each of its four checkers.

The checkers: a data message's header (``comm.wire.decode_header``), an RPC tensor spec
(``TensorSpec``), a parameter-server parameter (``ParamInfo``) and a tensor that crosses a
pipeline cut (``BoundaryTensor``). Each must accept a tensor of exactly ``MAX_TENSOR_BYTES``
bytes and ``MAX_NDIM`` dims, and refuse one element or one dim more — in bytes, whatever
the dtype — with an error naming the limit. The expected sizes are computed here from
torch's own item sizes, not from the code under test.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
import torch
from pydantic import ValidationError

from comm.codec import PROTOCOL_VERSION
from comm.errors import ProtocolError
from comm.rpc.envelope import TensorSpec
from comm.wire import MAX_NDIM, MAX_TENSOR_BYTES, decode_header, tensor_nbytes
from services.protocol import BoundaryTensor, ParamInfo

ITEMSIZE = {name: torch.empty((), dtype=getattr(torch, name)).element_size()
            for name in ("uint8", "bool", "int16", "float32", "float64", "bfloat16")}


def _header(dtype: str, shape: list[int]) -> None:
    raw = msgpack.packb([PROTOCOL_VERSION, "w", 0, 0, 0, 0, 0, dtype, shape, 0, 0, -1], use_bin_type=True)
    decode_header(2, raw, 0)


CHECKERS: dict[str, Callable[[str, list[int]], object]] = {
    "header": _header,
    "TensorSpec": lambda dtype, shape: TensorSpec.model_validate(
        {"name": "t", "dtype": dtype, "shape": shape, "frames": 1}),
    "ParamInfo": lambda dtype, shape: ParamInfo.model_validate({"name": "w", "dtype": dtype, "shape": shape}),
    "BoundaryTensor": lambda dtype, shape: BoundaryTensor.model_validate(
        {"name": "h", "dtype": dtype, "shape": shape, "requires_grad": False}),
}
REFUSED = (ProtocolError, ValidationError)


def _edge(dtype: str) -> int:
    """The most elements of ``dtype`` within the limit (torch's item size, the limit in bytes)."""
    return MAX_TENSOR_BYTES // ITEMSIZE[dtype]


@pytest.mark.parametrize("checker", sorted(CHECKERS))
@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_the_byte_limit_at_its_edge(checker: str, dtype: str) -> None:
    check = CHECKERS[checker]
    n = _edge(dtype)
    check(dtype, [n])  # exactly the limit
    check(dtype, [1 << 10, n >> 10])  # the same bytes in two dims
    with pytest.raises(REFUSED, match="-byte limit"):
        check(dtype, [n + 1])
    with pytest.raises(REFUSED, match="-byte limit"):
        check(dtype, [1 << 10, (n >> 10) + 1])


@pytest.mark.parametrize("checker", sorted(CHECKERS))
def test_a_zero_dim_counts_as_one(checker: str) -> None:
    """An empty tensor may not carry a dim no allocator could stride over (torch's strides overflow)."""
    check = CHECKERS[checker]
    n = _edge("float32")
    check("float32", [0, n])
    check("float32", [n, 0])
    with pytest.raises(REFUSED, match="counting each 0 dim as 1"):
        check("float32", [0, n + 1])
    with pytest.raises(REFUSED, match="counting each 0 dim as 1"):
        check("float32", [0, 1 << 33, 1 << 33])
    with pytest.raises(RuntimeError):  # why: torch itself cannot make that one
        torch.empty([0, 1 << 33, 1 << 33], dtype=torch.float32)


@pytest.mark.parametrize("checker", sorted(CHECKERS))
def test_the_dims_limit_at_its_edge(checker: str) -> None:
    check = CHECKERS[checker]
    check("float32", [1] * MAX_NDIM)
    with pytest.raises(REFUSED):
        check("float32", [1] * (MAX_NDIM + 1))


@pytest.mark.parametrize("checker", sorted(CHECKERS))
def test_unknown_dtypes_and_negative_dims(checker: str) -> None:
    check = CHECKERS[checker]
    with pytest.raises(REFUSED, match="dtype"):
        check("complex512", [4])
    with pytest.raises(REFUSED):
        check("float32", [-1])


def test_nbytes_is_the_tensors_size() -> None:
    for dtype, size in ITEMSIZE.items():
        assert tensor_nbytes(dtype, [3, 5]) == 15 * size
        assert TensorSpec(name="t", dtype=dtype, shape=[3, 5], frames=1).nbytes == 15 * size
    assert tensor_nbytes("float64", []) == 8  # a scalar
    assert tensor_nbytes("float64", [0, 7]) == 0


def test_a_boundary_tensor_checks_its_dtype_before_its_gradient_rule() -> None:
    """The shared check runs first: an unknown dtype is a validation error, not a KeyError in the next."""
    with pytest.raises(ValidationError, match="unknown dtype 'quaternion'"):
        BoundaryTensor.model_validate({"name": "h", "dtype": "quaternion", "shape": [4],
                                       "requires_grad": True})
