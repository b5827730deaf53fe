"""Checkpoint storage in ``torch.distributed.checkpoint`` (DCP) format, written in parts, published whole.

cellmesh's services have no process group in common, so they cannot run DCP's collective
save. Each service writes its own *part*, a complete DCP checkpoint of the tensors it holds
(``dcp.save(..., no_dist=True)`` into ``parts/{name}/`` of the checkpoint's staging
directory); the coordinator then writes one ``.metadata`` at the checkpoint's root that
indexes every part's files (:func:`merge_parts`). The result is one DCP checkpoint, readable
by anything that reads DCP: ``dcp.load`` with any subset of the keys (a stage of another
plan loads only its own: :func:`load`) and ``format_utils.dcp_to_torch_save``.

Everything in it is a tensor keyed by name (never by worker) and saved by DCP (tensors
through ``torch.save``, read back ``weights_only``); the ``.metadata`` files are DCP's own
dataclasses. No other object is pickled.

Publishing: a checkpoint is written into a staging directory and becomes visible by one
``rename`` to its final name (:func:`publish`), the last thing done; a process killed at any
moment before leaves the previous checkpoint as it was (and a staging directory that the
next save removes).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# torch.distributed.checkpoint is imported where it is used: it pulls in torch.distributed.tensor, about
# a second of a coordinator's start that only a job writing or reading a checkpoint needs. A worker
# loads it with its compute service, before the stage's peak is measured (services/compute/service.py).

__all__ = ["CheckpointFormatError", "keys", "load", "merge_parts", "publish", "save_part"]

METADATA = ".metadata"

# without a process group DCP warns on every call that it assumes one process: that is the design here
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


class CheckpointFormatError(ValueError):
    """A directory is not a complete checkpoint, or lacks a tensor asked for; the message names it."""


def save_part(tensors: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Write ``tensors`` as a complete DCP checkpoint in ``directory`` (created), with fsync.

    Only this process takes part (``no_dist``): safe from any thread, no process group needed.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    directory.mkdir(parents=True, exist_ok=True)
    dcp_save(dict(tensors), storage_writer=FileSystemWriter(directory, sync_files=True, overwrite=True),
             no_dist=True)


def _read_metadata(directory: Path) -> Metadata:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (directory / METADATA).is_file():
        raise CheckpointFormatError(f"{directory} is not a complete checkpoint: it has no {METADATA} "
                                    "(a save that did not finish, or not a cellmesh/DCP checkpoint)")
    return FileSystemReader(directory).read_metadata()


def merge_parts(root: Path, parts: Sequence[Path]) -> Metadata:
    """Write ``root/.metadata`` indexing every tensor of ``parts`` (each a directory under ``root``).

    Raises:
        CheckpointFormatError: A part is incomplete, or two parts hold the same key.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult

    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    owner: dict[str, Path] = {}
    for part in parts:
        meta = _read_metadata(part)
        prefix = part.relative_to(root).as_posix()
        for key, value in meta.state_dict_metadata.items():
            if key in owner:
                raise CheckpointFormatError(f"key {key!r} is in two parts: {owner[key]} and {part}")
            owner[key] = part
            merged.state_dict_metadata[key] = value
        merged.planner_data.update(meta.planner_data or {})
        for index, info in (meta.storage_data or {}).items():
            path = f"{prefix}/{info.relative_path}"
            merged.storage_data[index] = dataclasses.replace(info, relative_path=path)
    # finish() writes .metadata.tmp, fsyncs it and renames it; it takes the index from the write results
    results = [WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
               for index, info in merged.storage_data.items()]
    writer = FileSystemWriter(root, sync_files=True, overwrite=True)
    writer.set_up_storage_writer(True)
    writer.finish(merged, [results])
    return merged


def keys(directory: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor key of the checkpoint at ``directory`` with its dtype and shape.

    Raises:
        CheckpointFormatError: ``directory`` is not a complete checkpoint.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, value in _read_metadata(directory).state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            out[key] = (value.properties.dtype, tuple(value.size))
    return out


def load(directory: Path, wanted: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors ``wanted`` from the checkpoint at ``directory``, as new CPU tensors.

    Raises:
        CheckpointFormatError: ``directory`` is not a complete checkpoint, or lacks one of ``wanted``.
    """
    have = keys(directory)
    missing = [k for k in wanted if k not in have]
    if missing:
        raise CheckpointFormatError(f"checkpoint {directory} has no tensor {missing[:5]} (of {len(missing)} "
                                    "missing): it was saved from another model")
    out = {k: torch.empty(have[k][1], dtype=have[k][0]) for k in wanted}
    if out:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        dcp_load(out, storage_reader=FileSystemReader(directory), no_dist=True)
    return out


def publish(staging: Path, final: Path) -> None:
    """Make the checkpoint written in ``staging`` visible as ``final`` (one rename: the commit)."""
    if final.exists():  # the same step, saved before a failure and replayed since: identical, keep it
        shutil.rmtree(staging)
        return
    os.rename(staging, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
