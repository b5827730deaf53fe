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

__all__ = ["Packer", "ShardLayout", "Unpacker", "chunk_rows", "row_range", "rows_of"]


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
        self._cuts: dict[int, tuple[list[int], list[torch.Size]]] = {}  # rank -> segment_views' split, shapes

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
        cut = self._cuts.get(rank)
        if cut is None:  # the split sizes (each shard, then its padding) and the shards' shapes, once a rank
            shapes = [self.shard_shape(i, rank) for i in range(len(self._entries))]
            sizes = [n for e, s in zip(self._entries, shapes, strict=True)
                     for n in (s.numel(), e.chunk_numel - s.numel())]
            cut = self._cuts[rank] = (sizes, shapes)
        sizes, shapes = cut
        pieces = segment.view(-1).split_with_sizes(sizes)
        return [pieces[2 * i].view(shape) for i, shape in enumerate(shapes)]

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in the packed buffer: a ``(F, chunk_numel)`` strided view."""
        e = self._entries[i]
        return buffer.view(self.world, self.segment_numel)[:, e.offset:e.offset + e.chunk_numel]

    def pack_one(self, buffer: torch.Tensor, i: int, tensor: torch.Tensor | None) -> None:
        """Write parameter ``i`` (None: zeros) into its place in ``buffer``, padding with zeros."""
        e = self._entries[i]
        slot = self.slot(buffer, i)
        if tensor is None:
            slot.zero_()
            return
        self._pack_strided(slot, e, tensor)

    def _pack_strided(self, slot: torch.Tensor, e: _Entry, tensor: torch.Tensor) -> None:
        n = e.shape.numel()
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

    def slots(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every parameter's :meth:`slot` in the packed ``buffer``, made by one ``torch.split`` (one view per
        parameter in C++, not several in Python: [Note: an unpack without a view per parameter])."""
        if buffer.numel() != self.numel:
            raise ValueError(f"the packed buffer has {self.numel} elements, got {buffer.numel()}")
        return buffer.view(self.world, self.segment_numel).split_with_sizes(
            [e.chunk_numel for e in self._entries], dim=1)

    def pack_slot(self, slot: torch.Tensor, i: int, tensor: torch.Tensor | None) -> None:
        """:meth:`pack_one` into parameter ``i``'s slot of :meth:`slots` (one copy when its rows split
        evenly)."""
        e = self._entries[i]
        if tensor is None:
            slot.zero_()
        elif e.chunk_numel * self.world == e.shape.numel() and tensor.is_contiguous():
            slot.copy_(tensor.view(self.world, e.chunk_numel))
        else:
            self._pack_strided(slot, e, tensor)

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

    def unpacker(self, into: Sequence[torch.Tensor], *, skip: int | None = None) -> Unpacker | None:
        """An :class:`Unpacker` of packed buffers into ``into`` (every tensor contiguous, layout order), its
        views made once; None when some tensor of ``into`` is not contiguous (use :meth:`unpack`)."""
        if len(into) != len(self._entries):
            raise ValueError(f"the layout has {len(self._entries)} parameters, got {len(into)}")
        if not all(t.is_contiguous() for t in into):
            return None
        for i, t in enumerate(into):
            if t.shape != self._entries[i].shape:
                raise ValueError(f"parameter {i}: expected shape {tuple(self._entries[i].shape)}, got "
                                 f"{tuple(t.shape)}")
        ranks: list[tuple[int, list[int], list[int]]] = []
        dst: list[torch.Tensor] = []
        for rank in range(self.world):
            if rank == skip:
                continue
            sizes: list[int] = []
            take: list[int] = []
            for i, e in enumerate(self._entries):
                start, stop = self.rows(i, rank)
                n = (stop - start) * e.row_numel
                if n:
                    take.append(len(sizes))
                    dst.append(into[i].view(-1)[start * e.row_numel:stop * e.row_numel])
                sizes += [n, e.chunk_numel - n]
            if take:
                ranks.append((rank, sizes, take))
        return Unpacker(self.numel, self.world, ranks, dst)

    def packer(self, shards: Sequence[torch.Tensor], rank: int) -> Packer | None:
        """A :class:`Packer` of ``rank``'s ``shards`` (each shaped as :meth:`shard_shape`, contiguous) into
        its segment, their flat views made once; None when some shard is not contiguous."""
        if len(shards) != len(self._entries):
            raise ValueError(f"the layout has {len(self._entries)} parameters, got {len(shards)}")
        if not all(s.is_contiguous() for s in shards):
            return None
        sizes: list[int] = []
        take: list[int] = []
        flats: list[torch.Tensor] = []
        for i, (e, shard) in enumerate(zip(self._entries, shards, strict=True)):
            if shard.shape != self.shard_shape(i, rank):
                raise ValueError(f"parameter {i}: rank {rank}'s shard has shape "
                                 f"{tuple(self.shard_shape(i, rank))}, got {tuple(shard.shape)}")
            n = shard.numel()
            if n:
                take.append(len(sizes))
                flats.append(shard.view(-1))
            sizes += [n, e.chunk_numel - n]
        return Packer(self.segment_numel, sizes, take, flats)

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


