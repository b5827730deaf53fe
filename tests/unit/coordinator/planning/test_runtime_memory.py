"""The runtime's bytes (``coordinator/planning/runtime_bytes.py``): measured in a fresh interpreter, 0 and
a warning naming the failure when the measurement fails, and counted once per worker by the planner."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

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


class _Probe:
    """A measuring interpreter's stand-in for the cache's tests (the real one is measured above): answers
    ``value`` and counts how often it was started."""

    started = 0
    value = 12 * MiB

    def __init__(self) -> None:
        type(self).started += 1

    def result(self, timeout_s: float = 0.0) -> int:
        return self.value


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has measured nothing, keeping measurements in ``tmp_path``; the probe stood in."""
    monkeypatch.delenv(runtime_bytes.ENV, raising=False)
    monkeypatch.setenv(runtime_bytes.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(runtime_bytes, "RuntimeProbe", _Probe)
    monkeypatch.setattr(_Probe, "started", 0)
    forget(monkeypatch)
    return tmp_path


def forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a new process: nothing measured, nothing running, no fingerprint yet."""
    for name in ("_measured", "_running", "_key"):
        monkeypatch.setattr(runtime_bytes, name, None)


def test_a_measurement_is_kept_and_a_new_process_reads_it_without_measuring(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime_bytes.runtime_bytes() == 12 * MiB and _Probe.started == 1
    kept = list(fresh.glob("runtime-bytes-*.json"))
    assert [p.name for p in kept] == [f"runtime-bytes-{runtime_bytes.fingerprint()}.json"]
    assert json.loads(kept[0].read_text())["bytes"] == 12 * MiB
    forget(monkeypatch)
    monkeypatch.setattr(_Probe, "value", 99 * MiB)  # a measurement now would answer otherwise
    runtime_bytes.start()
    assert runtime_bytes.runtime_bytes() == 12 * MiB and _Probe.started == 1  # read, not measured


def test_another_fingerprint_measures_again(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime_bytes.runtime_bytes() == 12 * MiB
    before = runtime_bytes.fingerprint()
    forget(monkeypatch)
    monkeypatch.setattr(runtime_bytes, "_SCRIPT", runtime_bytes._SCRIPT + "\n# another probe")
    monkeypatch.setattr(_Probe, "value", 13 * MiB)
    assert runtime_bytes.fingerprint() != before
    assert runtime_bytes.runtime_bytes() == 13 * MiB and _Probe.started == 2
    assert len(list(fresh.glob("runtime-bytes-*.json"))) == 2


def test_the_workers_code_is_in_the_fingerprint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(runtime_bytes, "_ROOT", tmp_path)
    before = runtime_bytes.fingerprint()
    (tmp_path / "comm" / "a.py").write_text("x = 2\n")
    assert runtime_bytes.fingerprint() != before


@pytest.mark.parametrize("broken", ["0", "not json", '{"bytes": "lots"}', '{"bytes": -5}', '{"bytes": true}',
                                    '{"bytes": 1e7}', "[]"])
def test_a_failed_or_broken_measurement_is_not_kept_nor_read(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                             broken: str) -> None:
    if broken == "0":  # a failed measurement counts 0 and leaves no file
        monkeypatch.setattr(_Probe, "value", 0)
        assert runtime_bytes.runtime_bytes() == 0
        assert not list(fresh.glob("runtime-bytes-*.json"))
        return
    (fresh / f"runtime-bytes-{runtime_bytes.fingerprint()}.json").write_text(broken)
    assert runtime_bytes.runtime_bytes() == 12 * MiB and _Probe.started == 1  # measured, and kept anew
    forget(monkeypatch)
    assert runtime_bytes.runtime_bytes() == 12 * MiB and _Probe.started == 1


def test_a_cache_that_cannot_be_written_or_is_off_keeps_nothing_and_fails_nothing(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = fresh / "file"
    blocker.write_text("")
    monkeypatch.setenv(runtime_bytes.CACHE_ENV, str(blocker / "cache"))  # under a file: no directory there
    assert runtime_bytes.runtime_bytes() == 12 * MiB
    forget(monkeypatch)
    monkeypatch.setenv(runtime_bytes.CACHE_ENV, "off")
    assert runtime_bytes.cache_dir() is None
    assert runtime_bytes.runtime_bytes() == 12 * MiB and _Probe.started == 2
    assert sorted(p.name for p in fresh.iterdir()) == ["file"]


def test_the_cache_follows_xdg_and_the_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(runtime_bytes.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime_bytes.cache_dir() == tmp_path / "cellmesh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime_bytes.cache_dir() == tmp_path / "home" / ".cache" / "cellmesh"


def test_the_cache_keeps_the_newest_measurements(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in range(runtime_bytes.KEPT + 3):  # older measurements, of other code: oldest first
        old = fresh / f"runtime-bytes-old{k:02d}.json"
        old.write_text('{"bytes": 1}')
        os.utime(old, (1_000_000 + k, 1_000_000 + k))
    assert runtime_bytes.runtime_bytes() == 12 * MiB
    left = sorted(p.name for p in fresh.glob("runtime-bytes-*.json"))
    assert len(left) == runtime_bytes.KEPT
    assert f"runtime-bytes-{runtime_bytes.fingerprint()}.json" in left  # the newest stays
    assert "runtime-bytes-old00.json" not in left and "runtime-bytes-old18.json" in left
