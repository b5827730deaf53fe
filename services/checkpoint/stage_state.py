"""What a stage's part of a checkpoint holds, and how a stage (of any plan) is restored from one.

Every tensor is keyed by name, never by worker or stage, so a checkpoint saved on one plan
restores on another (a stage loads the keys of its own nodes, wherever they were before):

* the model (the checkpoint's root): every parameter and buffer under its key(s) in the
  unwrapped model's ``state_dict`` (``ComputeOptions.state_keys``; a tied weight under each
  of its keys), so the root is a plain DCP checkpoint of the model;
* the training state (``train/``): ``optim.{key}.{name}`` for each optimizer state entry of a
  parameter (``exp_avg``, ``step``, ``momentum_buffer``...; ``key`` the parameter's first
  model key) and ``rng.{part}`` the worker's torch RNG state as the part's service saw it.
  In parameter-server mode the shards, which run the optimizer, write the ``optim.`` entries
  under the same keys (``services/params/shard_state.py``): either mode restores the other's.

The replicas of a data-parallel stage hold the same values, so they share the writing: replica
``r`` of ``R`` writes every ``R``-th tensor and the optimizer state of the parameters among them
(:func:`replica_share`), and every replica its RNG state. Likewise a parameter tied across stages
is written by its lowest holding stage only; the others (its mirrors, ``skip``) restore their copy
from the same keys (see [Note: tied parameters] in ``services/params/tied.py``).

The snapshot is taken on the step thread right after a commit (so before the next update
can change anything) as copies in host memory; the writing happens elsewhere
(:mod:`services.checkpoint.writer`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from services.checkpoint import dcp

__all__ = ["OPTIM", "RNG", "TRAIN", "FullState", "OptimizerState", "Restored", "Snapshot",
           "apply_optimizer_state", "load_optimizer_state", "load_stage", "optimizer_entries", "snapshot"]

TRAIN = "train"  # the training state's subdirectory of a checkpoint
OPTIM = "optim."
RNG = "rng."


@dataclass
class Snapshot:
    """Host-memory copies of one part: ``model`` goes to the checkpoint's root, ``train`` to ``train/``."""

    step: int
    part: str
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    train: dict[str, torch.Tensor] = field(default_factory=dict)


def _keys(name: str, state_keys: Mapping[str, Sequence[str]]) -> Sequence[str]:
    return state_keys.get(name) or [name]


def saved_state(state: Sequence[tuple[str, torch.Tensor]],
                state_keys: Mapping[str, Sequence[str]]) -> list[tuple[str, torch.Tensor]]:
    """The entries of a stage's ``state`` a checkpoint holds: those of the model's ``state_dict``
    (``state_keys``; a non-persistent buffer is not one); all of them when no keys are given."""
    return [(n, t) for n, t in state if not state_keys or n in state_keys]


def replica_share(num_entries: int, replica: int, replicas: int) -> range:
    """Which of a stage's saved entries (by position) replica ``replica`` of ``replicas`` writes: every
    ``replicas``-th, so the replicas of a data-parallel stage write its checkpoint together."""
    return range(replica, num_entries, replicas)


class OptimizerState(Protocol):
    """What a snapshot reads of an optimizer: its per-parameter state (a ``torch.optim`` optimizer is one)."""

    @property
    def state(self) -> Mapping[Any, Mapping[str, Any]]: ...


@dataclass
class FullState:
    """A sharded optimizer's state made whole, keyed by the whole parameters (``services/params/zero.py``)."""

    state: Mapping[Any, Mapping[str, Any]]


def snapshot(step: int, part: str, state: Sequence[tuple[str, torch.Tensor]],
             params: Sequence[tuple[str, nn.Parameter]], optimizer: OptimizerState | None,
             state_keys: Mapping[str, Sequence[str]], *, share: tuple[int, int] = (0, 1),
             skip: Collection[str] = ()) -> Snapshot:
    """Copy a stage's training state: this replica's share (``share`` = (replica, replicas):
    :func:`replica_share`) of the saved entries of ``state`` (parameters and buffers, by the stage's names;
    but ``skip``, the tied parameters another stage writes) with the optimizer's state of the parameters
    among them, and this process's RNG state."""
    snap = Snapshot(step=step, part=part)
    entries = [(n, t) for n, t in saved_state(state, state_keys) if n not in skip]
    mine = [entries[i] for i in replica_share(len(entries), *share)]
    for name, tensor in mine:
        copy = tensor.detach().to("cpu", copy=True)
        for key in _keys(name, state_keys):
            snap.model[key] = copy
    if optimizer is not None:
        names = {name for name, _ in mine}
        snap.train.update(optimizer_entries([(n, p) for n, p in params if n in names], optimizer, state_keys))
    snap.train[f"{RNG}{part}"] = torch.get_rng_state()
    return snap


