"""The resource list: validation, links, and this machine as local workers."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from coordinator.planning.resources import Link, Resources, Worker


def test_local_describes_this_machine() -> None:
    res = Resources.local(workers=2)
    assert [w.name for w in res.workers] == ["local-0", "local-1"]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert sum(w.memory_bytes for w in res.workers) <= total
    assert all(w.device == "cpu" and w.cpus >= 1 for w in res.workers)
    assert Resources.local(3, memory_bytes=2**20).workers[2].memory_bytes == 2**20
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Resources.local(0)


def test_links_and_defaults() -> None:
    res = Resources(workers=(Worker(name="a", memory_bytes=1), Worker(name="b", memory_bytes=1),
                             Worker(name="c", memory_bytes=1)),
                    bandwidth_bps=10e9, latency_s=1e-5,
                    links=(Link(a="a", b="c", bandwidth_bps=1e9, latency_s=1e-3),))
    assert res.link("c", "a") == (1e9, 1e-3)
    assert res.link("a", "b") == (10e9, 1e-5)
    assert res.slowest_link(["a", "b", "c"]) == (1e9, 1e-3)
    assert res.worker("b").name == "b"
    with pytest.raises(KeyError):
        res.worker("z")
    assert Resources.model_validate_json(res.model_dump_json()) == res


def test_bad_resource_lists_are_refused() -> None:
    with pytest.raises(ValidationError, match="duplicate worker names"):
        Resources(workers=(Worker(name="a", memory_bytes=1), Worker(name="a", memory_bytes=1)))
    with pytest.raises(ValidationError, match="unknown workers"):
        Resources(workers=(Worker(name="a", memory_bytes=1),),
                  links=(Link(a="a", b="x", bandwidth_bps=1, latency_s=0),))
    with pytest.raises(ValidationError, match="gpus"):
        Worker(name="g", device="cuda", memory_bytes=1)
    with pytest.raises(ValidationError, match="extra"):
        Worker.model_validate({"name": "a", "memory_bytes": 1, "colour": "red"})
    with pytest.raises(ValidationError):
        Resources(workers=())
