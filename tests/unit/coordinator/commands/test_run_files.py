"""The run directory, the trace and the output options, without workers.

Covers coordinator/commands/{rundir,output,recorder}.py and coordinator/runtime/trace.py; the
files of a real local run are tests/multiproc/coordinator/test_run_outputs.py's.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from comm.logs import (
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    child_env,
    configure_logging,
    current_format,
    file_level,
    terminal_level,
)
from coordinator.commands.output import apply_logging, open_recorder
from coordinator.commands.recorder import open_tensorboard
from coordinator.commands.rundir import RunDir, RunRecord
from coordinator.planning.config import LoggingConfig
from coordinator.runtime.records import ActionEvent, StepRecord
from coordinator.runtime.trace import TraceRecorder, chrome_trace
from tests.harness.http import http_get

NOW = datetime(2026, 3, 1, 12, 30, 5)


def test_two_runs_in_the_same_second_get_two_directories(tmp_path: Path) -> None:
    first = RunDir.create("tiny", root=tmp_path / "out", now=NOW)
    second = RunDir.create("tiny", root=tmp_path / "out", now=NOW)
    assert first.path == tmp_path / "out" / "tiny-20260301-123005"
    assert second.path == tmp_path / "out" / "tiny-20260301-123005-2"
    for run in (first, second):
        assert run.workers.is_dir() and run.checkpoints.is_dir()
        assert (run.model.name, run.record.name, run.trace.name) == ("model.pt", "run.json", "trace.json")


def test_a_given_run_directory_is_used_as_is_and_a_bad_one_is_named(tmp_path: Path) -> None:
    given = RunDir.create("tiny", tmp_path / "mine")
    assert given.path == tmp_path / "mine" and given.workers.is_dir()
    assert RunDir.create("tiny", tmp_path / "mine").path == given.path  # a restarted coordinator's
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"cannot create the run directory .*file/run.*--run-dir"):
        RunDir.create("tiny", blocker / "run")


def test_the_record_round_trips(tmp_path: Path) -> None:
    run = RunDir.create("tiny", tmp_path / "run")
    record = RunRecord(job="tiny", phase="done", run_dir=str(run.path), step=3, steps=3, loss=0.5)
    run.write_record(record)
    assert RunRecord.model_validate_json(run.record.read_text()) == record
    assert not list(run.path.glob(".*.tmp"))


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The tests configure this process's logging; put back what pytest had."""
    root = logging.getLogger()
    handlers, level, fmt = list(root.handlers), root.level, current_format()
    yield
    configure_logging(fmt=fmt, stream=io.StringIO())
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restore_logging")
def test_the_logging_section_wins_over_the_environment_which_wins_over_the_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "ERROR")
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    apply_logging(LoggingConfig())  # the section leaves both to the environment
    assert (current_format(), file_level(), terminal_level()) == ("json", logging.ERROR, logging.ERROR)
    apply_logging(LoggingConfig(format="human", level="DEBUG"))  # a spec's or a flag's
    assert (current_format(), file_level(), terminal_level()) == ("human", logging.DEBUG, logging.DEBUG)
    assert child_env() == {LOG_FORMAT_ENV: "human", LOG_LEVEL_ENV: "DEBUG"}  # the workers log so too
    monkeypatch.delenv(LOG_LEVEL_ENV)
    monkeypatch.delenv(LOG_FORMAT_ENV)
    apply_logging(LoggingConfig())
    assert (current_format(), file_level(), terminal_level()) == ("human", logging.INFO, logging.WARNING)


@pytest.mark.usefixtures("restore_logging")
def test_the_recorder_uses_the_run_directory_and_metrics_port_of_the_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative run directory is relative to where cellmesh runs, as out/ is
    recorder = open_recorder("tiny", 3, LoggingConfig(run_dir="runs/mine", metrics_port=0))
    assert recorder.run_dir.path == Path("runs/mine") and (tmp_path / "runs" / "mine" / "workers").is_dir()
    with recorder:
        assert recorder.metrics_url is not None and recorder.metrics_url.startswith("http://127.0.0.1:")
        status, body = http_get(recorder.metrics_url + "/metrics")
        assert status == 200 and "cellmesh_steps 3.0" in body
    assert RunRecord.model_validate_json(recorder.run_dir.record.read_text()).phase == "failed"  # not done
    served_elsewhere = open_recorder("tiny", 3, LoggingConfig(metrics_port=0), serve_metrics=False)
    assert served_elsewhere.run_dir.path.parent == Path("out")
    assert served_elsewhere.run_dir.path.name.startswith("tiny-")
    with served_elsewhere:
        assert served_elsewhere.metrics_url is None


def test_tensorboard_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'cellmesh\[tensorboard\]'"):
        open_tensorboard(str(tmp_path))


def _record(step: int, stages: int = 2) -> StepRecord:
    record = StepRecord(step=step, loss=1.0 / (step + 1), num_samples=8, start=0.0, end=1.0,
                        coordinator_s=0.0)
    t = 1000.0 + step
    record._events = [ActionEvent(f"w{s}", 0, s, name, t + 0.01 * k, t + 0.01 * k + 0.005)
                      for s in range(stages) for k, name in enumerate(["F0", "B0", "optimizer"])]
    return record


def test_the_trace_has_one_complete_event_per_action() -> None:
    records = [_record(0), _record(1)]
    trace = chrome_trace(records)
    json.dumps(trace)  # plain JSON
    listed: list[dict[str, Any]] = trace["traceEvents"]  # type: ignore[assignment]
    events = [e for e in listed if e["ph"] == "X"]
    expected = [(r.step, e.stage, e.worker, e.name) for r in records for e in r.events]
    names = {(m["pid"], m["tid"]): m["args"]["name"] for m in listed if m["name"] == "thread_name"}
    assert [(e["args"]["step"], e["pid"], names[(e["pid"], e["tid"])].split()[0], e["name"])
            for e in events] == expected
    first = events[0]
    assert (first["ts"], first["dur"]) == (0.0, 5000.0)  # microseconds from the first event
    assert events[-1]["ts"] == pytest.approx(1_020_000.0)


def test_the_trace_keeps_the_first_and_last_steps() -> None:
    recorder = TraceRecorder(first=2, last=3)
    for k in range(10):
        recorder.add(_record(k, stages=1))
    assert [r.step for r in recorder.records] == [0, 1, 7, 8, 9]
    other = recorder.trace()["otherData"]
    assert other == {"steps_kept": [0, 1, 7, 8, 9], "steps_run": 10}
    short = TraceRecorder(first=2, last=3)
    for k in range(4):
        short.add(_record(k, stages=1))
    assert [r.step for r in short.records] == [0, 1, 2, 3]
