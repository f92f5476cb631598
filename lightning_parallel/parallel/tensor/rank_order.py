"""Packed projections of *unequal* parts split per part: Phi-3's grouped-query ``[q | k | v]``.

Phi-3's ``qkv_proj`` computes ``[q | k | v]`` side by side with ``q`` wider than ``k`` and ``v``
(more query heads than key/value heads), and the model cuts the output with slices
(``qkv[..., :q_end]``...). Tensor parallelism needs rank ``r`` to hold its query heads *and*
the key/value heads they read: slice ``r`` of every part, ``[q_r | k_r | v_r]``. For equal parts
that is DTensor's ``_StridedShard(dim, n)`` (:mod:`~lightning_parallel.parallel.tensor.fused`);
for unequal parts no DTensor placement of the model's row order describes it (a placement
splits equal blocks), and the alternative, an all-gather of the projection's output in every
forward and of its gradient in every backward, is what Hugging Face's declared plan does
(``colwise_gather_output``: 1.42x the Megatron minimum on Phi-3 under tp2).

So the weight is *stored in rank order*: its rows permuted so that a plain ``Shard(0)`` gives
rank ``r`` exactly ``[q_r | k_r | v_r]`` (Megatron stores its fused grouped-query projection
per group the same way and converts Hugging Face checkpoints by this permutation). A rank-ordered
DTensor is honest about its own values (DTensor computes on them exactly), but its global row
order is not the model's: :class:`RankOrder` says how the two relate, and every place where
values cross between the model's order and the stored one converts (tensor-parallel setup,
meta-device materialisation, pretrained weights, checkpoints and their optimizer states,
gathered parameters). Inside a region the output of such a linear carries the same mark: the
model's slices that take exactly one part are answered from the local shard (a view, no
communication), and any other use of it first turns it into the model's order, whole (an
all-gather: correct, never a wrong value).

Used only where no FSDP2 shards the parameter beside tp (FSDP2 composes its own dim-0 split with
the tensor-parallel one and sees plain rows), and only for ``nn.Linear`` columns inside a region.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_parallel.parallel.tensor.fused import FusedColwiseParallel, slice_bounds, split_args

_ATTR = "_lp_rank_order"
_ATEN = torch.ops.aten
_LINEARS = frozenset({F.linear, _ATEN.linear.default})
_SPLITS = frozenset({Tensor.split, torch.split, _ATEN.split_with_sizes.default})
_SLICES = frozenset({Tensor.__getitem__, _ATEN.slice.Tensor})


@dataclass(frozen=True)
class RankOrder:
    """Dim ``dim`` packs parts of ``sizes``, stored so that each of ``ranks`` equal blocks is one
    rank's slice of every part (``[p0_r | p1_r | ...]`` for ``r`` in order)."""

    dim: int
    sizes: tuple[int, ...]
    ranks: int

    def _pieces(self) -> list[int]:
        return [s // self.ranks for s in self.sizes]

    def stored(self, natural: Tensor) -> Tensor:
        """The model's order -> rank order (a copy)."""
        dim = self.dim % natural.ndim
        parts = [p.chunk(self.ranks, dim) for p in natural.split(list(self.sizes), dim)]
        return torch.cat([parts[p][r] for r in range(self.ranks) for p in range(len(self.sizes))], dim)

    def natural(self, stored: Tensor) -> Tensor:
        """Rank order -> the model's order (a copy; differentiable)."""
        dim = self.dim % stored.ndim
        n = len(self.sizes)
        pieces = stored.split(self._pieces() * self.ranks, dim)
        return torch.cat([pieces[r * n + p] for p in range(n) for r in range(self.ranks)], dim)

    def stored_index(self) -> Tensor:
        """Which row of the model's order each stored row holds (for reading pretrained rows)."""
        return self.stored(torch.arange(sum(self.sizes)))

    def local_parts(self, local: Tensor) -> tuple[Tensor, ...]:
        """One rank's shard cut into its slice of each part (views)."""
        return local.split(self._pieces(), self.dim % local.ndim)


def rank_order(x: Any) -> RankOrder | None:
    """The mark of a rank-ordered DTensor (a parameter, or a region's linear output), else None."""
    return getattr(x, _ATTR, None) if isinstance(x, DTensor) else None


def mark(x: DTensor, order: RankOrder) -> DTensor:
    """Mark ``x`` as stored in ``order`` (an attribute of this DTensor object: a detached copy needs :func:`carry`)."""
    setattr(x, _ATTR, order)
    return x


def natural_value(x: DTensor) -> DTensor:
    """A rank-ordered DTensor in the model's order, replicated (a differentiable all-gather)."""
    order = rank_order(x)
    if order is None:
        return x
    mesh = x.device_mesh
    return DTensor.from_local(order.natural(x.full_tensor()), mesh, [Replicate()] * mesh.ndim, run_check=False)


def carry(source: Any, target: Tensor) -> Tensor:
    """``target`` (a detached copy or view of ``source``) marked as ``source`` is."""
    order = rank_order(source)
    return mark(target, order) if order is not None and isinstance(target, DTensor) else target


def mark_states(param: Any, entries: dict[str, Any]) -> dict[str, Any]:
    """Mark the optimizer state tensors of a rank-ordered parameter that are laid out like it
    (momentum, Adam's moments; not its step count): they hold its rows in the same order."""
    order = rank_order(param)
    if order is not None:
        for value in entries.values():
            if isinstance(value, DTensor) and value.shape == param.shape:
                mark(value, order)
    return entries


def stored_whole(target: Any, whole: Tensor) -> Tensor:
    """A whole value in the model's order, reordered for a rank-ordered ``target`` to be split like it."""
    order = rank_order(target)
    return order.stored(whole) if order is not None else whole


def full_natural(x: DTensor) -> Tensor:
    """``x.full_tensor()`` in the model's order (a collective): for reading a parameter whole."""
    order = rank_order(x)
    full = x.full_tensor()
    return order.natural(full) if order is not None else full


def mark_linear_output(func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> Any:
    """Mark ``F.linear``'s output when its weight is rank-ordered: its last dim is then in rank order."""
    if not isinstance(out, DTensor) or not rank_ordered_linear(func, args, kwargs):
        return out
    order = rank_order(args[1] if len(args) > 1 else kwargs.get("weight"))
    if order is not None and order.dim == 0:
        mark(out, RankOrder(out.ndim - 1, order.sizes, order.ranks))
    return out


def rank_ordered_linear(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """``F.linear`` of a rank-ordered weight (its output is marked, not its weight made whole)."""
    if func not in _LINEARS:
        return False
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    x = args[0] if args else kwargs.get("input")
    return rank_order(weight) is not None and rank_order(x) is None


def _natural_bounds(order: RankOrder) -> list[tuple[int, int]]:
    edges = [sum(order.sizes[:i]) for i in range(len(order.sizes) + 1)]
    return list(zip(edges, edges[1:]))


def cut_rank_ordered(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The model's cut of a rank-ordered output into its parts, answered from the local shard
    (``Shard`` DTensors of each part, views), or None when the call is not exactly such a cut."""
    x = args[0] if args else None
    order = rank_order(x)
    if order is None or x.device_mesh.ndim != 1 or x.placements[0] != Shard(order.dim % x.ndim):
        return None
    dim = order.dim % x.ndim

    def pieces() -> list[DTensor]:
        return [DTensor.from_local(p, x.device_mesh, [Shard(dim)], run_check=False) for p in order.local_parts(x.to_local())]

    if func in _SPLITS:
        parsed = split_args(func, args, kwargs)
        if parsed is not None and parsed[1] % x.ndim == dim and not isinstance(parsed[0], int) \
                and list(parsed[0]) == list(order.sizes):
            return tuple(pieces())
        return None
    if func in _SLICES:
        bounds = slice_bounds(func, args, kwargs, x.ndim)
        if bounds is None or bounds[0] % x.ndim != dim or not all(b is None or isinstance(b, int) for b in bounds[1:]):
            return None
        size, start, stop = x.shape[dim], bounds[1], bounds[2]
        start = 0 if start is None else start + size if start < 0 else start
        stop = size if stop is None else min(stop + size if stop < 0 else stop, size)
        cuts = _natural_bounds(order)
        if (start, stop) in cuts:
            return pieces()[cuts.index((start, stop))]
    return None


# Same-layout calls that are not tagged pointwise in ATen (casts, copies, dropout).
_LAYOUT_KEEPING = frozenset({"to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "detach",
                             "dropout", "_to_copy", "native_dropout"})
_POINTWISE: dict[str, bool] = {}


def _pointwise(func: Callable[..., Any]) -> bool:
    """An elementwise op (ATen's ``pointwise`` tag, looked up by name for the user's calls): it acts
    on each element where it lies, so it keeps a rank order as it is."""
    if hasattr(func, "overloadpacket"):  # an ATen overload (a traced pipeline stage's call)
        return torch.Tag.pointwise in func.tags or func.overloadpacket.__name__ in _LAYOUT_KEEPING
    name = getattr(func, "__name__", "").strip("_")
    if name not in _POINTWISE:
        packet = getattr(_ATEN, name, None)
        _POINTWISE[name] = name in _LAYOUT_KEEPING or (packet is not None and any(
            torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()))
    return _POINTWISE[name]


def elementwise_rank_ordered(func: Callable[..., Any], args: tuple, kwargs: dict, call: Callable[..., Any]) -> Any:
    """An elementwise op on one rank-ordered tensor (DBRX clamps its ``[q | k | v]`` before cutting it)
    run on it as it is, its output marked alike; None when that is not the call."""
    x = args[0] if args else None
    order = rank_order(x)
    if order is None or not _pointwise(func) or any(isinstance(a, Tensor) for a in (*args[1:], *kwargs.values())):
        return None
    out = call(func, args, kwargs)
    if isinstance(out, DTensor) and out.shape == x.shape and out.placements == x.placements:
        return mark(out, order)
    return call(func, (natural_value(x), *args[1:]), kwargs)  # it did not keep the layout: on the whole value


def _marked(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(rank_order(v) is not None for v in value)
    return rank_order(value) is not None


def _natural(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(natural_value(v) if rank_order(v) is not None else v for v in value)
    return natural_value(value) if rank_order(value) is not None else value


def natural_arguments(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Any rank-ordered DTensor among the arguments (or in a list of them) in the model's order,
    whole: what a call the region does not answer from the shard sees."""
    if getattr(func, "__name__", None) == "__get__":
        return args, kwargs  # a property read (``.shape``, ``.device``): no values
    return tuple(_natural(a) for a in args), {k: _natural(v) for k, v in kwargs.items()}


def rank_ordered_call(func: Callable[..., Any], args: tuple, kwargs: dict,
                      call: Callable[..., Any]) -> tuple[Any, tuple, dict]:
    """What a region does with a call that reads a rank-ordered DTensor: ``(result, args, kwargs)``,
    the result when the call is answered here (a cut into the parts, an elementwise op), else None
    with the arguments the call should run on (a linear of a rank-ordered weight: as they are;
    anything else: in the model's order). One scan of the arguments when none is marked, the
    common case: the region's hot path pays nothing more."""
    if not any(_marked(a) for a in (*args, *kwargs.values())):
        return None, args, kwargs
    out = cut_rank_ordered(func, args, kwargs)
    if out is None:
        out = elementwise_rank_ordered(func, args, kwargs, call)
    if out is not None or rank_ordered_linear(func, args, kwargs):
        return out, args, kwargs
    return (None, *natural_arguments(func, args, kwargs))


class RankOrderedColwise(FusedColwiseParallel):
    """Column parallelism for an ``nn.Linear`` whose output packs parts of ``sizes``: its weight and
    bias stored in rank order and split ``Shard(0)``, marked; its output a marked DTensor (module doc)."""

    def __init__(self, *, sizes: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(split_factor=1, use_local_output=False, **kwargs)
        self.sizes = tuple(sizes)

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        order = RankOrder(0, self.sizes, device_mesh.size())
        for local, param in list(module.named_parameters(recurse=False)):
            stored = distribute_tensor(order.stored(param.detach()), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(local, mark(nn.Parameter(stored, requires_grad=param.requires_grad), order))

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        # As torch's colwise output (use_local_output is False here), keeping the mark: a redistribute,
        # even to the same placement under another dim index, returns a new DTensor.
        order = rank_order(outputs)
        if tuple(outputs.placements) != tuple(output_layouts):
            outputs = outputs.redistribute(placements=output_layouts)
        return mark(outputs, order) if order is not None else outputs


__all__ = [
    "RankOrder", "RankOrderedColwise", "carry", "cut_rank_ordered", "elementwise_rank_ordered", "full_natural", "mark",
    "mark_linear_output", "mark_states", "natural_arguments", "natural_value", "rank_order", "rank_ordered_call",
    "rank_ordered_linear", "stored_whole",
]
