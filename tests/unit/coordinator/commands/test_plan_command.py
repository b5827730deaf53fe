"""``cellmesh plan``: the plan and its predicted step printed, the timeline drawn, no worker started.

Covers coordinator/commands/plan.py and the matplotlib path of draw_timeline
(coordinator/planning/timeline_plot.py); the PNG test is skipped when matplotlib (the
``plot`` extra) is not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from coordinator.commands import cli
from coordinator.planning.schedules import build_schedule

M = "tests.multiproc.coordinator.models"
SPEC = {"version": 2, "model": {"factory": f"{M}:mlp"},
        "data": {"factory": f"{M}:regression", "global_batch": 16}, "loss": {"factory": f"{M}:mse"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}}}
ARGS = ["--workers", "2", "--stages", "2", "--microbatches", "4", "--schedule", "1f1b"]


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(SPEC))
    return path


def test_plan_prints_the_plan_and_draws_every_predicted_action(spec: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "timeline.svg"
    assert cli.main(["plan", str(spec), *ARGS, "--timeline", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "plan: 1 replica(s) x 2 stage(s) = 2 worker(s), 1f1b, 4 microbatches" in out
    assert "1f1b: step " in out and f"predicted timeline written to {svg}" in out
    titles = [t.text or "" for t in ElementTree.parse(svg).iter("{http://www.w3.org/2000/svg}title")]
    drawn = sorted(t.split()[0] for t in titles)  # one box per action, titled with its printed name
    assert drawn == sorted(str(a) for acts in build_schedule("1f1b", 2, 4).actions for a in acts)
    assert not (tmp_path / "out").exists()  # no run directory: nothing ran


def test_a_png_timeline_without_matplotlib_names_the_extra_before_planning(
        spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert cli.main(["plan", str(spec), *ARGS, "--timeline", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert "pip install 'cellmesh[plot]'" in captured.err
    assert "plan:" not in captured.out  # refused before the profiling


def test_plan_draws_a_png_with_matplotlib(spec: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the PNG timeline needs the optional extra cellmesh[plot]")
    png = tmp_path / "timeline.png"
    assert cli.main(["plan", str(spec), *ARGS, "--timeline", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
