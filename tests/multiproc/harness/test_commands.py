"""A command forked by ``tests/harness/commands.py`` ends as the same command in a fresh interpreter does.

The reference is ``subprocess.run`` of ``python -m`` on the same probe, with the same arguments,
environment and working directory: the same exit code, stdout and stderr (a traceback's last line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import commands

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
PROBE = "tests.multiproc.harness.command_probe"


Done = subprocess.CompletedProcess[str]


def _both(mode: str, tmp_path: Path) -> tuple[Done, Done]:
    extra = tmp_path / "extra"
    extra.mkdir(exist_ok=True)
    env = {**os.environ, "PROBE": "given", "PROBE_DIR": str(extra),
           "PYTHONPATH": os.pathsep.join([str(extra), str(ROOT)])}
    argv = [sys.executable, "-m", PROBE, mode, "--flag"]
    fresh = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                           check=False)
    forked = commands.run(argv, cwd=tmp_path, env=env, timeout=60)
    return fresh, forked


@pytest.mark.parametrize("mode", ["ok", "exit-3", "exit-message"])
def test_a_forked_command_ends_as_a_fresh_interpreter_does(mode: str, tmp_path: Path) -> None:
    fresh, forked = _both(mode, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {"ok": 0, "exit-3": 3, "exit-message": 1}[mode]
    assert '"name": "__main__"' in forked.stdout and '"probe": "given"' in forked.stdout
    assert '"on_path": true' in forked.stdout and forked.stdout.endswith("atexit ran\n")


def test_an_exception_exits_1_with_its_traceback(tmp_path: Path) -> None:
    fresh, forked = _both("raise", tmp_path)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stdout == fresh.stdout
    last = [err.strip().splitlines()[-1] for err in (fresh.stderr, forked.stderr)]
    assert last[0] == last[1] == "RuntimeError: the probe raised"
    assert forked.stderr.startswith("to stderr\nTraceback (most recent call last):")


def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        commands.run([sys.executable, "-m", PROBE, "sleep"], cwd=tmp_path, timeout=3)
    assert time.monotonic() - started < 20
    assert "to stderr" in str(raised.value.stderr)


def test_a_started_command_is_signalled_and_reaped_as_popen_would_be(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = commands.start([sys.executable, "-m", PROBE, "sleep"], cwd=tmp_path, stdout=out,
                          stderr=commands.STDOUT, new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "to stderr" not in (out.read_text() if out.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert os.getpgid(proc.pid) == proc.pid  # a session and group of its own
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == -signal.SIGTERM
    finally:
        proc.stop()
