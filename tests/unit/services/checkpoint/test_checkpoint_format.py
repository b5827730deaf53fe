"""The checkpoint format: DCP parts merged into one checkpoint torch reads; stages restored exactly."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from services import faults
from services.checkpoint import dcp
from services.checkpoint.stage_state import TRAIN, apply_optimizer_state, load_stage, snapshot
from services.checkpoint.writer import PartWriter, part_dirs
from services.compute.cell import Cell, cell_parameters


class Tied(nn.Module):
    """Two layers and a head sharing the embedding's weight (two state_dict keys, one tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mid = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight


def _parts(model: nn.Module, root: Path) -> list[Path]:
    """Write the model's state_dict as two parts (split by key), as two services would."""
    state = model.state_dict()
    keys = sorted(state)
    parts = []
    for i, chunk in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        directory = root / "parts" / f"p{i}"
        dcp.save_part({k: state[k] for k in chunk}, directory)
        parts.append(directory)
    return parts


def test_merged_parts_are_one_checkpoint_torch_reads_strictly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied().double()
    staging = tmp_path / ".staging"
    dcp.merge_parts(staging, _parts(model, staging))
    final = tmp_path / "step-1"
    dcp.publish(staging, final)
    assert not staging.exists()
    dcp_to_torch_save(final, tmp_path / "plain.pt")
    fresh = Tied().double()
    fresh.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True), strict=True)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert fresh.head.weight is fresh.embed.weight
    # any subset loads by name, whatever part it was written by
    got = dcp.load(final, ["head.weight", "mid.1.running_var"])
    assert torch.equal(got["head.weight"], model.embed.weight.detach())


def test_incomplete_and_foreign_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    model = Tied().double()
    staging = tmp_path / "c"
    parts = _parts(model, staging)
    with pytest.raises(dcp.CheckpointFormatError, match=r"no \.metadata"):
        dcp.keys(staging)  # written but never merged: not a checkpoint yet
    dcp.merge_parts(staging, parts)
    with pytest.raises(dcp.CheckpointFormatError, match=r"no tensor \['other.weight'\]"):
        dcp.load(staging, ["other.weight"])
    with pytest.raises(dcp.CheckpointFormatError, match="in two parts"):
        dcp.merge_parts(staging, [parts[0], parts[0]])


def test_publishing_an_existing_step_keeps_the_published_one(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("first")
    dcp.publish(tmp_path / "a", tmp_path / "step")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("second")
    dcp.publish(tmp_path / "b", tmp_path / "step")
    assert (tmp_path / "step" / "x").read_text() == "first" and not (tmp_path / "b").exists()


def _stage(seed: int) -> tuple[list[Cell], torch.optim.Optimizer]:
    torch.manual_seed(seed)
    cells = [Cell("a", nn.Linear(3, 4)), Cell("b", nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)))]
    for c in cells:
        c.double()
    params = [p for _, p in cell_parameters(cells)]
    return cells, torch.optim.Adam(params, lr=0.01)


