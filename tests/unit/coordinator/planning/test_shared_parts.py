"""The search's shared per-size parts, computed in numpy passes, against their definitions tensor by tensor
and cut by cut."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from coordinator.planning.graph import CutInfo, TensorMeta
from coordinator.planning.memory import MemoryOption, node_memory
from coordinator.planning.planner import _cut_costs, _scaled_bytes, _Shared, _transfer
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources


def random_profile(rng: random.Random, nodes: int, base: int) -> Profile:
    synthetic = Profile.synthetic([1e-3] * nodes, microbatch_size=base)

    def tensor(c: int, k: int) -> TensorMeta:
        dim = rng.choice([None, 0, 1])
        shape = [rng.randint(1, 9), rng.randint(1, 9)]
        if dim is not None:
            shape[dim] = base * rng.choice([1, 1, 2, 3])  # a batch dimension holds the samples (or more)
        nbytes = shape[0] * shape[1] * rng.choice([2, 4, 8]) + rng.choice([0, 0, 3])  # odd bytes too
        return TensorMeta(name=f"t{c}.{k}", shape=tuple(shape), dtype="float32",
                          requires_grad=rng.random() < 0.6, nbytes=nbytes, batch_dim=dim)

    cuts = tuple(CutInfo(index=c, tensors=tuple(tensor(c, k) for k in range(rng.randint(0, 3))),
                         uncuttable_reason=None if rng.random() < 0.8 or c in (0, nodes) else "a test's")
                 for c in range(nodes + 1))
    return synthetic.model_copy(update={"cuts": cuts})


def at_batch_bytes(profile: Profile, size: int) -> tuple[list[int], list[int]]:
    """The definition: each tensor rescaled by ``TensorMeta.at_batch``, summed per cut."""
    tensors = [[t.at_batch(size, profile.microbatch_size) for t in c.tensors] for c in profile.cuts]
    return ([sum(t.nbytes for t in ts) for ts in tensors],
            [sum(t.nbytes for t in ts if t.requires_grad) for ts in tensors])


@pytest.mark.parametrize("seed", range(20))
def test_cut_bytes_at_every_size_are_the_rescaled_tensors(seed: int) -> None:
    rng = random.Random(seed)
    base = rng.choice([1, 2, 4, 8])
    profile = random_profile(rng, rng.randint(1, 30), base)
    for size in (1, 2, 3, base, 2 * base, 5 * base + 1, 64):
        assert _scaled_bytes(profile, size) == at_batch_bytes(profile, size)


@pytest.mark.parametrize("seed", range(20))
def test_cut_costs_are_the_sorted_transfers_and_their_running_sums(seed: int) -> None:
    rng = random.Random(100 + seed)
    base = rng.choice([1, 4])
    profile = random_profile(rng, rng.randint(2, 30), base)
    resources = Resources(workers=Resources.local(2).workers, bandwidth_bps=rng.choice([1e8, 3.3e9]),
                          latency_s=rng.choice([0.0, 2e-5]))
    bw, lat = resources.fastest_link
    for size in (1, base, 3 * base):
        fwd, bwd = at_batch_bytes(profile, size)
        costs = sorted(_transfer(fwd[c], bw, lat) + _transfer(bwd[c], bw, lat)
                       for c in range(1, len(profile.cuts) - 1) if profile.cuts[c].cuttable)
        expected = (costs[0] if costs else 0.0), [0.0, *itertools.accumulate(costs)]
        assert _cut_costs(_Shared(profile, resources), size) == expected  # the same floats, bit for bit


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(("zero", "mode", "replicas"), [(0, "collective", 1), (2, "collective", 4),
                                                         (3, "collective", 2), (0, "parameter_server", 3)])
def test_a_nodes_bytes_at_every_size_are_those_made_for_that_size(recompute: bool, zero: int, mode: str,
                                                                 replicas: int) -> None:
    """The search makes a node's bytes once and gives each microbatch size its part: the same bytes as
    made for that size."""
    rng = random.Random(zero * 10 + replicas)
    nodes = 12
    profile = Profile.synthetic([1e-3] * nodes,
                                param_bytes=[rng.choice([0, 4096, 1 << 20]) for _ in range(nodes)],
                                activation_bytes=[rng.randint(0, 1 << 16) for _ in range(nodes)],
                                cut_bytes=[rng.randint(1, 1 << 14) for _ in range(nodes - 1)],
                                microbatch_size=4)
    option = MemoryOption(zero=zero, shard_factor=replicas if zero else 1, recompute=recompute)
    shared = _Shared(profile, Resources.local(2))
    for size in (4, 1, 8, 4, 12):
        scale = size / profile.microbatch_size
        made = node_memory(profile.nodes, option, mode=mode,  # type: ignore[arg-type]
                           data_parallel=replicas, num_microbatches=2,
                           activation_bytes=[nd.activation_bytes * scale for nd in profile.nodes],
                           input_bytes=_scaled_bytes(profile, size)[0][:-1], on_cuda=False)
        assert shared.memory(option, mode, replicas, 2, size, False) == made  # type: ignore[arg-type]


def test_a_placement_s_period_is_its_least_repeating_prefix() -> None:
    from coordinator.planning.planner import _period

    def period(grid: tuple[tuple[str, ...], ...], stages: int) -> int:
        return _period(np.array(grid), stages)

    interleaved = (("a", "b", "a", "b", "a", "b"), ("c", "d", "c", "d", "c", "d"))
    assert period(interleaved, 6) == 2
    assert period((("a",) * 4, ("b",) * 4), 4) == 1  # every stage on one worker per replica
    assert period((("a", "b", "c", "d"),), 4) == 4  # a plain pipeline
    # the first replica repeats, the second does not: the period must hold for every replica
    assert period((("a", "b", "a", "b"), ("c", "d", "e", "d")), 4) == 4
    assert period((("a", "b", "c", "a", "b", "c"),), 6) == 3
