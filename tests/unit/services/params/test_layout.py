"""The dim-0 shard layout: chunks, packing rank-major, and the collectives' view of it."""

from __future__ import annotations

import pytest
import torch

from services.params.layout import ShardLayout, chunk_rows, row_range, rows_of

SHAPES = [(3, 2), (), (5,), (4, 3), (1, 7), (0, 2)]


def _tensors(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def test_rows_and_ranges_follow_ceil_division() -> None:
    assert rows_of(()) == 1 and rows_of((7, 3)) == 7
    assert chunk_rows(7, 4) == 2
    assert [row_range(7, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert [row_range(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    with pytest.raises(ValueError, match="outside"):
        row_range(3, 2, 2)


def test_worked_example_of_the_docstring() -> None:
    w = torch.arange(6, dtype=torch.float64).view(3, 2)
    b = torch.tensor(9.0, dtype=torch.float64)
    layout = ShardLayout([w.shape, b.shape], 2)
    assert layout.segment_numel == 5
    assert layout.pack([w, b]).tolist() == [0, 1, 2, 3, 9, 4, 5, 0, 0, 0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_pack_unpack_round_trip_and_segments_are_the_shards(world: int) -> None:
    tensors = _tensors(SHAPES)
    layout = ShardLayout([t.shape for t in tensors], world)
    packed = layout.pack(tensors)
    assert packed.numel() == world * layout.segment_numel
    for rank in range(world):
        segment = packed.view(world, -1)[rank]
        for i, view in enumerate(layout.segment_views(segment.clone(), rank)):
            assert torch.equal(view, layout.shard_of(tensors[i], i, rank))
    out = [torch.full_like(t, -1.0) for t in tensors]
    layout.unpack(packed, out)
    for t, o in zip(tensors, out, strict=True):
        assert torch.equal(t, o)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_unpack_skipping_a_rank_leaves_its_rows_and_writes_every_other(world: int) -> None:
    """A sharded step's gather: this rank's rows are current already, so unpack copies the others' only."""
    tensors = _tensors(SHAPES)
    layout = ShardLayout([t.shape for t in tensors], world)
    packed = layout.pack(tensors)
    for skip in range(world):
        out = [torch.full_like(t, -1.0) for t in tensors]
        layout.unpack(packed, out, skip=skip)
        for i, (t, o) in enumerate(zip(tensors, out, strict=True)):
            mine = layout.shard_of(o, i, skip)
            if layout.shard_of(t, i, skip).numel() and o.dim() and o.shape[0] > 1:  # a strided slot: skipped
                assert torch.equal(mine, torch.full_like(mine, -1.0)), (world, skip, i)
            for r in range(world):
                if r != skip:
                    got, want = layout.shard_of(o, i, r), layout.shard_of(t, i, r)
                    assert torch.equal(got, want), (world, skip, r, i)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_an_unpack_planned_once_copies_what_unpack_does_from_any_later_buffer(world: int) -> None:
    """A gather's copies worked out at its first step serve every later step's fresh buffer."""
    tensors = _tensors(SHAPES)
    layout = ShardLayout([t.shape for t in tensors], world)
    for skip in (None, *range(world)):
        planned = [torch.full_like(t, -1.0) for t in tensors]
        plan = layout.unpack_plan(planned, skip=skip)
        assert plan is not None
        for step in range(3):  # a new buffer, somewhere else in memory, each time
            step_tensors = [t + step for t in tensors]
            pad = torch.zeros(step + 1, dtype=torch.float64)
            packed = torch.cat([pad, layout.pack(step_tensors)])[step + 1:]  # offset in its storage
            plan.run(packed)
            for i, (got, ref) in enumerate(zip(planned, step_tensors, strict=True)):
                for r in range(world):  # every other rank's rows: this step's tensors
                    if r != skip:
                        same = torch.equal(layout.shard_of(got, i, r), layout.shard_of(ref, i, r))
                        assert same, (world, skip, step, i, r)
            want = [torch.full_like(t, -1.0) for t in tensors]  # and the skipped rows as unpack leaves them
            layout.unpack(packed, want, skip=skip)
            assert all(torch.equal(g, w) for g, w in zip(planned, want, strict=True)), (world, skip, step)
    assert layout.unpack_plan([torch.zeros(2, 3, dtype=torch.float64).t(), *tensors[1:]]) is None  # strided
    with pytest.raises(ValueError, match="contiguous elements"):
        plan.run(torch.zeros(layout.numel + 1, dtype=torch.float64))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_cover_each_parameter_once(world: int) -> None:
    for t in _tensors(SHAPES):
        layout = ShardLayout([t.shape], world)
        parts = [layout.shard_of(t, 0, r) for r in range(world)]
        whole = torch.cat([p.reshape(-1) for p in parts])
        assert torch.equal(whole, t.reshape(-1))


def test_reduce_scatter_of_packed_buffers_is_the_shard_of_the_sum() -> None:
    world = 3
    ranks = [_tensors(SHAPES) for _ in range(world)]
    for k, ts in enumerate(ranks):
        for t in ts:
            t.mul_(k + 1)
    layout = ShardLayout([t.shape for t in ranks[0]], world)
    total = sum(layout.pack(ts) for ts in ranks)
    assert isinstance(total, torch.Tensor)
    for rank in range(world):
        segment = total.view(world, -1)[rank].clone()  # what reduce_scatter leaves on rank
        for i, view in enumerate(layout.segment_views(segment, rank)):
            expected = layout.shard_of(sum(ts[i] for ts in ranks), i, rank)  # type: ignore[arg-type]
            assert torch.allclose(view, expected)


def test_shard_of_is_a_view_and_pack_pads_with_zeros() -> None:
    t = torch.zeros(5, 2)
    layout = ShardLayout([t.shape], 2)
    layout.shard_of(t, 0, 1).fill_(1.0)
    assert t[3:].sum() == 4 and t[:3].sum() == 0
    buffer = torch.full((layout.numel,), 7.0)
    layout.pack([t], out=buffer)
    assert buffer.view(2, -1)[1, 4:].eq(0).all()  # rows 3, 4 and one row of padding


def test_bad_input_names_what_is_wrong() -> None:
    layout = ShardLayout([(3, 2)], 2)
    with pytest.raises(ValueError, match="expected shape"):
        layout.shard_of(torch.zeros(2, 3), 0, 0)
    with pytest.raises(ValueError, match="1 parameters, got 2"):
        layout.pack([torch.zeros(3, 2), torch.zeros(1)])
    with pytest.raises(ValueError, match="segment has"):
        layout.segment_views(torch.zeros(3), 0)
