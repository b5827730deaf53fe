"""What a runtime's services are built from (:class:`RunSpec`), and a cut as the compute services see it.

:class:`RunSpec` names the factories (never code), the optimizer and the bounds of one runtime
(``coordinator/runtime/driver.py``); ``Job.run_spec`` makes it from the job's config. A plan's cut
becomes the :class:`~services.protocol.BoundarySpec` the stages on either side of it get
(:func:`boundary_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from coordinator.planning.graph import CutInfo
from coordinator.runtime.devices import DeviceRequest
from coordinator.runtime.scaler import ScalerState
from coordinator.runtime.tied import Holders
from services.protocol import BoundarySpec, BoundaryTensor, FactoryKwargs, OptimizerSpec

__all__ = ["RunSpec", "boundary_spec"]


@dataclass(frozen=True)
class RunSpec:
    """What the services of a job are built from (names of factories, never code)."""

    job: str  # the workers' job (their registry prefix)
    run: str  # unique per runtime: names its services and communicator prefixes
    model: str
    data: str
    loss: str
    optimizer: OptimizerSpec
    model_kwargs: FactoryKwargs = field(default_factory=dict)
    data_kwargs: FactoryKwargs = field(default_factory=dict)
    loss_kwargs: FactoryKwargs = field(default_factory=dict)
    seed: int = 0
    devices: DeviceRequest = field(default_factory=DeviceRequest)  # where stages run, each group's backend
    step_timeout: timedelta = timedelta(seconds=300)
    call_timeout: timedelta = timedelta(seconds=120)
    nonfinite: Literal["stop", "skip"] = "stop"  # see [Note: a step that is not finite]
    clip_grad_norm: float | None = None  # see coordinator/runtime/clipping.py
    accumulate: int = 1  # global batches per step: see coordinator/runtime/accumulation.py
    gather_bytes: int = 4 << 20  # plan.gather_bytes: ZeRO's all-gather buckets and ZeRO-3's units
    # checkpoints: each tensor's keys (by the stages' names) in the unwrapped model's state_dict, and
    # the checkpoint the services start from ("": the factories' values)
    state_keys: Mapping[str, list[str]] = field(default_factory=dict)
    restore: str = ""
    # each tensor's nodes (Chain.holders: the stages holding it), and the model's leaves (model.leaves)
    holders: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    leaves: tuple[str, ...] = ()
    # evaluation: the held-out data factory and the metric factory ("": none)
    eval_data: str = ""
    eval_data_kwargs: FactoryKwargs = field(default_factory=dict)
    metric: str = ""
    scaler: ScalerState | None = None  # fp16: the loss scale to start from (a checkpoint's; None: initial)
    # the parameters several nodes hold (coordinator/runtime/tied.py's shared_parameters)
    tied: Mapping[str, Holders] = field(default_factory=dict)


def boundary_spec(cut: CutInfo, batch_size: int) -> BoundarySpec:
    """The compute service's view of a cut (shapes at ``batch_size`` samples).

    Raises:
        ValueError: The cut cannot lie between stages (the message says why: a non-tensor crosses it).
    """
    if not cut.cuttable:
        raise ValueError(f"cut {cut.index} cannot lie between two stages: {cut.uncuttable_reason}")
    tensors = [BoundaryTensor(name=t.name, dtype=t.dtype, shape=list(t.shape), requires_grad=t.requires_grad,
                              batch_dim=t.batch_dim,
                              key=t.name.split(".", 1)[1] if cut.structure == "dict" else None)
               for t in cut.tensors]
    return BoundarySpec(structure=cut.structure, tensors=tensors, batch_size=batch_size)
