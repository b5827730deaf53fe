"""Where an evaluation shows: the progress lines and bar, the run record, the Prometheus gauges."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from coordinator.commands.metrics import RunMetrics
from coordinator.commands.progress import BarProgress, LineProgress
from coordinator.commands.recorder import RunRecorder
from coordinator.commands.rundir import RunDir, RunRecord
from coordinator.runtime.records import EvalRecord, StepRecord


def _record(step: int, evaluated: EvalRecord | None = None) -> StepRecord:
    return StepRecord(step=step, loss=0.5, num_samples=8, start=float(step), end=step + 1.0,
                      coordinator_s=0.0, eval=evaluated)


def test_lines_show_each_evaluation_after_its_step() -> None:
    out = io.StringIO()
    progress = LineProgress(4, out, every=4)
    progress.update(_record(0))
    progress.update(_record(1, EvalRecord(step=2, loss=1.23456, metric=0.5, num_samples=37, seconds=0.25)))
    progress.update(_record(2))
    progress.update(_record(3, EvalRecord(step=4, loss=0.75, metric=None, num_samples=37)))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/4  loss 0.5000")
    assert lines[1] == "eval after step 2/4  loss 1.2346  metric 0.5000  (37 samples, 0.2s)"
    assert lines[2].startswith("step 4/4  loss 0.5000")
    assert lines[3] == "eval after step 4/4  loss 0.7500  (37 samples, 0.0s)"
    assert len(lines) == 4


def test_the_bar_keeps_the_last_evaluation_in_its_postfix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # a terminal wide enough for the postfix (a narrow one cuts it)
    out = io.StringIO()
    bar = BarProgress(3, out)
    bar.update(_record(0, EvalRecord(step=1, loss=1.5, metric=0.25, num_samples=4)))
    bar.update(_record(1))
    bar.close()
    assert "eval 1.5000  metric 0.2500" in out.getvalue().splitlines()[-1].split("\r")[-1]


def test_the_gauges_show_the_last_evaluation_once_there_is_one() -> None:
    metrics = RunMetrics()
    metrics.observe(_record(0))
    assert "cellmesh_eval" not in generate_latest(metrics.registry).decode()  # a job that evaluates nothing
    metrics.observe(_record(1, EvalRecord(step=2, loss=1.5, metric=0.25, num_samples=4)))
    metrics.observe(_record(2, EvalRecord(step=3, loss=1.25, metric=None, num_samples=4)))
    body = generate_latest(metrics.registry).decode()
    assert "\ncellmesh_eval_loss 1.25\n" in body and "\ncellmesh_eval_step 3.0\n" in body
    assert "\ncellmesh_eval_metric 0.25\n" in body  # the last metric reported


def test_the_run_record_keeps_every_evaluation_and_a_replayed_one_replaces_the_later(tmp_path: Path) -> None:
    run_dir = RunDir.create("job", tmp_path / "run")
    with RunRecorder(run_dir, job="job", steps=6) as recorder:
        recorder.on_step(_record(1, EvalRecord(step=2, loss=3.0, metric=1.0, num_samples=5)))
        recorder.on_step(_record(3, EvalRecord(step=4, loss=2.0, metric=0.5, num_samples=5)))
        # a lost worker: training went back to the checkpoint of step 2 and evaluates step 4 again
        recorder.on_step(_record(3, EvalRecord(step=4, loss=2.5, metric=0.75, num_samples=5)))
        recorder.on_step(_record(5, EvalRecord(step=6, loss=1.0, metric=None, num_samples=5)))
        recorder.update(phase="done")
    record = RunRecord.model_validate_json(run_dir.record.read_text())
    assert [(e.step, e.loss, e.metric, e.num_samples) for e in record.evals] == [
        (2, 3.0, 1.0, 5), (4, 2.5, 0.75, 5), (6, 1.0, None, 5)]
