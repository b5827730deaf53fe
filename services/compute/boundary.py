"""Values crossing a pipeline cut: tensors, tuples, lists and dicts of tensors, checked against the plan.

[Note: boundary metadata]
A receiving stage must know every tensor's shape and dtype before it can post a receive,
and it cannot ask its neighbour mid-step without a round trip on the critical path. So
the shapes come from the plan: the coordinator knows them from its graph and puts a
:class:`~services.protocol.BoundarySpec` for each cut in the stages' assignments
(``ComputeOptions.incoming`` / ``outgoing``). Shapes are recorded at ``batch_size``
samples and scaled along ``batch_dim`` to each microbatch's sample count, so uneven
microbatches work.

The spec is checked against the real tensors on the *sending* side, on every forward,
before anything is sent (a shape compare per tensor, cheap next to the forward): a
mismatch raises :class:`BoundaryError` naming the stage, microbatch, tensor, expected and
actual, and nothing goes on the wire, so the receiver never reads a wrong-sized buffer
(the ZeroMQ backend would catch that too, gloo would not). Gradients need no check of
their own: the gradient of a tensor has the tensor's shape.

Worked example: a stage returns ``{"h": h, "skip": s, "pos": p}`` with ``h`` and ``s``
float64 ``[B, 16]`` needing gradients and ``p`` int64 ``[B, 16]``. Its spec is
``structure="dict"``, tensors ``h, skip, pos`` (in that order), ``batch_size=B0``,
``batch_dim=0``. For microbatch 3 of ``b`` samples, :func:`flatten` returns
``[h, skip, p]`` after checking each is ``[b, 16]``; tensor ``i`` travels with tag
``transfer_tag(3, i)``; the receiver fills ``empty_buffers(spec, b)`` and rebuilds the
dict with :func:`unflatten`. On backward, gradients flow back for ``h`` and ``skip`` only.

Several values crossing one cut (a skip connection beside the main path of a traced model,
``services/compute/chain.py``) have ``structure="values"``: each is a tensor, and they travel and
reach the stage as a tuple in graph order (what the stage modules return and take).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from comm.wire import DTYPES, dtype_name
from services.protocol import MAX_BOUNDARY_TENSORS, BoundarySpec, BoundaryTensor

__all__ = ["BoundaryError", "describe", "empty_buffers", "flatten", "shapes_at", "transfer_tag", "unflatten"]


class BoundaryError(ValueError):
    """A value crossing a cut disagrees with the plan's boundary spec (the message says where and how)."""


def transfer_tag(microbatch: int, index: int) -> int:
    """The communicator tag of tensor ``index`` of ``microbatch``'s boundary (both directions)."""
    return microbatch * MAX_BOUNDARY_TENSORS + index


def shapes_at(spec: BoundarySpec, num_samples: int) -> list[list[int]]:
    """Every tensor's shape for a microbatch of ``num_samples`` samples.

    Raises:
        BoundaryError: If a batch dimension does not scale to a whole number.
    """
    shapes = []
    for t in spec.tensors:
        shape = list(t.shape)
        if t.batch_dim is not None and num_samples != spec.batch_size:
            scaled, rest = divmod(shape[t.batch_dim] * num_samples, spec.batch_size)
            if rest:
                raise BoundaryError(
                    f"tensor {t.name!r}: dim {t.batch_dim} is {shape[t.batch_dim]} at {spec.batch_size} "
                    f"samples and does not scale to {num_samples} samples"
                )
            shape[t.batch_dim] = scaled
        shapes.append(shape)
    return shapes


def empty_buffers(spec: BoundarySpec, num_samples: int, *, grad_only: bool = False,
                  device: torch.device | None = None) -> list[tuple[int, torch.Tensor]]:
    """Fresh receive buffers for a microbatch of ``num_samples`` samples, as ``(index, buffer)``, on
    ``device`` (the CPU by default).

    With ``grad_only``, only the tensors that carry a gradient get one (gradient receives).
    """
    return [
        (i, torch.empty(shape, dtype=DTYPES[t.dtype], device=device))
        for i, (t, shape) in enumerate(zip(spec.tensors, shapes_at(spec, num_samples), strict=True))
        if t.requires_grad or not grad_only
    ]


def describe(value: Any) -> str:
    """A short description of a value for error messages: ``tuple(float64[4, 16], int64[4])``."""
    if isinstance(value, torch.Tensor):
        return f"{_dtype(value.dtype)}{list(value.shape)}"
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({', '.join(describe(v) for v in value)})"
    if isinstance(value, dict):
        return "dict(" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + ")"
    return type(value).__name__


def _dtype(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except Exception:  # a dtype the wire cannot carry
        return str(dtype).removeprefix("torch.")


def _expected(t: BoundaryTensor, shape: Sequence[int]) -> str:
    return f"{t.dtype}{list(shape)} requires_grad={t.requires_grad}"


def flatten(spec: BoundarySpec, value: Any, num_samples: int, *, where: str,
            check_grad: bool = True) -> list[torch.Tensor]:
    """The tensors of ``value`` in spec order, each checked against the spec.

    Args:
        spec: The cut's boundary spec.
        value: What the stage returned.
        num_samples: The microbatch's sample count (scales the expected shapes).
        where: Names the place for errors, e.g. ``"stage 0 microbatch 3 output"``.
        check_grad: Compare ``requires_grad`` too (off when the forward runs without grad).

    Raises:
        BoundaryError: The structure, a key, a dtype, a shape or ``requires_grad`` differs.
    """
    expected_kind: type = {"tensor": torch.Tensor, "tuple": tuple, "list": list, "dict": dict,
                           "values": tuple}[spec.structure]
    plan = f"the plan says {spec.structure} of {len(spec.tensors)}"
    if not isinstance(value, expected_kind):
        raise BoundaryError(f"{where}: {plan}, got {describe(value)}")
    if isinstance(value, torch.Tensor):
        items: list[Any] = [value]
    elif isinstance(value, dict):
        keys = [t.dict_key for t in spec.tensors]
        if set(value) != set(keys):
            raise BoundaryError(f"{where}: {plan} with keys {keys}, got keys {list(value)}")
        items = [value[k] for k in keys]
    else:
        assert isinstance(value, tuple | list)
        if len(value) != len(spec.tensors):
            raise BoundaryError(f"{where}: {plan}, got {describe(value)}")
        items = list(value)
    for t, shape, item in zip(spec.tensors, shapes_at(spec, num_samples), items, strict=True):
        if not isinstance(item, torch.Tensor):
            raise BoundaryError(f"{where}: tensor {t.name!r}: expected {_expected(t, shape)}, "
                                f"got a {type(item).__name__}")
        grad_ok = not check_grad or item.requires_grad == t.requires_grad
        if _dtype(item.dtype) != t.dtype or list(item.shape) != shape or not grad_ok:
            raise BoundaryError(
                f"{where}: tensor {t.name!r}: expected {_expected(t, shape)}, got "
                f"{_dtype(item.dtype)}{list(item.shape)} requires_grad={item.requires_grad}"
            )
    return items


def unflatten(spec: BoundarySpec, tensors: Sequence[torch.Tensor]) -> Any:
    """The value ``tensors`` (in spec order) form: a tensor, a tuple, a list or a dict (several
    ``"values"`` form a tuple, one entry per value, as a stage module takes them)."""
    if spec.structure == "tensor":
        return tensors[0]
    if spec.structure in ("tuple", "values"):
        return tuple(tensors)
    if spec.structure == "list":
        return list(tensors)
    return {t.dict_key: x for t, x in zip(spec.tensors, tensors, strict=True)}
