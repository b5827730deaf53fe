"""The one conformance suite of the Communicator contract, run on every backend.

One RankGroup per (backend, world size) stays alive for the whole module; each test
sends one command and the ranks sweep a matrix (dtype x size x layout, see
``checks.py``) and return every mismatch, so the suite stays fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness.procs import RankGroup

CHECKS = "tests.multiproc.comm.checks"
SHARD_CHECKS = "tests.multiproc.comm.shard_checks"
WORLD_SIZES = (1, 2, 3, 4)


# the zmq backend's paths between ranks on one host (comm/zmq/shm.py): the default (bodies in shared-memory
# slots, headers in the shared-memory ring), headers by socket naming their slots (the path a full ring
# takes), and sockets only
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "zmq-shm": ("zmq", {"CELLMESH_SHM_RING": "0"}),
    "zmq-sockets": ("zmq", {"CELLMESH_SHM": "0"}),
}


def _group_param(backend: str, world: int) -> Any:
    marks: list[pytest.MarkDecorator] = []
    if backend == "nccl":  # one GPU per rank: NCCL refuses two ranks on one device
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= world
        need = pytest.mark.skipif(not enough, reason=f"nccl world {world} needs {world} GPUs")
        marks += [pytest.mark.gpu, need]
    return pytest.param((backend, world), id=f"{backend}-w{world}", marks=marks)


def _groups(worlds: tuple[int, ...] = WORLD_SIZES) -> list[Any]:
    return [_group_param(b, w) for b in ("gloo", "zmq", "zmq-shm", "zmq-sockets", "nccl") for w in worlds
            if b not in VARIANTS or w > 1]


GROUPS = _groups()
P2P_GROUPS = _groups((2, 3, 4))  # point to point needs a peer
_live: dict[tuple[str, int], RankGroup] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_groups() -> Iterator[None]:
    """One RankGroup per (backend, world) serves every test of the module; all close at its end."""
    yield
    groups = list(_live.values())
    _live.clear()
    for ranks in groups:  # all at once: each takes a second or more to tear its communicators down
        ranks.request_stop()
    for ranks in groups:
        # some 40 ranks exit at once here: 10 s on 2 quiet cores, over 15 s beside another test process
        ranks.close(timedelta(seconds=60))
    for ranks in groups:
        where = f"{ranks.backend} world {ranks.world_size}"
        assert ranks.exitcodes == [0] * ranks.world_size, f"{where}: ranks exited with {ranks.exitcodes}"


@pytest.fixture
def group(request: pytest.FixtureRequest) -> RankGroup:
    backend, world = request.param
    ranks = _live.get((backend, world))
    if ranks is None:
        name, env = VARIANTS.get(backend, (backend, {}))
        ranks = RankGroup(world, name, timeout=timedelta(seconds=15), env=env).start()
        _live[(backend, world)] = ranks
    return ranks


def _expect_clean(group: RankGroup, check: str, *, wait_s: float = 90, module: str = CHECKS,
                  **kwargs: Any) -> None:
    results = group.run(f"{module}:{check}", timeout=timedelta(seconds=wait_s), **kwargs)
    failures = [f"rank {r}: {f}" for r, found in enumerate(results) for f in found]
    shown = "\n".join(failures[:40])
    more = f"\n... and {len(failures) - 40} more" if len(failures) > 40 else ""
    where = f"{group.backend} world={group.world_size} {check}"
    assert not failures, f"{where}: {len(failures)} failures\n{shown}{more}"


MATRIX = [
    ("check_all_reduce", {}),
    ("check_all_reduce", {"async_op": True, "ops": ["sum"]}),
    ("check_broadcast", {}),
    ("check_all_gather_into_tensor", {}),
    ("check_reduce_scatter_tensor", {}),
    ("check_all_gather_list", {}),
    ("check_reduce_scatter_list", {}),
    ("check_async_collectives", {}),
    ("check_send_recv", {}),
    ("check_isend_irecv", {}),
]


@pytest.mark.parametrize("group", GROUPS, indirect=True)
@pytest.mark.parametrize(
    ("check", "kwargs"), MATRIX, ids=[f"{c.removeprefix('check_')}{'-async' if k else ''}" for c, k in MATRIX]
)
def test_matrix(group: RankGroup, check: str, kwargs: dict[str, Any]) -> None:
    """Every dtype x size (0, 1, 4097) x layout (contiguous, strided) against the reference."""
    _expect_clean(group, check, seed=11, **kwargs)


@pytest.mark.parametrize("group", GROUPS, indirect=True)
def test_barrier(group: RankGroup) -> None:
    _expect_clean(group, "check_barrier")


@pytest.mark.parametrize("group", GROUPS, indirect=True)
def test_argument_errors(group: RankGroup) -> None:
    _expect_clean(group, "check_argument_errors")


@pytest.mark.parametrize("group", P2P_GROUPS, indirect=True)
def test_p2p_ordering(group: RankGroup) -> None:
    """Same tag: in order; different tags: never mixed (receives for tag 2 are posted first)."""
    _expect_clean(group, "check_p2p_ordering")


@pytest.mark.parametrize("group", P2P_GROUPS, indirect=True)
def test_p2p_polling(group: RankGroup) -> None:
    """isend/irecv handles report completion through is_completed() without a wait."""
    _expect_clean(group, "check_p2p_polling")


@pytest.mark.parametrize("group", _groups((4,)), indirect=True)
def test_subgroups(group: RankGroup) -> None:
    """Disjoint groups reduce concurrently, each to its own answer; ranks renumber in order."""
    _expect_clean(group, "check_subgroups", seed=5)


@pytest.mark.parametrize("group", P2P_GROUPS, indirect=True)
def test_uneven_groups_shard(group: RankGroup) -> None:
    """reduce_scatter_tensor and all_gather_into_tensor, every case, on groups [w-1, 0, 2, ..] and [1]
    at once."""
    _expect_clean(group, "check_uneven_groups", module=SHARD_CHECKS, seed=13)


@pytest.mark.parametrize("group", _groups((2, 4)), indirect=True)
def test_hybrid_sharding(group: RankGroup) -> None:
    """Reduce-scatter in strided shard groups, all-reduce across replicate groups, at once: the world's
    sum."""
    _expect_clean(group, "check_hybrid_sharding", module=SHARD_CHECKS, seed=17)


@pytest.mark.parametrize("group", P2P_GROUPS, indirect=True)
def test_subgroup_timeouts(group: RankGroup) -> None:
    """A reduce-scatter or all-gather one member of a sub-group never calls: the timeout names the op and
    the group."""
    _expect_clean(group, "check_subgroup_timeouts", module=SHARD_CHECKS, timeout_s=0.5)


@pytest.mark.parametrize("group", GROUPS, indirect=True)
def test_async_shards(group: RankGroup) -> None:
    """Two reduce-scatters and two all-gathers in flight at once: issued without waiting, in order, exact."""
    _expect_clean(group, "check_async_shards", module=SHARD_CHECKS, seed=19)


@pytest.mark.parametrize("group", P2P_GROUPS, indirect=True)
def test_recv_timeout(group: RankGroup) -> None:
    """A recv nobody sends to raises CommTimeoutError naming the peer, within about the timeout."""
    _expect_clean(group, "check_recv_timeout", timeout_s=0.5)


@pytest.mark.parametrize("group", P2P_GROUPS, indirect=True)
def test_bytes_sent(group: RankGroup) -> None:
    """Every call counts the bytes sent its algorithm sends from the rank (comm/traffic.py's note)."""
    _expect_clean(group, "check_bytes_sent")


@pytest.mark.parametrize("group", _groups((2,)), indirect=True)
def test_large(group: RankGroup) -> None:
    """64 MiB float32 all_reduce and broadcast (world 2)."""
    _expect_clean(group, "check_large", seed=3, mib=64, wait_s=120)
