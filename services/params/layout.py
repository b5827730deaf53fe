"""How a sharded data-parallel group splits parameters: dim-0 chunks, packed rank-major.

Pure tensor code (no communication), shared by ZeRO-1/2 (:mod:`services.params.zero`) and any
sharding that needs the same layout.

[Note: the dim-0 layout]
Every parameter is cut on dim 0 into ``F`` chunks of ``c = ceil(rows / F)`` rows (FSDP2's
layout): rank ``i`` of a group of ``F`` holds rows ``[i*c, (i+1)*c)``, clipped to the parameter,
so the last ranks' chunks may be short or empty (a 0-dim parameter counts as one row). Because
a shard is a block of whole rows, the optimizer state of a shard is that of the parameter's rows
``[start, stop)``: it stays keyed by parameter name plus row offset, and a checkpoint written by
any plan loads into any other.

A bucket of parameters travels as one flat buffer of ``F * S`` elements, rank-major: segment
``r`` (``S`` elements) holds every parameter's chunk ``r`` padded to ``c * row_numel`` elements,
the parameters in bucket order. One ``reduce_scatter_tensor`` of that buffer leaves rank ``r``
with segment ``r`` reduced, and one ``all_gather_into_tensor`` of the segments rebuilds the
whole buffer (FSDP2's copy-in / copy-out). Padding is zeros and is never read back.

Worked example (``F = 2``): ``w`` of shape [3, 2] (c = 2 rows of 2) and a scalar ``b``
(one row, c = 1). Segment size S = 4 + 1 = 5; the buffer is
``[w00 w01 w10 w11 b | w20 w21 0 0 0]``; rank 0 holds ``w``'s rows [0, 2) and ``b``, rank 1
holds ``w``'s row [2, 3) and no part of ``b``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ShardLayout", "UnpackPlan", "chunk_rows", "row_range", "rows_of"]


def rows_of(shape: Sequence[int]) -> int:
    """A parameter's rows: its dim 0 (a 0-dim parameter counts as one row)."""
    return int(shape[0]) if len(shape) else 1


