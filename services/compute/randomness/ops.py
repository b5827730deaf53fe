"""The random ATen ops, computed from keyed uniforms instead of a generator's state.

Every ATen op tagged ``torch.Tag.nondeterministic_seeded`` reaches :func:`run` while a keyed
forward is active (``services/compute/randomness/mode.py``). The ops a forward uses in practice
have a handler here that builds their result from :meth:`Draw.uniform` (one call per stream):

* dropout: ``bernoulli_`` (what ``F.dropout`` and the dropout inside CPU attention lower to),
  ``bernoulli``, ``native_dropout`` (the fused kernel on GPUs: the same mask as the CPU path,
  ``u < 1 - p``, so both devices drop the same elements);
* ``rand``/``rand_like``/``uniform(_)``, ``randn``/``randn_like``/``normal(_)`` (Box-Muller on
  two streams), ``randint``/``randint_like``/``random_``, ``exponential(_)``, ``cauchy(_)``,
  ``log_normal(_)``, ``geometric(_)``.

An attention op whose ``dropout_p`` is 0 (``F.scaled_dot_product_attention`` outside training, or in
a model without attention dropout: on the CPU it is ``_scaled_dot_product_flash_attention_for_cpu``,
tagged random whatever its ``dropout_p``) draws nothing (:func:`draws`): it runs as it is and counts
no draw, so a model without random layers runs its forwards without the keyed mode.

A generator passed to one of them is ignored: the draw is keyed like any other. Any other
random op (``randperm``, ``multinomial``, ``poisson``, ``rrelu_with_noise``, GPU flash
attention with dropout...) runs as torch implements it, with the process's generators seeded
from the draw's key for that op only (:func:`seeded`): the same on every replay and after a
recovery, but keyed without samples, so it equals one process only where the op's inputs do
not depend on how the batch is split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from services.compute.randomness.keys import DrawKey, uniform

__all__ = ["Draw", "draws", "is_random", "prepare", "run", "seeded"]

_RANDOM: dict[Any, bool] = {}  # OpOverload -> tagged nondeterministic_seeded (cached: checked per op)


def is_random(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` draws random numbers (its ``nondeterministic_seeded`` tag)."""
    known = _RANDOM.get(func)
    if known is None:
        known = _RANDOM[func] = torch.Tag.nondeterministic_seeded in func.tags
    return known


_DROPOUT_P: dict[Any, tuple[int, bool] | None] = {}  # OpOverload -> (index, kwarg only) of dropout_p


