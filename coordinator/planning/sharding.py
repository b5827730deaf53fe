"""What sharding and offload cost in time: a stage's gradient sync and optimizer step under each option.

[Note: sharded sync cost] A ring pass over ``n`` ranks (a reduce-scatter or an all-gather) of ``B``
bytes takes ``(n-1)/n * B / bw + (n-1) lat``; an all-reduce is two passes (``bw`` is the link's times
``COLLECTIVE_EFFICIENCY``, [Note: gradient sync cost] in ``coordinator/planning/planner.py``). Per stage
of gradient bytes ``G`` and parameter bytes ``P``, ``d`` replicas sharded in groups of ``F``
(``g = d / F`` groups; hybrid sharding when ``g > 1``):

======  ===============================================  =========================================
ZeRO    during the last backward (hidden by what runs    after it (not hidden)
        after the first bucket, as the all-reduce is)
======  ===============================================  =========================================
0       all-reduce of ``G`` over ``d``                   --
1       all-reduce of ``G`` over ``d``                   all-gather of ``P`` over ``F`` (the
                                                         updated shards) behind the next forward:
                                                         its first bucket exposed, the rest hidden
                                                         as ZeRO-3's prefetch is (at most the first
                                                         microbatch's forward)
2       reduce-scatter of ``G`` over ``F``, all-reduce   as ZeRO-1
        of the ``G / F`` shard over ``g``
3       as ZeRO-2                                        each microbatch gathers ``P`` over ``F``
                                                         in its forward and again in its backward,
                                                         :data:`ZERO3_PREFETCH_HIDDEN` of it (at most
                                                         the stage's compute) hidden by prefetch
======  ===============================================  =========================================

ZeRO-2 moves the same bytes as ZeRO-0's all-reduce, half of them after the step; ZeRO-1 adds an
all-gather to the all-reduce. ZeRO-1/2's all-gather goes in buckets of ``plan.gather_bytes``
(``services/params/commit_gather.py``), each paying the ring's latency; the forward's share of a
microbatch's compute is :data:`FORWARD_SHARE`. The optimizer step updates ``1 / F`` of the stage (the
fused update's traffic, ``OPTIMIZER_TRAFFIC``). Offloaded (CUDA), it moves the gradients to the host and
the parameters back at :data:`OFFLOAD_BANDWIDTH_BPS` and updates on the host at
:data:`HOST_OPTIMIZER_BANDWIDTH_BPS`.
"""

from __future__ import annotations

from coordinator.planning.memory import MemoryOption

__all__ = ["FORWARD_SHARE", "HOST_OPTIMIZER_BANDWIDTH_BPS", "OFFLOAD_BANDWIDTH_BPS", "ZERO3_PREFETCH_HIDDEN",
           "gradient_collectives", "optimizer_s", "ring_pass", "sharded_sync"]

# The share of ZeRO-3's per-microbatch gathers that prefetching the next cell's hides behind the
# current cell's compute (at most that compute): a guess to be measured once the services run it.
ZERO3_PREFETCH_HIDDEN = 0.5
# The forward's share of a stage's compute (forward + backward): what hides ZeRO-1/2's all-gather.
FORWARD_SHARE = 1 / 3
# Host <-> device copies of an offloaded step: PCIe 3.0 x16 as achieved by pinned copies (~12 GB/s).
OFFLOAD_BANDWIDTH_BPS = 12e9
# The host's memory traffic for a fused optimizer update (a few cores streaming DRAM).
HOST_OPTIMIZER_BANDWIDTH_BPS = 10e9


def ring_pass(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One reduce-scatter or all-gather of ``nbytes`` over ``ranks`` (0 for one rank)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


def sharded_sync(option: MemoryOption, data_parallel: int, grad_bytes: float, param_bytes: float, *,
                 hidden: float, compute_s: float, num_microbatches: int, bandwidth: float,
                 latency: float, unhideable: float = 0.0, recomputed_s: float = 0.0) -> float:
    """A collective stage's sync time left unhidden under ``option`` (see [Note: sharded sync cost]).

    Args:
        option: The ZeRO stage and shard factor.
        data_parallel: Replicas ``d`` of the stage.
        grad_bytes: The stage's gradient bytes ``G``.
        param_bytes: Its parameter bytes ``P``.
        hidden: The backward left once the first bucket is ready (hides the first column).
        compute_s: The stage's forward and backward over all the step's microbatches (bounds what
            ZeRO-3's prefetch hides).
        num_microbatches: Per step.
        bandwidth: The collective's bandwidth (link times efficiency).
        latency: The link's latency.
        unhideable: Of the collectives during the backward, what no backward hides (their CPU work where
            the host has no core to spare for it: [Note: the sync's own CPU] in
            ``coordinator/planning/planner.py``).
        recomputed_s: Of ``compute_s``, the forwards the backwards run again (recompute): compute that
            hides ZeRO-3's gathers, but no forward behind which ZeRO-1/2's first gathers run. Counted as
            forward, it let recompute's longer backward hide more of them than it added, and a plan with
            recompute was predicted faster than the same plan without (found by a fuzzed search).
    """
    d, f = data_parallel, option.shard_factor if option.zero else 1
    if d == 1:
        return 0.0
    during = gradient_collectives(option, d, grad_bytes, bandwidth=bandwidth, latency=latency)
    after = 0.0
    if option.zero in (1, 2) and param_bytes > 0:  # bucket by bucket behind the first forward
        buckets = max(1, -(-int(param_bytes) // option.gather_bytes))
        first = ring_pass(param_bytes / buckets, f, bandwidth, latency)
        rest = (buckets - 1) * first
        forward = (compute_s - recomputed_s) * FORWARD_SHARE / max(1, num_microbatches)
        after = first + max(rest * (1 - ZERO3_PREFETCH_HIDDEN), rest - forward)
    if option.zero == 3:
        gathers = 2 * num_microbatches * ring_pass(param_bytes, f, bandwidth, latency)
        after = max(gathers * (1 - ZERO3_PREFETCH_HIDDEN), gathers - compute_s)
    return max(0.0, during - hidden, unhideable) + after


def gradient_collectives(option: MemoryOption, data_parallel: int, grad_bytes: float, *, bandwidth: float,
                         latency: float) -> float:
    """The gradient collectives of a stage's last backward under ``option`` (the table's middle column):
    an all-reduce of ``G`` over ``d``, or ZeRO-2/3's reduce-scatter over ``F`` and the shard's all-reduce
    over the groups; at ``bandwidth`` bytes per second and ``latency`` per ring step."""
    d, f = data_parallel, option.shard_factor if option.zero else 1
    if option.zero <= 1:
        return 2 * ring_pass(grad_bytes, d, bandwidth, latency)
    return (ring_pass(grad_bytes, f, bandwidth, latency)
            + 2 * ring_pass(grad_bytes / f, d // f, bandwidth, latency))


def optimizer_s(option: MemoryOption, grad_bytes: float, param_bytes: float, *, traffic: float,
                device_bandwidth: float, on_cuda: bool) -> float:
    """A collective stage's optimizer step under ``option`` (``device_bandwidth``: the fused update's
    memory bandwidth on the worker, its speed included)."""
    share = 1.0 / option.shard_factor if option.zero else 1.0
    if option.offload and on_cuda:
        return ((grad_bytes + param_bytes) * share / OFFLOAD_BANDWIDTH_BPS
                + grad_bytes * share * traffic / HOST_OPTIMIZER_BANDWIDTH_BPS)
    return grad_bytes * share * traffic / device_bandwidth