def chunk_rows(rows: int, world: int) -> int:
    """Rows per rank, ``ceil(rows / world)``."""
    if world < 1:
        raise ValueError(f"a group has at least one rank, got {world}")
    return -(-rows // world)


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` rank ``rank`` holds (``start == stop``: none)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    c = chunk_rows(rows, world)
    start = min(rank * c, rows)
    return start, min(start + c, rows)


@dataclass(frozen=True)
class UnpackPlan:
    """:meth:`ShardLayout.unpack_plan`: the copies of one unpack, for any packed buffer of ``numel``."""

    numel: int
    dst: list[torch.Tensor]
    places: list[tuple[tuple[int, ...], tuple[int, ...], int]]  # (size, stride, offset) in the buffer

    def run(self, buffer: torch.Tensor) -> None:
        """Copy out of ``buffer`` (contiguous, ``numel`` elements) into the destinations."""
        if buffer.numel() != self.numel or not buffer.is_contiguous():
            raise ValueError(f"the packed buffer has {self.numel} contiguous elements, got {buffer.numel()}")
        base = buffer.storage_offset()
        if self.dst:
            torch._foreach_copy_(self.dst, [buffer.as_strided(size, stride, base + offset)
                                            for size, stride, offset in self.places])


@dataclass(frozen=True)
class _Entry:
    shape: torch.Size
    rows: int
    row_numel: int
    chunk_numel: int  # padded elements per rank: chunk_rows * row_numel
    offset: int  # in a segment


class ShardLayout:
    """The dim-0 layout of a list of parameter shapes over a group of ``world`` ranks.

    Args:
        shapes: the parameters' shapes, in the order they are packed.
        world: the group size ``F``.

    Attributes:
        world: ``F``.
        segment_numel: ``S``, elements of one rank's segment.
        numel: ``F * S``, elements of the packed buffer.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], world: int) -> None:
        self.world = world
        entries, offset = [], 0
        for shape in shapes:
            size = torch.Size(shape)
            rows = rows_of(size)
            row_numel = size.numel() // rows if rows else int(torch.Size(size[1:]).numel())
            chunk = chunk_rows(rows, world) * row_numel
            entries.append(_Entry(size, rows, row_numel, chunk, offset))
            offset += chunk
        self._entries: list[_Entry] = entries
        self.segment_numel = offset
        self.numel = offset * world

    def __len__(self) -> int:
        return len(self._entries)

    def rows(self, i: int, rank: int) -> tuple[int, int]:
        """Parameter ``i``'s rows ``[start, stop)`` on ``rank``."""
        return row_range(self._entries[i].rows, self.world, rank)

    def shard_shape(self, i: int, rank: int) -> torch.Size:
        """The shape of parameter ``i``'s shard on ``rank``: ``(stop - start, *shape[1:])``."""
        e = self._entries[i]
        start, stop = self.rows(i, rank)
        return torch.Size((stop - start, *e.shape[1:]))

    def shard_of(self, full: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """``rank``'s rows of parameter ``i``: a view of ``full`` shaped as :meth:`shard_shape`."""
        e = self._entries[i]
        if full.shape != e.shape:
            raise ValueError(f"parameter {i}: expected shape {tuple(e.shape)}, got {tuple(full.shape)}")
        start, stop = self.rows(i, rank)
        return full.reshape(e.rows, e.row_numel)[start:stop].view(self.shard_shape(i, rank))

    def segment_views(self, segment: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views into one rank's segment (``S`` elements), one per parameter, shaped as its shard."""
        if segment.numel() != self.segment_numel:
            raise ValueError(f"a segment has {self.segment_numel} elements, got {segment.numel()}")
        flat = segment.view(-1)
        views = []
        for i, e in enumerate(self._entries):
            shape = self.shard_shape(i, rank)
            views.append(flat[e.offset:e.offset + shape.numel()].view(shape))
        return views

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in the packed buffer: a ``(F, chunk_numel)`` strided view."""
        e = self._entries[i]
        return buffer.view(self.world, self.segment_numel)[:, e.offset:e.offset + e.chunk_numel]

    def pack_one(self, buffer: torch.Tensor, i: int, tensor: torch.Tensor | None) -> None:
        """Write parameter ``i`` (None: zeros) into its place in ``buffer``, padding with zeros."""
        e = self._entries[i]
        n = e.shape.numel()
        if (tensor is not None and n and n == self.world * e.chunk_numel and buffer.is_contiguous()
                and tensor.is_contiguous()):  # rows split evenly: one strided copy, no padding to zero
            slot = buffer.as_strided((self.world, e.chunk_numel), (self.segment_numel, 1),
                                     buffer.storage_offset() + e.offset)
            slot.copy_(tensor.view(self.world, e.chunk_numel))
            return
        slot = self.slot(buffer, i)
        if tensor is None:
            slot.zero_()
            return
        flat = slot.reshape(-1) if slot.is_contiguous() else None
        if flat is not None:  # one rank, or a one-parameter bucket: the slot is the buffer itself
            flat[:n].copy_(tensor.reshape(-1))
            flat[n:].zero_()
            return
        full_rows = n // e.chunk_numel if e.chunk_numel else 0
        src = tensor.reshape(-1)
        if full_rows:
            slot[:full_rows].copy_(src[:full_rows * e.chunk_numel].view(full_rows, e.chunk_numel))
        rest = n - full_rows * e.chunk_numel
        if full_rows < self.world:
            slot[full_rows, :rest].copy_(src[full_rows * e.chunk_numel:])
            slot[full_rows, rest:].zero_()
            slot[full_rows + 1:].zero_()

    def pack(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor | None = None) -> torch.Tensor:
        """The packed buffer of ``tensors`` (full parameters, in layout order; None: zeros)."""
        if len(tensors) != len(self._entries):
            raise ValueError(f"the layout has {len(self._entries)} parameters, got {len(tensors)}")
        if out is None:
            first = next((t for t in tensors if t is not None), None)
            out = torch.empty(self.numel, dtype=first.dtype if first is not None else torch.float32,
                              device=first.device if first is not None else None)
        elif out.numel() != self.numel:
            raise ValueError(f"the packed buffer has {self.numel} elements, got {out.numel()}")
        for i, t in enumerate(tensors):
            self.pack_one(out, i, t)
        return out

    def unpack_one(self, buffer: torch.Tensor, i: int, into: torch.Tensor) -> None:
        """Copy parameter ``i`` from the packed ``buffer`` into ``into`` (its full shape)."""
        dst, src = self._unpack_pairs(buffer, i, into)
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    def _unpack_pairs(self, buffer: torch.Tensor, i: int, into: torch.Tensor, skip: int | None = None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The (destination, source) views that copy parameter ``i`` out of ``buffer``: each element
        copied once, straight from its strided slot (no contiguous copy of the slot first); the rows of
        rank ``skip`` (if given) left out."""
        e = self._entries[i]
        if into.shape != e.shape:
            raise ValueError(f"parameter {i}: expected shape {tuple(e.shape)}, got {tuple(into.shape)}")
        n = e.shape.numel()
        slot = self.slot(buffer, i)
        if not into.is_contiguous() or slot.is_contiguous() or not e.chunk_numel:
            return [into], [slot.reshape(-1)[:n].view(e.shape)]  # reshape copies a strided slot here only
        flat = into.view(-1)
        c = e.chunk_numel
        whole = n // c  # ranks whose chunk is whole; the next holds n - whole * c elements (or none)
        runs = [(0, whole)] if skip is None else [(0, min(skip, whole)), (skip + 1, whole)]
        dst = [flat[a * c:b * c].view(b - a, c) for a, b in runs if b > a]
        src = [slot[a:b] for a, b in runs if b > a]
        rest = n - whole * c
        if rest and whole != skip:  # the last rank holding rows holds fewer (its chunk's rest is padding)
            dst.append(flat[whole * c:])
            src.append(slot[whole, :rest])
        return dst, src

    def unpack_plan(self, into: Sequence[torch.Tensor], *, skip: int | None = None) -> UnpackPlan | None:
        """What :meth:`unpack` into ``into`` (with ``skip``) copies, worked out once for every buffer to come:
        the destination views and each source's place in a packed buffer (None: some of ``into`` is not
        contiguous, so the copies are not views of one buffer; unpack each time). Unpacking a bucket each
        step then makes one view per copy instead of several per parameter."""
        if len(into) != len(self._entries):
            raise ValueError(f"the layout has {len(self._entries)} parameters, got {len(into)}")
        if not into or any(not t.is_contiguous() for t in into):
            return None
        meta = torch.empty(self.numel, dtype=into[0].dtype, device="meta")  # geometry only
        dst: list[torch.Tensor] = []
        places: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        for i, t in enumerate(into):
            d, s = self._unpack_pairs(meta, i, t, skip)
            dst += d
            places += [(tuple(v.shape), v.stride(), int(v.storage_offset())) for v in s]
        return UnpackPlan(self.numel, dst, places)

    def unpack(self, buffer: torch.Tensor, into: Sequence[torch.Tensor], *, skip: int | None = None) -> None:
        """Copy every parameter from the packed ``buffer`` into ``into`` (full tensors, layout order):
        one strided copy per parameter (two when its rows do not split evenly), issued together.
        ``skip``: leave rank ``skip``'s rows of each as they are (a contiguous ``into`` whose slot is strided:
        they are current already, as after a sharded optimizer step)."""
        if len(into) != len(self._entries):
            raise ValueError(f"the layout has {len(self._entries)} parameters, got {len(into)}")
        if buffer.numel() != self.numel:
            raise ValueError(f"the packed buffer has {self.numel} elements, got {buffer.numel()}")
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, t in enumerate(into):
            d, s = self._unpack_pairs(buffer, i, t, skip)
            dst += d
            src += s
        if dst:
            torch._foreach_copy_(dst, src)
