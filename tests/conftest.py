"""Session-wide test plumbing: GPU gating and the cleanup of stray rank processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

# Property tests check outcomes, not speed: on a loaded 2-core machine one example can take longer
# than hypothesis's default 200 ms deadline, which would fail a correct test.
settings.register_profile("cellmesh", deadline=None)
settings.load_profile("cellmesh")


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


@pytest.fixture(scope="session", autouse=True)
def _reap_rank_processes() -> Iterator[None]:
    """At the end of the session, tear down any RankGroup or child process still alive."""
    yield
    from tests.harness.procs import reap_all

    reap_all()