def draws(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``func`` draws random numbers: a random op (:func:`is_random`), unless it is
    an attention op whose ``dropout_p`` is 0 (the fused attention kernels are tagged random whatever
    their dropout)."""
    if not is_random(func):
        return False
    if func not in _DROPOUT_P:
        _DROPOUT_P[func] = next(((i, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                                 if a.name == "dropout_p"), None)
    where = _DROPOUT_P[func]
    if where is None:
        return True
    i, kwarg_only = where
    p = args[i] if i < len(args) and not kwarg_only else kwargs.get("dropout_p", 0.0)
    return not (isinstance(p, int | float) and p == 0)


@dataclass(frozen=True)
class Draw:
    """One random op's draw: its key (stream 0) and the sample index of each row, if batch-shaped."""

    key: DrawKey
    rows: torch.Tensor | None  # the samples' hashes (keys.sample_hashes), one row each; None: one row

    def uniform(self, shape: torch.Size | tuple[int, ...], *, double: bool, device: torch.device,
                stream: int = 0) -> torch.Tensor:
        """Uniforms in [0, 1) of ``shape`` (float64 if ``double``, else float32) on ``device``."""
        key = self.key if stream == 0 else dataclasses.replace(self.key, stream=stream)
        return uniform(key, shape, self.rows, double=double, device=device)


_SCHEMAS: dict[Any, list[tuple[str, bool, Any]]] = {}  # OpOverload -> (name, keyword only, default)


def _bind(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema names (defaults filled in)."""
    schema = _SCHEMAS.get(func)
    if schema is None:
        schema = _SCHEMAS[func] = [(a.name, a.kwarg_only, a.default_value if a.has_default_value() else None)
                                   for a in func._schema.arguments]
    bound: dict[str, Any] = {}
    for i, (name, kwarg_only, default) in enumerate(schema):
        if i < len(args) and not kwarg_only:
            bound[name] = args[i]
        else:
            bound[name] = kwargs.get(name, default)
    return bound


def _double(dtype: torch.dtype) -> bool:
    return dtype == torch.float64 or not dtype.is_floating_point


def _u(draw: Draw, shape: torch.Size, dtype: torch.dtype, device: torch.device,
       stream: int = 0) -> torch.Tensor:
    return draw.uniform(shape, double=_double(dtype), device=device, stream=stream)


def _normal(draw: Draw, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Standard normals by Box-Muller on streams 0 and 1 (``1 - u`` keeps the log finite)."""
    u1, u2 = _u(draw, shape, dtype, device, 0), _u(draw, shape, dtype, device, 1)
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)


def _integers(draw: Draw, shape: torch.Size, low: float, high: float, device: torch.device) -> torch.Tensor:
    """Integers uniform in ``[low, high)`` as float64 (53-bit uniforms: unbiased to ~2**-21 below 2**32)."""
    u = draw.uniform(shape, double=True, device=device)
    return torch.clamp(torch.floor(u * (high - low)) + low, max=high - 1)


def _factory(b: dict[str, Any], size: Any, default: torch.dtype | None = None) -> torch.Tensor:
    dtype = b.get("dtype")
    if not isinstance(dtype, torch.dtype):  # unset, or the schema's default as a ScalarType number
        dtype = default or torch.get_default_dtype()
    return torch.empty(list(size), dtype=dtype, device=b.get("device") or "cpu")


def _like(b: dict[str, Any]) -> torch.Tensor:
    return torch.empty_like(b["self"], dtype=b.get("dtype"), device=b.get("device"))


def _fill(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return out.copy_(values)


def _full_range(dtype: torch.dtype) -> tuple[float, float]:
    """``random_()``'s range without bounds: [0, 2**mantissa] for floats, [0, max] for integers."""
    if dtype == torch.bool:
        return 0.0, 2.0
    if dtype.is_floating_point:
        digits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # float32: 24
        return 0.0, float(2 ** digits + 1)
    return 0.0, float(torch.iinfo(dtype).max) + 1.0


def _bernoulli_into(out: torch.Tensor, p: Any, draw: Draw) -> torch.Tensor:
    u = _u(draw, out.shape, out.dtype, out.device)
    p = p.to(u.dtype) if isinstance(p, torch.Tensor) else p
    return _fill(out, u < p)


def _native_dropout(b: dict[str, Any], draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
    x, p = b["input"], float(b["p"])
    keep = _u(draw, x.shape, x.dtype, x.device) < 1.0 - p  # F.dropout's CPU path: bernoulli_(1 - p)
    scale = torch.zeros((), dtype=x.dtype, device=x.device) if p >= 1.0 else keep.to(x.dtype) / (1.0 - p)
    return x * scale, keep


Handler = Callable[[dict[str, Any], Draw], Any]
Transform = Callable[[dict[str, Any], Draw, torch.Tensor], torch.Tensor]


def _in_place(transform: Transform) -> Handler:
    """A handler filling ``self`` with ``transform(args, draw, self)``: the in-place op."""
    return lambda b, draw: _fill(b["self"], transform(b, draw, b["self"]))


def _functional(transform: Transform) -> Handler:
    """A handler returning a new tensor like ``self`` holding ``transform(args, draw, that tensor)``."""
    def run(b: dict[str, Any], draw: Draw) -> torch.Tensor:
        out = torch.empty_like(b["self"])
        return _fill(out, transform(b, draw, out))
    return run


def _uniform(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    low, high = float(b["from"]), float(b["to"])
    return _u(d, t.shape, t.dtype, t.device) * (high - low) + low


def _normal_t(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    return _normal(d, t.shape, t.dtype, t.device) * float(b["std"]) + float(b["mean"])


def _exponential(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    return -torch.log1p(-_u(d, t.shape, t.dtype, t.device)) / float(b["lambd"])


def _cauchy(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    scaled = torch.tan(math.pi * (_u(d, t.shape, t.dtype, t.device) - 0.5)) * float(b["sigma"])
    return scaled + float(b["median"])


def _log_normal(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    return torch.exp(_normal(d, t.shape, t.dtype, t.device) * float(b["std"]) + float(b["mean"]))


def _geometric(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    u = d.uniform(t.shape, double=True, device=t.device)
    return torch.clamp(torch.ceil(torch.log1p(-u) / math.log1p(-b["p"])), min=1)


def _random(b: dict[str, Any], d: Draw, t: torch.Tensor) -> torch.Tensor:
    low, high = _full_range(t.dtype)
    if b.get("to") is not None:
        low, high = float(b.get("from") or 0), float(b["to"])
    return _integers(d, t.shape, low, high, t.device)


def _broadcast(tensors: list[torch.Tensor]) -> torch.Size:
    """The shape ``tensors`` broadcast to."""
    shape = torch.Size()
    for t in tensors:
        shape = (torch.zeros(shape, device="meta") + torch.zeros(t.shape, device="meta")).shape
    return shape


def _normal_op(b: dict[str, Any], draw: Draw) -> torch.Tensor:
    """``torch.normal(mean, std)`` with tensors or floats, or of a ``size``."""
    mean, std = b["mean"], b["std"]
    if b.get("size") is not None:
        out = _factory(b, b["size"])
    else:
        tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
        out = torch.empty(_broadcast(tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    return _fill(out, _normal(draw, out.shape, out.dtype, out.device) * std + mean)


def _fill_new(out: torch.Tensor, draw: Draw,
              values: Callable[[Draw, torch.Size, torch.dtype, torch.device], torch.Tensor]) -> torch.Tensor:
    """``out`` (a new tensor) filled with ``values(draw, its shape, dtype, device)``."""
    return _fill(out, values(draw, out.shape, out.dtype, out.device))


def _randint(b: dict[str, Any], draw: Draw, out: torch.Tensor) -> torch.Tensor:
    high = b["high"]
    high = high.item() if isinstance(high, torch.Tensor) else high
    return _fill(out, _integers(draw, out.shape, float(b.get("low") or 0), float(high), out.device))


HANDLERS: dict[Any, Handler] = {
    torch.ops.aten.bernoulli_: lambda b, d: _bernoulli_into(b["self"], b["p"], d),
    torch.ops.aten.bernoulli: lambda b, d: _bernoulli_into(
        torch.empty_like(b["self"]), b["p"] if b.get("p") is not None else b["self"], d),
    torch.ops.aten.native_dropout: lambda b, d: _native_dropout(b, d),
    torch.ops.aten.uniform_: _in_place(_uniform),
    torch.ops.aten.uniform: _functional(_uniform),
    torch.ops.aten.normal_: _in_place(_normal_t),
    torch.ops.aten.normal: _normal_op,
    torch.ops.aten.exponential_: _in_place(_exponential),
    torch.ops.aten.exponential: _functional(_exponential),
    torch.ops.aten.cauchy_: _in_place(_cauchy),
    torch.ops.aten.cauchy: _functional(_cauchy),
    torch.ops.aten.log_normal_: _in_place(_log_normal),
    torch.ops.aten.log_normal: _functional(_log_normal),
    torch.ops.aten.geometric_: _in_place(_geometric),
    torch.ops.aten.geometric: _functional(_geometric),
    torch.ops.aten.random_: _in_place(_random),
    torch.ops.aten.rand: lambda b, d: _fill_new(_factory(b, b["size"]), d, _u),
    torch.ops.aten.rand_like: lambda b, d: _fill_new(_like(b), d, _u),
    torch.ops.aten.randn: lambda b, d: _fill_new(_factory(b, b["size"]), d, _normal),
    torch.ops.aten.randn_like: lambda b, d: _fill_new(_like(b), d, _normal),
    torch.ops.aten.randint: lambda b, d: _randint(b, d, _factory(b, b["size"], torch.int64)),
    torch.ops.aten.randint_like: lambda b, d: _randint(b, d, _like(b)),
}


def prepare(func: torch._ops.OpOverload, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[dict[str, Any], torch.Size] | None:
    """The op's arguments by name and the shape it draws, or None when no handler here implements it."""
    packet = func.overloadpacket
    if packet not in HANDLERS:
        return None
    b = _bind(func, args, kwargs)
    if packet is torch.ops.aten.native_dropout and b["train"] is False:
        return None  # no draw: torch's own answer
    if b.get("size") is not None:
        return b, torch.Size(list(b["size"]))
    for name in ("self", "input"):
        if isinstance(b.get(name), torch.Tensor):
            return b, b[name].shape
    tensors = [t for t in (b.get("mean"), b.get("std")) if isinstance(t, torch.Tensor)]
    return b, _broadcast(tensors)


def run(func: torch._ops.OpOverload, bound: dict[str, Any], draw: Draw) -> Any:
    """The op's result computed from ``draw`` (``bound``: :func:`prepare`'s arguments)."""
    return HANDLERS[func.overloadpacket](bound, draw)


@contextmanager
def seeded(key: DrawKey, args: tuple[Any, ...]) -> Any:
    """Inside: the generators of the CPU and of the devices of ``args``' tensors seeded from ``key``."""
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    k1, k2, _ = key.words()
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed((k1 << 32) | k2)
        yield