def optimizer_entries(params: Sequence[tuple[str, torch.Tensor]], optimizer: OptimizerState,
                      state_keys: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """Copies of ``optimizer``'s state of each of ``params`` (the stage's names) as ``optim.{key}.{entry}``
    (``key``: the parameter's first model key; a number entry as a float64 scalar)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in params:
        key = _keys(name, state_keys)[0]
        for entry, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{OPTIM}{key}.{entry}"] = value.detach().to("cpu", copy=True)
            elif isinstance(value, int | float):
                out[f"{OPTIM}{key}.{entry}"] = torch.tensor(value, dtype=torch.float64)
    return out


@dataclass
class Restored:
    """What a stage takes from a checkpoint: per parameter (by its stage name) its optimizer state entries."""

    optimizer_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def load_stage(directory: Path, part: str, state: Sequence[tuple[str, torch.Tensor]],
               params: Sequence[tuple[str, nn.Parameter]],
               state_keys: Mapping[str, Sequence[str]]) -> Restored:
    """Copy the checkpoint's values into ``state`` (in place), set the RNG state saved for ``part``
    (if the checkpoint has one), and return the optimizer state of ``params`` for the optimizer.

    Raises:
        dcp.CheckpointFormatError: The checkpoint is incomplete or lacks one of the stage's tensors.
    """
    state = saved_state(state, state_keys)
    wanted = {name: _keys(name, state_keys)[0] for name, _ in state}
    values = dcp.load(directory, list(wanted.values()))
    with torch.no_grad():
        for name, tensor in state:
            source = values[wanted[name]]
            if source.shape != tensor.shape:
                raise dcp.CheckpointFormatError(
                    f"checkpoint {directory}: {wanted[name]} has shape {tuple(source.shape)}, the model's "
                    f"is {tuple(tensor.shape)}")
            tensor.copy_(source)
    train = directory / TRAIN
    restored = load_optimizer_state(train, params, state_keys)
    rng_key = f"{RNG}{part}"
    if rng_key in dcp.keys(train):
        torch.set_rng_state(dcp.load(train, [rng_key])[rng_key])
    return restored


def load_optimizer_state(train: Path, params: Sequence[tuple[str, torch.Tensor]],
                         state_keys: Mapping[str, Sequence[str]]) -> Restored:
    """The optimizer state of ``params`` (the stage's names) the training state at ``train`` holds, by
    name (``optim.{key}.{entry}``, whichever part wrote it); a parameter without any has none.

    Raises:
        dcp.CheckpointFormatError: ``train`` is not a complete checkpoint.
    """
    available = dcp.keys(train)
    entries: dict[str, tuple[str, str]] = {}  # checkpoint key -> (parameter, entry)
    for name, _ in params:
        prefix = f"{OPTIM}{_keys(name, state_keys)[0]}."
        for key in available:
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                entries[key] = (name, key[len(prefix):])
    restored = Restored()
    for key, value in dcp.load(train, list(entries)).items():
        name, entry = entries[key]
        restored.optimizer_state.setdefault(name, {})[entry] = value
    return restored


def apply_optimizer_state(optimizer: torch.optim.Optimizer, params: Sequence[tuple[str, torch.Tensor]],
                          restored: Restored) -> None:
    """Load ``restored``'s per-parameter state into ``optimizer`` (built over ``params``, in order)."""
    if not restored.optimizer_state:
        return
    current = optimizer.state_dict()
    ids = [i for group in current["param_groups"] for i in group["params"]]
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in zip(ids, ordered, strict=True)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, param in params:
        entries = restored.optimizer_state.get(name)
        if entries:
            state[index[id(param)]] = dict(entries)
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})