def _train(cells: list[Cell], optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(*cells)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        model(x).pow(2).mean().backward()
        optimizer.step()


def _state(cells: list[Cell]) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = list(cell_parameters(cells))
    out += [(f"{c.name}.{n}", b) for c in cells for n, b in c.module.named_buffers()]
    return out


@pytest.mark.parametrize("optimizer_state", [True, False])
def test_a_stage_restored_from_its_snapshot_trains_on_exactly(tmp_path: Path, optimizer_state: bool) -> None:
    """Save after 3 steps, restore into a stage built from other values, train 3 more: equal to 6 straight."""
    keys = {"a.weight": ["0.weight"], "a.bias": ["0.bias"], "b.0.weight": ["1.0.weight"],
            "b.0.bias": ["1.0.bias"], "b.1.weight": ["1.1.weight"], "b.1.bias": ["1.1.bias"],
            "b.1.running_mean": ["1.1.running_mean"], "b.1.running_var": ["1.1.running_var"],
            "b.1.num_batches_tracked": ["1.1.num_batches_tracked"]}
    cells, optimizer = _stage(0)
    _train(cells, optimizer, 3, seed=1)
    snap = snapshot(3, "r0-s0", _state(cells), cell_parameters(cells), optimizer if optimizer_state else None,
                    keys)
    writer = PartWriter()
    writer.submit(snap, tmp_path)
    [saved] = writer.flush(timedelta(seconds=30))
    assert saved.step == 3 and saved.part == "r0-s0" and not saved.error
    model_dir, train_dir = part_dirs(tmp_path, "r0-s0")
    dcp.merge_parts(tmp_path, [model_dir])
    dcp.merge_parts(tmp_path / TRAIN, [train_dir])
    _train(cells, optimizer, 3, seed=2)

    other, other_opt = _stage(99)
    restored = load_stage(tmp_path, "r0-s0", _state(other), cell_parameters(other), keys)
    apply_optimizer_state(other_opt, cell_parameters(other), restored)
    _train(other, other_opt, 3, seed=2)
    same = [torch.equal(a, b) for (_, a), (_, b) in zip(_state(cells), _state(other), strict=True)]
    if optimizer_state:
        assert all(same), [n for (n, _), ok in zip(_state(cells), same, strict=True) if not ok]
    else:  # without the moments Adam takes other steps: the comparison can tell
        assert not all(same)


def test_a_failed_write_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    snap = snapshot(1, "r0-s0", [("a.w", torch.ones(2))], [], None, {})
    writer = PartWriter()
    writer.submit(snap, blocker)
    [saved] = writer.flush(timedelta(seconds=30))
    assert saved.error and saved.part == "r0-s0", saved


def test_fault_specs_parse_and_refuse_by_name() -> None:
    spec = faults.parse("3:backward:stop")
    assert (spec.step, spec.phase, spec.action) == (3, "backward", "stop")
    assert faults.parse("0:save").action == "kill"
    bad_specs = [("x:forward", "STEP:PHASE"), ("3:lunch", "phase 'lunch'"), ("3:step:explode", "action")]
    for bad, match in bad_specs:
        with pytest.raises(ValueError, match=match):
            faults.parse(bad)
    assert os.environ.get(faults.ENV) is None
    faults.at(3, "backward")  # no fault configured in this process: returns


def test_the_replicas_of_a_stage_write_disjoint_shares_that_make_up_the_whole(tmp_path: Path) -> None:
    """Two replicas write every other tensor (and its optimizer state); merged, the model is whole, and a
    non-persistent buffer (not in the model's state_dict) is in no part."""
    cells, optimizer = _stage(0)
    cells[0].module.register_buffer("scratch", torch.zeros(2), persistent=False)
    _train(cells, optimizer, 2, seed=1)
    model = nn.Sequential(*cells)
    keys = {f"{c.name}.{n}": [f"{i}.module.{n}"] for i, c in enumerate(cells)
            for n, _ in [*c.module.named_parameters(), *c.module.named_buffers()] if n != "scratch"}
    writer = PartWriter()
    for r in range(2):
        writer.submit(snapshot(2, f"r{r}-s0", _state(cells), cell_parameters(cells), optimizer, keys,
                               share=(r, 2)), tmp_path)
    saved = writer.flush(timedelta(seconds=30))
    assert [p.model for p in saved] == [True, True]
    dcp.merge_parts(tmp_path, [part_dirs(tmp_path, f"r{r}-s0")[0] for r in range(2)])
    dcp.merge_parts(tmp_path / TRAIN, [part_dirs(tmp_path, f"r{r}-s0")[1] for r in range(2)])
    shares = [set(dcp.keys(part_dirs(tmp_path, f"r{r}-s0")[0])) for r in range(2)]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(model.state_dict()) == set(dcp.keys(tmp_path))
    optim = {k for k in dcp.keys(tmp_path / TRAIN) if k.startswith("optim.")}
    assert optim == {f"optim.{keys[n][0]}.{e}" for n, _ in cell_parameters(cells)
                     for e in ("step", "exp_avg", "exp_avg_sq")}
