"""The runtime's bytes (``coordinator/planning/runtime_bytes.py``): measured in a fresh interpreter, 0 and
a warning naming the failure when the measurement fails, and counted once per worker by the planner."""

from __future__ import annotations

import logging

import pytest

from coordinator.planning import runtime_bytes
from coordinator.planning.config import PlanConfig
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources, Worker

MiB = 2**20


def test_a_fresh_interpreter_measures_the_runtime_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime_bytes.ENV, raising=False)  # the suite's conftest sets it once for the run
    monkeypatch.setattr(runtime_bytes, "_measured", None)
    monkeypatch.setattr(runtime_bytes, "_running", None)
    measured = runtime_bytes.runtime_bytes()
    # torch's autograd engine, the step thread, the optimizer's lazy imports: tens of MiB, not hundreds
    assert 4 * MiB < measured < 300 * MiB, measured
    assert runtime_bytes.runtime_bytes() == measured  # once per process


def test_the_environment_gives_the_runtime_bytes_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_bytes, "_measured", None)
    monkeypatch.setattr(runtime_bytes, "_running", None)
    monkeypatch.setattr(runtime_bytes, "RuntimeProbe", None)  # calling it would fail the test
    monkeypatch.setenv(runtime_bytes.ENV, "41943040")
    runtime_bytes.start()
    assert runtime_bytes.runtime_bytes() == 40 * MiB
    monkeypatch.setenv(runtime_bytes.ENV, "40 MiB")
    with pytest.raises(ValueError, match=r"CELLMESH_RUNTIME_BYTES='40 MiB' is not a byte count"):
        runtime_bytes.runtime_bytes()


def test_a_failed_measurement_counts_zero_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(runtime_bytes, "_SCRIPT", "import sys; sys.exit('no torch here')")
    with caplog.at_level(logging.WARNING, logger=runtime_bytes.__name__):
        assert runtime_bytes.RuntimeProbe().result() == 0
    assert "measuring the worker runtime's bytes failed (exit 1)" in caplog.text
    assert "no torch here" in caplog.text


def test_the_planner_counts_the_runtime_once_per_worker_against_its_memory() -> None:
    made = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, activation_bytes=[MiB] * 4,
                             cut_bytes=[MiB] * 3, microbatch_size=4)
    profile = made.model_copy(update={"runtime_bytes": 30 * MiB})
    request = PlanConfig(data_parallel=1, num_stages=4, schedule="interleaved-1f1b", chunks=2,
                         num_microbatches=2, balance=[1, 1, 1, 1])
    workers = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1 << 40) for i in range(2)))
    plan = choose_plan(profile, workers, request, global_batch=8)
    assert all(st.memory.runtime == 30 * MiB for st in plan.stages)
    rank, use = plan.fullest_memory()
    assert use.runtime == 30 * MiB  # two stages on the worker, one runtime
    stages = [st for st in plan.stages if st.index % 2 == rank]
    assert plan.peak_memory_bytes == sum(st.peak_memory_bytes for st in stages) - 30 * MiB
    # a worker whose memory the runtime fills leaves the stages nothing
    with pytest.raises(Exception, match="fits"):
        choose_plan(profile, Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=31 * MiB)
                                                     for i in range(2))), request, global_batch=8)
