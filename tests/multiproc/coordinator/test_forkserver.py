"""The fork server (coordinator/runtime/forkserver.py) starts what ``Popen(start_new_session=True)`` would.

One server for the module; each case forks children running ``forked_targets`` and checks what they
saw (their own environment, even what a module reads at import; working directory, session, threads,
stdin) and what the parent learns (pid, exit code, a signal's negative code, a wait that times out).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.runtime.forkserver import ForkServer
from tests.harness import commands

pytestmark = pytest.mark.timeout(120)
TARGETS = "tests.multiproc.coordinator.forked_targets"
ROOT = str(Path(__file__).resolve().parents[3])


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fork_server = ForkServer()
    try:
        yield fork_server
    finally:
        fork_server.close()


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ROOT, **extra}


def test_a_child_runs_in_its_own_environment_session_and_directory(server: ForkServer,
                                                                   tmp_path: Path) -> None:
    children = []
    for k, threads in ((0, 1), (3, 2)):
        log = tmp_path / f"child{k}.log"
        child = server.spawn(f"{TARGETS}:report", [str(k), "x"], log_path=str(log), cwd=str(tmp_path),
                             env=_env(FORKED_TARGET_VALUE=f"value-{k}", OMP_NUM_THREADS=str(threads)))
        children.append((child, log, k, threads))
    for child, log, k, threads in children:
        assert child.wait(30) == k and child.returncode == k and child.poll() == k
        seen = json.loads(log.read_text().splitlines()[-1])
        assert seen["argv"] == [str(k), "x"]
        assert seen["value"] == f"value-{k}"  # imported in the child, after its environment was set
        assert seen["cwd"] == str(tmp_path) and seen["pid"] == child.pid
        assert seen["sid"] == child.pid  # a session of its own, as start_new_session gives
        assert seen["threads"] == threads
        assert seen["stdin"] == ""  # /dev/null
        assert seen["frozen"] > 100_000  # the server's libraries: no collection of the child scans them
    assert children[0][0].pid != children[1][0].pid


def test_a_child_starts_with_the_signal_dispositions_of_a_fresh_interpreter(server: ForkServer,
                                                                           tmp_path: Path) -> None:
    """SIGPIPE above all: a fresh interpreter ignores it, so a write to a dead peer's socket is an error
    and not the worker's death (a forked worker once died of it when its replica was killed)."""
    log = tmp_path / "child.log"
    child = server.spawn(f"{TARGETS}:report", ["0"], log_path=str(log), env=_env())
    assert child.wait(30) == 0
    forked = json.loads(log.read_text().splitlines()[-1])["signals"]
    fresh = subprocess.run(
        [sys.executable, "-c", f"import json, {TARGETS} as t; print(json.dumps(t.signals()))"],
        env=_env(), capture_output=True, text=True, timeout=60, check=True)
    assert forked == json.loads(fresh.stdout), (forked, fresh.stdout)
    assert "SIG_IGN" in forked["SIGPIPE"]


def test_a_signal_ends_a_child_with_a_negative_code_and_wait_times_out_before(server: ForkServer,
                                                                             tmp_path: Path) -> None:
    child = server.spawn(f"{TARGETS}:sleep", ["60"], env=_env(), log_path=str(tmp_path / "sleep.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    child.kill()  # an ended child is left alone, as Popen leaves it


def test_a_failing_target_exits_1_with_its_traceback_in_the_log(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "fail.log"
    child = server.spawn(f"{TARGETS}:fail", ["a"], env=_env(), log_path=str(log))
    assert child.wait(30) == 1
    assert "ValueError: failing on purpose with ['a']" in log.read_text()
    missing = server.spawn("tests.no_such_module:run", [], env=_env(), log_path=str(tmp_path / "missing.log"))
    assert missing.wait(30) == 1
    assert "No module named 'tests.no_such_module'" in (tmp_path / "missing.log").read_text()


def test_a_bad_request_is_refused_and_the_server_keeps_forking(server: ForkServer, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="could not start"):
        server.spawn(f"{TARGETS}:report", ["0"], env=_env(), log_path=str(tmp_path / "nowhere" / "x.log"),
                     cwd=str(tmp_path / "no-such-directory"))
    with server._requests:  # garbage on the server's own pipe
        server._stdin.write(b"\xc1 not json\n")
        server._stdin.flush()
        assert "error" in server._next_reply(10, "the garbage's reply")
    child = server.spawn(f"{TARGETS}:report", ["5"], env=_env(), log_path=str(tmp_path / "after.log"))
    assert child.wait(30) == 5 and server.alive


def test_a_server_started_without_waiting_forks_once_ready_and_closes_at_once_before(tmp_path: Path) -> None:
    """``prestart``'s server: its imports run while the caller goes on; the first spawn waits for them, and
    one closed before it ever forked (a refused run) is killed, not waited for."""
    early = ForkServer(wait=False)
    try:
        started = time.monotonic()
        early.close()
        assert early._proc.poll() is not None and time.monotonic() - started < 5
    finally:
        early.close()
    server = ForkServer(wait=False)
    try:
        child = server.spawn(f"{TARGETS}:report", ["3"], env=_env(), log_path=str(tmp_path / "early.log"))
        assert child.wait(30) == 3
        server.wait_ready(0)  # ready: returns at once
    finally:
        server.close()


def test_a_server_forked_from_a_preloaded_process_forks_as_a_fresh_one(tmp_path: Path) -> None:
    """``fork_here`` (a ``cellmesh`` command the test harness forked, which has the libraries loaded): the
    server is a fork of that process, and its child is what a fresh server's would be (its own environment
    read at import, directory, session, threads, stdin); a process with a cellmesh module loaded, with a
    server already, or with a thread running is refused."""
    out = tmp_path / "probe.json"
    done = commands.run([sys.executable, "-m", "tests.multiproc.coordinator.fork_here_probe", str(out)],
                        env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    probe = json.loads(out.read_text())
    assert probe["server_parent"] == probe["me"]
    seen = probe["seen"]
    assert probe["code"] == 4 and seen["argv"] == ["4", "y"] and seen["value"] == "from-here"
    assert seen["cwd"] == str(tmp_path) and seen["sid"] == seen["pid"] and seen["threads"] == 2
    assert seen["stdin"] == ""
    modules, again, threads = probe["refused"]
    assert "services.probe_module" in modules and "already" in again and "thread(s)" in threads
