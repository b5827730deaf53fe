"""The suite's own timeouts ([Note: a stuck test ends, and says where] in tests/conftest.py): a test
stuck in Python fails alone; a test stuck in C for good ends its worker with every thread's stack
shown, and the run stops naming it, instead of waiting for CI's limit."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUCK = textwrap.dedent("""
    import ctypes
    import time

    def test_first():
        pass

    def test_stuck_in_python():
        time.sleep(60)

    def test_stuck_in_c():
        libc = ctypes.PyDLL(None)  # holds the GIL: no signal handler can run while it waits
        mutex = ctypes.create_string_buffer(64)  # a zeroed pthread_mutex_t is a default mutex
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # waits for itself, for good
""")


def test_the_suite_runs_with_the_signal_method_and_a_backstop_past_every_timeout(
        pytestconfig: pytest.Config) -> None:
    assert pytestconfig.getini("timeout_method") == "signal"
    assert pytestconfig.getini("faulthandler_exit_on_timeout") is True
    backstop = float(pytestconfig.getini("faulthandler_timeout"))
    timeouts = [float(pytestconfig.getini("timeout"))]
    for path in (ROOT / "tests").rglob("test_*.py"):
        timeouts += [float(n) for n in re.findall(r"mark\.timeout\((\d+(?:\.\d+)?)", path.read_text())]
    assert backstop > max(timeouts), (backstop, max(timeouts))
    assert "--max-worker-restart 0" in (ROOT / "Makefile").read_text()


@pytest.mark.timeout(90)
def test_a_stuck_test_fails_alone_or_stops_the_run_naming_itself(tmp_path: Path) -> None:
    (tmp_path / "test_stuck.py").write_text(STUCK)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
         "--max-worker-restart", "0", "-o", "timeout=2", "-o", "timeout_method=signal",
         "-o", "faulthandler_timeout=5", "-o", "faulthandler_exit_on_timeout=true",
         "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=80, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "FAILED test_stuck.py::test_stuck_in_python" in out, out[-3000:]
    assert "E       Failed: Timeout (>2.0s) from pytest-timeout." in out, out[-3000:]
    assert "crashed while running 'test_stuck.py::test_stuck_in_c'" in out, out[-3000:]
    assert "Timeout (0:00:05)!" in out  # faulthandler's dump, with the stuck line in it
    assert re.search(r'test_stuck\.py", line \d+ in test_stuck_in_c', out), out[-3000:]
