"""A parameter shard's part of a checkpoint: the optimizer state of its parameters, by name.

In parameter-server mode the shards run the optimizer, so its state (Adam's moments, SGD's
momentum) lives there and nowhere else. A shard's part holds, in the checkpoint's ``train/``,
``optim.{key}.{entry}`` for each of its parameters, exactly as a stage of collective mode
names its own (:func:`services.checkpoint.stage_state.optimizer_entries`; ``key`` is the
parameter's first key in the model's ``state_dict``, ``ShardSetup.keys``). No model tensor:
the stages' replica 0 save the values, which they pulled from the shards at that version. So
a checkpoint does not record which mode, plan or shard saved it: a shard loads its
parameters' entries whoever wrote them (a collective stage, another sharding), and a
collective stage loads those the shards wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from services.checkpoint import dcp
from services.checkpoint.stage_state import (
    TRAIN,
    Snapshot,
    apply_optimizer_state,
    load_optimizer_state,
    optimizer_entries,
)
from services.params.store import ParamStore

__all__ = ["restore", "snapshot"]


def _state_keys(store: ParamStore, keys: Mapping[str, str]) -> dict[str, list[str]]:
    return {name: [keys.get(name, name)] for name in store.names}


def snapshot(store: ParamStore, keys: Mapping[str, str], step: int, part: str) -> Snapshot:
    """Host-memory copies of the optimizer state of ``store``'s parameters, as part ``part`` of checkpoint
    ``step`` (training state only). Call between updates: the copies are that version's state."""
    return Snapshot(step=step, part=part,
                    train=optimizer_entries(store.parameters(), store.optimizer, _state_keys(store, keys)))


def restore(store: ParamStore, checkpoint: Path, keys: Mapping[str, str]) -> int:
    """Load into ``store``'s optimizer the state of its parameters that ``checkpoint`` holds (a parameter
    without any, e.g. from a checkpoint saved before its first update, starts fresh); how many had some.

    Raises:
        dcp.CheckpointFormatError: ``checkpoint`` is incomplete, or an entry's shape is not its
            parameter's.
    """
    params = store.parameters()
    restored = load_optimizer_state(checkpoint / TRAIN, params, _state_keys(store, keys))
    shapes = dict(params)
    for name, entries in restored.optimizer_state.items():
        for entry, value in entries.items():
            if value.dim() and value.shape != shapes[name].shape:
                raise dcp.CheckpointFormatError(
                    f"checkpoint {checkpoint}: the optimizer state {entry!r} of {keys.get(name, name)} has "
                    f"shape {tuple(value.shape)}, the parameter's is {tuple(shapes[name].shape)}")
    apply_optimizer_state(store.optimizer, params, restored)
    return len(restored.optimizer_state)