class Unpacker:
    """:meth:`ShardLayout.unpack` into fixed contiguous tensors, its per-parameter views made once.

    [Note: an unpack without a view per parameter]
    On the GPT of ``bench/zero.py`` (102 parameter tensors, most of them small) ZeRO's copies were cheap and
    the views around them were not: unpacking its largest gather bucket (54 parameters) took 0.57 ms, of
    which the copies were 0.06; the rest was making several views per parameter in Python each step (one
    process, a loaded machine). Each view costs about a microsecond whether Python or C++ makes it, so
    the fix is to make fewer of them, and to make the ones that do not change once:

    * the unpack (:class:`Unpacker`): the destinations (each tensor's rows of each rank, a contiguous
      range of its memory) are made once; the sources are cut from each rank's segment of the buffer by
      one ``split_with_sizes`` (the parameters' chunks and their padding, in layout order), and one
      ``torch._foreach_copy_`` copies every pair: a few calls per bucket whatever its parameters;
    * the pack of this rank's shards into its segment (:class:`Packer`): the shards' flat views are made
      once, then one ``torch.cat`` (or a split and one ``_foreach_copy_`` when some chunk is padded);
    * ZeRO-2's pack of each gradient into a new bucket buffer (:meth:`ShardLayout.slots`): every
      parameter's slot made by one ``split_with_sizes`` when the buffer is, then one copy per gradient
      whose rows split evenly (``services/params/grad_sync.py``);
    * the all_reduce buckets' views, which ``param.grad`` points at, made once per bucket (``grad_sync``);
    * :meth:`ShardLayout.segment_views` (ZeRO-2's shards of each reduce-scattered bucket): one split of
      the segment and a view per shard, the sizes and shapes worked out once per rank.

    Measured alone on the GPT's 102 tensors (one process, a communicator that moves nothing, best of 30
    at load 7): the all-gather's pack and unpack 1.5 -> 0.5 ms a step; ZeRO-2's gradient hooks and
    ``finish`` 2.2 -> 1.5 ms (packing alone 1.2 -> 0.6 ms, its copies 0.37 ms); the all_reduce hooks of data
    parallelism and ZeRO-1 0.68 -> 0.44 ms.
    """

    def __init__(self, numel: int, world: int, ranks: list[tuple[int, list[int], list[int]]],
                 dst: list[torch.Tensor]) -> None:
        self._numel, self._world = numel, world
        self._ranks = ranks  # (rank, split sizes of its segment, the pieces that are rows)
        self._dst = dst

    def __call__(self, buffer: torch.Tensor) -> None:
        """Copy the rows of every rank but the skipped one from the packed ``buffer`` into the tensors."""
        if buffer.numel() != self._numel:
            raise ValueError(f"the packed buffer has {self._numel} elements, got {buffer.numel()}")
        if not self._dst:
            return
        segments = buffer.view(self._world, -1)
        src: list[torch.Tensor] = []
        for rank, sizes, take in self._ranks:
            pieces = segments[rank].split_with_sizes(sizes)
            src += [pieces[k] for k in take]
        torch._foreach_copy_(self._dst, src)


class Packer:
    """One rank's shards copied into its segment, their flat views made once ([Note: an unpack without a
    view per parameter]): one ``torch.cat`` when no shard is short of its chunk, else one ``torch.split``
    of the segment and one ``torch._foreach_copy_`` (the padding is left as it is: nothing reads it)."""

    def __init__(self, numel: int, sizes: list[int], take: list[int], flats: list[torch.Tensor]) -> None:
        self._numel = numel
        self._sizes, self._take, self._flats = sizes, take, flats
        self._whole = sum(s.numel() for s in flats) == numel  # no padding: the shards fill the segment

    def __call__(self, segment: torch.Tensor) -> None:
        if segment.numel() != self._numel:
            raise ValueError(f"a segment has {self._numel} elements, got {segment.numel()}")
        if not self._flats:
            return
        if self._whole:
            torch.cat(self._flats, out=segment.view(-1))
            return
        pieces = segment.view(-1).split_with_sizes(self._sizes)
        torch._foreach_copy_([pieces[k] for k in self._take], self._flats)
