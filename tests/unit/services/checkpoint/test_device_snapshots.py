"""A GPU stage's checkpoint: the snapshot is in host memory, and it restores onto a GPU or the CPU alike."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from services.checkpoint import dcp
from services.checkpoint.stage_state import TRAIN, apply_optimizer_state, load_stage, snapshot
from services.checkpoint.writer import PartWriter, part_dirs
from services.compute.cell import Cell, cell_parameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
KEYS = {"a.weight": ["0.weight"], "a.bias": ["0.bias"]}


def _stage(seed: int, device: str) -> tuple[list[Cell], torch.optim.Optimizer]:
    torch.manual_seed(seed)
    cells = [Cell("a", nn.Linear(3, 2).double().to(device))]
    return cells, torch.optim.Adam([p for _, p in cell_parameters(cells)], lr=0.1)


def _train(cells: list[Cell], optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    device = cell_parameters(cells)[0][1].device
    for _ in range(steps):
        optimizer.zero_grad()
        cells[0](torch.randn(8, 3, generator=g, dtype=torch.float64).to(device)).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("onto", ["cuda:0", "cpu"])
def test_a_gpu_stages_snapshot_is_on_the_host_and_restores_onto_any_device(tmp_path: Path, onto: str) -> None:
    cells, optimizer = _stage(0, "cuda:0")
    _train(cells, optimizer, 3)
    params = cell_parameters(cells)
    snap = snapshot(3, "r0-s0", params, params, optimizer, KEYS)
    assert all(t.device.type == "cpu" for t in [*snap.model.values(), *snap.train.values()])
    writer = PartWriter()
    writer.submit(snap, tmp_path)
    [saved] = writer.flush(timedelta(seconds=30))
    assert not saved.error
    model_dir, train_dir = part_dirs(tmp_path, "r0-s0")
    dcp.merge_parts(tmp_path, [model_dir])
    dcp.merge_parts(tmp_path / TRAIN, [train_dir])
    other, other_opt = _stage(99, onto)
    restored = load_stage(tmp_path, "r0-s0", cell_parameters(other), cell_parameters(other), KEYS)
    apply_optimizer_state(other_opt, cell_parameters(other), restored)
    _train(cells, optimizer, 2)
    _train(other, other_opt, 2)
    for (name, a), (_, b) in zip(cell_parameters(cells), cell_parameters(other), strict=True):
        assert b.device == torch.device(onto)
        assert float((a.detach().cpu() - b.detach().cpu()).abs().max()) < 1e-12, name
