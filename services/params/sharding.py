"""How a parameter set is split: across parameter shards by byte size, and into wire pieces.

Two pure layers, both deterministic:

* :func:`plan_shards` places whole parameters on ``num_shards`` shards, balanced by
  bytes: greedy largest-first (LPT), each parameter to the currently lightest shard, ties
  broken by name and then by the lower shard index. Every client recomputes the same
  plan from the same sizes.
* :func:`group_parts` groups consecutive whole parameters into parts of about
  :data:`PART_BYTES`, the unit of a pipelined push or pull (one message per part), so a
  receiver works on early parts while later ones are on the wire.
* :func:`split_pieces` / :func:`join_pieces` cut a parameter's flat storage into pieces
  of at most one frame (:data:`comm.sockets.CHUNK_BYTES`), named ``"{param}#{k}"``. The
  RPC layer decodes a one-frame tensor as a zero-copy view of the received frame, so a
  receiver copies (or adds) every piece straight into its destination: no temporary
  tensor is allocated and nothing is copied twice.

Worked example (float32, 1 MiB frames hold E = 262144 elements): a parameter ``w`` of
shape [1024, 600] has 614400 elements and travels as ``w#0`` = elements [0, 262144),
``w#1`` = [262144, 524288), ``w#2`` = [524288, 614400). A zero-element parameter is one
empty piece ``w#0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from comm.sockets import CHUNK_BYTES

__all__ = [
    "PART_BYTES",
    "PIECE_SEP",
    "ShardPlan",
    "check_pieces",
    "group_parts",
    "join_pieces",
    "piece_slices",
    "plan_shards",
    "split_pieces",
]

PIECE_SEP = "#"
PART_BYTES = 4 << 20  # a pipelined push/pull sends about this much per message


@dataclass(frozen=True)
class ShardPlan:
    """Which shard holds which parameter.

    Attributes:
        shards: per shard, its parameter names in the order of the input mapping.
        loads: per shard, the bytes it holds.
    """

    shards: tuple[tuple[str, ...], ...]
    loads: tuple[int, ...]

    def owner(self, name: str) -> int:
        """The index of the shard holding ``name``; KeyError if no shard does."""
        for index, names in enumerate(self.shards):
            if name in names:
                return index
        raise KeyError(f"parameter {name!r} is in no shard of the plan")


def plan_shards(sizes: Mapping[str, int], num_shards: int) -> ShardPlan:
    """Balance parameters of ``sizes`` (name -> bytes) over ``num_shards`` shards, largest first.

    A parameter is never split, so one parameter larger than the average share makes the
    plan uneven (its shard holds just it). Shards may stay empty when there are fewer
    parameters than shards.

    Raises:
        ValueError: ``num_shards`` < 1 or a negative size.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    bad = {name: size for name, size in sizes.items() if size < 0}
    if bad:
        raise ValueError(f"negative parameter sizes: {bad}")
    loads = [0] * num_shards
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(num_shards), key=lambda i: (loads[i], i))
        owner[name] = target
        loads[target] += sizes[name]
    shards = tuple(tuple(n for n in sizes if owner[n] == i) for i in range(num_shards))
    return ShardPlan(shards=shards, loads=tuple(loads))


def group_parts(sizes: Mapping[str, int], limit: int = PART_BYTES) -> list[list[str]]:
    """Consecutive names of ``sizes`` (name -> bytes) in groups of at most ``limit`` bytes.

    A parameter larger than ``limit`` is a group of its own; an empty mapping gives no group.
    """
    groups: list[list[str]] = []
    load = 0
    for name, size in sizes.items():
        if not groups or load + size > limit:
            groups.append([])
            load = 0
        groups[-1].append(name)
        load += size
    return groups


def piece_slices(numel: int, dtype: torch.dtype) -> list[slice]:
    """The element ranges of a ``numel``-element ``dtype`` parameter's pieces, in order."""
    per_piece = max(1, CHUNK_BYTES // dtype.itemsize)
    return [slice(o, min(o + per_piece, numel)) for o in range(0, numel, per_piece)] or [slice(0, 0)]


def split_pieces(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``tensor``'s flat storage as named pieces of at most one frame each (views, not copies).

    A non-contiguous tensor is copied once into a contiguous one first.
    """
    flat = tensor.detach().reshape(-1)
    return [(f"{name}{PIECE_SEP}{k}", flat[s]) for k, s in enumerate(piece_slices(flat.numel(), flat.dtype))]


def join_pieces(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
    """Group received pieces by parameter: ``{param: {k: piece}}`` (completeness is checked later).

    Raises:
        ValueError: a tensor name is not ``"{param}#{k}"`` with a decimal ``k``.
    """
    out: dict[str, dict[int, torch.Tensor]] = {}
    for piece_name, piece in tensors.items():
        name, sep, index = piece_name.rpartition(PIECE_SEP)
        if not sep or not name or not index.isdigit() or (len(index) > 1 and index[0] == "0"):
            raise ValueError(f"tensor {piece_name!r} is not a parameter piece named '<param>{PIECE_SEP}<k>'")
        out.setdefault(name, {})[int(index)] = piece
    return out


def check_pieces(name: str, pieces: Mapping[int, torch.Tensor], numel: int,
                 dtype: torch.dtype) -> list[tuple[slice, torch.Tensor]]:
    """Pair each expected element range of ``name`` with its received piece.

    Raises:
        ValueError: a piece is missing, extra, of the wrong dtype or of the wrong length.
    """
    slices = piece_slices(numel, dtype)
    if sorted(pieces) != list(range(len(slices))):
        raise ValueError(f"parameter {name!r}: expected pieces 0..{len(slices) - 1} ({numel} elements of "
                         f"{dtype}), got {sorted(pieces)[:8]}")
    out: list[tuple[slice, torch.Tensor]] = []
    for k, s in enumerate(slices):
        piece = pieces[k]
        if piece.dtype != dtype or piece.dim() != 1 or piece.numel() != s.stop - s.start:
            raise ValueError(f"parameter {name!r} piece {k}: expected {dtype}[{s.stop - s.start}], got "
                             f"{piece.dtype}{list(piece.shape)}")
        out.append((s, piece))
    return out
