"""Session-wide test plumbing: GPU gating, the runtime's bytes measured once, the root logger restored
after each test, the cleanup of stray rank processes.

[Note: a stuck test ends, and says where]
A test that runs past ``timeout`` (pyproject.toml) is failed by pytest-timeout's ``signal`` method: it
raises in the main thread, so the test fails alone, with the traceback of where it waited, and its
worker goes on. The ``thread`` method ends the whole worker with ``os._exit`` instead, and
pytest-xdist 3.8 cannot always hand a crashed worker's files to its replacement under ``--dist
loadfile``: once it gave the new worker a finished file as an empty batch, and the run waited for
it until CI's limit.

A signal is handled only once the main thread is back in Python: a test stuck in C for good is not
ended by it. ``faulthandler_timeout`` with ``faulthandler_exit_on_timeout`` is the backstop, past every
test's own timeout: faulthandler's own C thread writes every thread's stack to the worker's stderr
(which reaches the run's output) and ends the process. ``make test`` passes ``--max-worker-restart
0``, so such a crash stops the run at once, naming the test, instead of risking the re-queue above.
``tests/unit/test_suite_timeouts.py`` checks both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from tests.harness.profiles import ProfileMemo

# Property tests check outcomes, not speed: on a loaded 2-core machine one example can take longer
# than hypothesis's default 200 ms deadline, which would fail a correct test.
settings.register_profile("cellmesh", deadline=None)
settings.load_profile("cellmesh")


def pytest_configure(config: pytest.Config) -> None:
    """Measure the worker runtime's bytes once for the whole run (before xdist starts its workers, which
    inherit it, as do the coordinators the tests start): each coordinator process would otherwise spend
    3-4 s of CPU measuring the same constant of this machine. ``test_runtime_memory.py`` still measures
    it for real; a value set by the caller is kept. Nothing is kept in the user's cache (the tests that
    keep it give their own directory): the suite measures this machine as it is."""
    from coordinator.planning import runtime_bytes

    if hasattr(config, "workerinput") or os.environ.get(runtime_bytes.ENV):
        return
    os.environ.setdefault(runtime_bytes.CACHE_ENV, "off")
    measured = runtime_bytes.runtime_bytes()
    if measured > 0:  # a failed measurement (0, logged) is left to each coordinator to retry
        os.environ[runtime_bytes.ENV] = str(measured)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests where CUDA is absent."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _profile_memo() -> Iterator[ProfileMemo]:
    """``Job.plan()``'s profiles, each model's taken once per test process: [Note: the suite's profiles]."""
    from coordinator.runtime import job
    from tests.harness.profiles import ProfileMemo

    original = job.profile_graph
    memo = ProfileMemo(original)
    job.profile_graph = memo  # type: ignore[assignment]
    yield memo
    job.profile_graph = original


@pytest.fixture(autouse=True)
def _kept_profiles(request: pytest.FixtureRequest, _profile_memo: ProfileMemo) -> Iterator[None]:
    """Serve kept profiles to every test but those marked ``fresh_profile``. (Not through ``monkeypatch``:
    an autouse fixture asking for it would set it up first, and undo the test's own patches last.)"""
    if request.node.get_closest_marker("fresh_profile") is None:
        yield
        return
    from coordinator.runtime import job

    job.profile_graph = _profile_memo.profile  # type: ignore[assignment]
    try:
        yield
    finally:
        job.profile_graph = _profile_memo  # type: ignore[assignment]


@pytest.fixture(scope="session", autouse=True)
def _reap_rank_processes() -> Iterator[None]:
    """At the end of the session, tear down any RankGroup, command or child process still alive."""
    yield
    from tests.harness import commands
    from tests.harness.procs import reap_all

    commands.stop_all()
    reap_all()


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """Give each test the root logger's handlers and level back as they were: a command run in-process
    installs a handler on the stderr pytest captured for that test, which is closed afterwards, and a
    later test's records written there would each print a logging error."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
