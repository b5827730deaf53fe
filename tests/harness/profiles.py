"""One profile per model for the whole test run: ``Job.plan()``'s profile kept by what it measures.

[Note: the suite's profiles] Every ``Job.plan()`` profiles its model (``profile_graph``: each node timed
at two sizes, at least 3 runs and 0.05 s each): about a second of CPU a plan, 290 s over the ~290 plans of
one suite run (a seventh of all the tests' time), most of them the same few models planned again for
another plan kind. The suite takes each profile once per test process and hands it to every later job
whose graph is the same computation (:func:`fingerprint`): the plan of the later job is then the one a
profile of that model gives, as when a user saves a profile and plans from it again. What the tests
check of a profile itself (``tests/unit/coordinator/planning/test_profile.py`` and the planner's tests)
calls ``profile_graph`` directly and is not served from here; a test that needs ``Job.plan()`` to profile
afresh marks itself ``fresh_profile``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from coordinator.planning.graph import Graph
from coordinator.planning.profile import Profile

__all__ = ["ProfileMemo", "fingerprint"]


def _tensor_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_tensor_meta(v) for v in value))
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return ("dict", tuple((k, _tensor_meta(v)) for k, v in items))
    return ("value", repr(value))


def fingerprint(graph: Graph, sample: Any, **options: Any) -> tuple[Any, ...]:
    """What a profile of ``graph`` on ``sample`` depends on: the traced forward's code, every submodule's
    class and settings, every parameter's and buffer's shape, dtype, device and whether it trains, the cut
    tensors (shapes and dtypes, autocast's included), the sample's shapes and the profile's options."""
    module = graph.module
    modules = tuple((name, f"{type(m).__module__}.{type(m).__qualname__}", m.extra_repr(), m.training)
                    for name, m in module.named_modules())
    params = tuple((name, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad)
                   for name, p in module.named_parameters())
    buffers = tuple((name, tuple(b.shape), str(b.dtype), str(b.device)) for name, b in module.named_buffers())
    cuts = tuple(cut.model_dump_json() for cut in graph.cuts)
    return (str(module.code), modules, params, buffers, cuts, graph.sample_batch, _tensor_meta(sample),
            tuple(sorted(options.items())))


class ProfileMemo:
    """``profile_graph`` that profiles each distinct :func:`fingerprint` once (the ``size`` latest kept)."""

    def __init__(self, profile: Callable[..., Profile], size: int = 32) -> None:
        self.profile = profile  # the profiler itself
        self._size = size
        self._kept: OrderedDict[tuple[Any, ...], Profile] = OrderedDict()
        self.taken = 0  # profiles measured (not served from the memo)

    def __call__(self, graph: Graph, sample: Any, **options: Any) -> Profile:
        key = fingerprint(graph, sample, **options)
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = self.profile(graph, sample, **options)
            self.taken += 1
            if len(self._kept) > self._size:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return kept
