"""Counter-based random numbers: every value a pure function of its key, its sample and its position.

No state advances anywhere, so a value can be drawn again, in any order, in any process, on any
device, and come out the same. A draw is named by:

* a :class:`DrawKey` -- the job's seed, the step, the qualified name of the module drawing and
  that module's draw counter in the forward, and the stream (a draw that needs two uniforms per
  element, Box-Muller's, uses streams 0 and 1);
* per row, the *global* index of the sample the row belongs to (or none: a draw that is not
  batch-shaped, see ``services/compute/randomness/mode.py``);
* per element, its flat index within its row.

[Note: the hash] The scalar parts of the key are hashed once per draw in Python (BLAKE2b, 96
bits: three 32-bit words ``k1, k2, k3``; stable across processes, unlike ``hash()``). Each
sample index ``s`` is hashed once per forward, ``h = mix(mix(s_low) ^ s_high)``
(:func:`sample_hashes`); a draw's row word is ``a = (h * m mod 2**32) ^ k2`` with ``m`` the odd
multiplier ``k1 | 1``, and element ``e`` of the row is ``x = mix(mix(e * G) ^ a)``, where
``mix`` is Wellons' ``lowbias32`` (an invertible 32-bit mixer: xor-shifts and two odd
multiplies) and ``G`` the golden-ratio constant. Within a row, distinct elements are distinct
inputs to a bijection, so their values never collide; two draws give a sample the same row
word only if their 63 key bits agree. The inner ``mix(e * G)`` depends on the element only and
is cached per row length, so a draw costs three operations per row and one xor and one ``mix``
per element (13 int64 operations, in place). A float64 uniform takes a second word,
``mix(x ^ k3)``: 53 bits; float32 and narrower take ``x``'s top 24 bits. Values are in [0, 1).

Everything runs in int64 with every value below 2**32, and each multiply is by a constant
reduced to the signed range (|c| < 2**31, congruent to the odd constant mod 2**32), so no
product leaves int64 (|x * c| < 2**63) and ``& 0xFFFFFFFF`` of it is the exact product mod
2**32. The same functions take Python ints (the per-draw words) and tensors (rows, elements).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["DrawKey", "mix32", "sample_hashes", "uniform"]

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers

Int = TypeVar("Int", int, torch.Tensor)


def _signed(c: int) -> int:
    """``c`` (32 bits) as the congruent value of magnitude < 2**31: products with it fit in int64."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _mul32(x: Int, c: int) -> Int:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` without leaving int64."""
    return (x * _signed(c)) & M32


def mix32(x: Int) -> Int:
    """Wellons' lowbias32: a bijection of 32-bit values with strong avalanche (ints or int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` of an int64 tensor in place (``scratch``: a tensor of its shape to shift into)."""
    for shift, c in ((16, _C1), (15, _C2)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        x.bitwise_xor_(scratch).mul_(_signed(c)).bitwise_and_(M32)
    torch.bitwise_right_shift(x, 16, out=scratch)
    return x.bitwise_xor_(scratch)


@dataclass(frozen=True)
class DrawKey:
    """What names one draw, apart from its samples and elements (see the module docstring)."""

    seed: int
    step: int
    module: str  # the qualified name of the module drawing, in the user's model ("" for its root)
    counter: int  # the module's draws so far in this forward
    stream: int = 0
    batched: bool = True  # False: not batch-shaped, drawn without sample indices

    def words(self) -> tuple[int, int, int]:
        """The key hashed to three 32-bit words (BLAKE2b: stable across processes and versions)."""
        text = f"{self.seed}/{self.step}/{self.module}/{self.counter}/{self.stream}/{int(self.batched)}"
        digest = hashlib.blake2b(text.encode(), digest_size=12).digest()
        return tuple(int.from_bytes(digest[i:i + 4], "little") for i in (0, 4, 8))  # type: ignore[return-value]


def sample_hashes(samples: torch.Tensor) -> torch.Tensor:
    """Each sample index hashed to 32 bits (int64 tensor in, [rows, 1] int64 tensor out)."""
    samples = samples.to(torch.int64).reshape(-1, 1)
    return mix32(mix32(samples & M32) ^ ((samples >> 32) & M32))


_ELEMENTS: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()  # (row length, device) -> mix(e * G)
_ELEMENTS_KEPT = 8
_elements_lock = threading.Lock()


def _elements(n: int, device: torch.device) -> torch.Tensor:
    """``mix32(e * G)`` for ``e`` in ``range(n)`` as a [1, n] int64 tensor (the last few lengths cached)."""
    key = (n, str(device))
    with _elements_lock:
        cached = _ELEMENTS.get(key)
        if cached is not None:
            _ELEMENTS.move_to_end(key)
            return cached
    values = mix32(_mul32(torch.arange(n, dtype=torch.int64, device=device), GOLDEN)).unsqueeze(0)
    with _elements_lock:
        _ELEMENTS[key] = values
        while len(_ELEMENTS) > _ELEMENTS_KEPT:
            _ELEMENTS.popitem(last=False)
    return values


_NO_SAMPLE = torch.zeros(1, 1, dtype=torch.int64)  # the one row of a draw keyed without samples


def uniform(key: DrawKey, shape: torch.Size | tuple[int, ...], rows: torch.Tensor | None, *,
            double: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform values in [0, 1) of ``shape``: float64 (53 bits) if ``double``, else float32 (24 bits).

    Args:
        key: The draw's key.
        shape: The tensor's shape; its elements, in row-major order, split into ``len(rows)``
            equal rows, one per sample.
        rows: The rows' :func:`sample_hashes`; None: the whole tensor is one row keyed without a
            sample (``key.batched`` should then be False).
        double: 53-bit float64 values instead of 24-bit float32 ones.
        device: Where to compute (int64 arithmetic: every device gives the same values).

    Raises:
        ValueError: The elements do not split into ``len(rows)`` equal rows.
    """
    device = torch.device(device)
    numel = math.prod(shape)
    hashes = (rows if rows is not None else _NO_SAMPLE).to(device)
    count = int(hashes.shape[0])
    if numel % count:
        raise ValueError(f"a draw of shape {tuple(shape)} does not split into {count} rows, one per sample")
    k1, k2, k3 = key.words()
    x = _elements(numel // count, device) ^ (_mul32(hashes, k1 | 1) ^ k2)  # [rows, per row], mixed in place
    scratch = torch.empty_like(x)
    _mix32_(x, scratch)
    if double:
        second = _mix32_(torch.bitwise_xor(x, k3, out=scratch), torch.empty_like(x))
        x.bitwise_right_shift_(5).mul_(1 << 26).add_(second.bitwise_right_shift_(6))
        values = x.to(torch.float64).mul_(1.0 / (1 << 53))
    else:
        values = x.bitwise_right_shift_(8).to(torch.float32).mul_(1.0 / (1 << 24))
    return values.reshape(shape)
