"""Tensor parallelism for the layers torch's styles do not cover: transposed (``Conv1D``) and packed.

Two shapes of projection appear in real models and not in ``ColwiseParallel``/``RowwiseParallel``:

* **Transposed linears.** Hugging Face's ``Conv1D`` (GPT-2, GPT, CTRL...) stores its weight as
  ``(in, out)`` and computes ``addmm(bias, x, weight)``. Column-parallel splits dim 1 of the
  weight (and the bias), row-parallel dim 0. Recognised by duck typing (``nf``/``nx`` and a
  weight of shape ``(nx, nf)``), so no ``transformers`` import is needed.
* **Packed outputs.** A fused projection computes several things side by side: GPT-2's
  ``c_attn`` is ``[q | k | v]``, Phi-3's ``gate_up_proj`` ``[gate | up]``. A plain split of the
  output features would give rank 0 all of ``q`` and rank 1 ``k`` and ``v``: still correct under
  DTensor's global semantics, but then the split of the output into q/k/v gathers everything and
  attention runs whole on every rank. Instead the weight is sharded as ``_StridedShard(dim,
  split_factor=n)``: each of the ``n`` equal parts is split over the ranks, and rank ``r`` holds
  its slice of every part (``[q_r | k_r | v_r]``), so each rank has whole heads of q, k and v.
  DTensor propagates that placement through the matmul and through reshapes; what it does not
  do is see that the user's ``split``/``chunk`` into the ``n`` parts gives plain ``Shard``
  pieces (it all-gathers there). :func:`split_packed` does that one step exactly, and the
  region mode (:class:`~lightning_parallel.parallel.tensor.attention.ReplicateMixedMode`) calls it.

Why correctness never rests on the packing guess: a placement only describes how the true
global tensor is distributed, and DTensor computes the global result for any placement. A
wrong split factor costs communication, not correctness; :func:`split_packed` only answers a
split that is exactly the ``n`` parts of a ``_StridedShard(n)`` tensor, which is exact by
definition of that placement.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.compat import StridedShard

_ATEN = torch.ops.aten
# The user's calls (eager regions) and the ATen overloads a traced pipeline stage calls for them.
_SPLITS: frozenset[Callable[..., Any]] = frozenset({Tensor.split, torch.split, Tensor.chunk, torch.chunk,
                                                   _ATEN.split.Tensor, _ATEN.split_with_sizes.default, _ATEN.chunk.default})
_CHUNKS = frozenset({Tensor.chunk, torch.chunk, _ATEN.chunk.default})
_SIZES_NAME = {_ATEN.split.Tensor: "split_size", _ATEN.split_with_sizes.default: "split_sizes"}


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (a linear with a transposed ``(in, out)`` weight), duck-typed."""
    weight = getattr(module, "weight", None)
    nf, nx = getattr(module, "nf", None), getattr(module, "nx", None)
    return (
        type(module).__name__ == "Conv1D" and isinstance(nf, int) and isinstance(nx, int)
        and isinstance(weight, Tensor) and tuple(weight.shape) == (nx, nf)
    )


def is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.nx, module.nf  # type: ignore[return-value]
    return module.in_features, module.out_features  # type: ignore[return-value]


def shard_placement(dim: int, split_factor: int) -> Placement:
    """``Shard(dim)``, or ``_StridedShard`` when the dim packs ``split_factor`` equal parts."""
    return Shard(dim) if split_factor <= 1 else StridedShard(dim, split_factor=split_factor)


def packed_placement(dim: int, split_factor: int, ndim: int, split_bias: bool = False) -> Placement:
    """A column-parallel parameter's placement: a packed *bias* stays whole (``Replicate``) unless
    ``split_bias`` (no FSDP2 shards the parameters beside tp: the plan's ``packed_biases_split``).

    Why: FSDP2 shards dim 0, the only dim of a bias, and does not compose with a
    ``_StridedShard`` tensor-parallel placement on the same dim (measured: dp2 x tp2 zero3 on
    GPT-2 trained ``c_attn.bias`` to a relative error of 1.25). A whole bias costs a few
    elements; added to the ``_StridedShard`` matmul output, DTensor takes each rank's slice
    locally, but its gradient comes back whole: one all-gather per packed layer in every backward,
    which a split bias does not need.
    """
    if split_factor > 1 and ndim == 1 and not split_bias:
        return Replicate()
    return shard_placement(dim, split_factor)


def colwise_dims(module: nn.Module) -> dict[str, int]:
    """The dim each parameter splits along when ``module`` is column-parallel."""
    return {"weight": 1 if is_conv1d(module) else 0, "bias": 0}


def rowwise_dims(module: nn.Module) -> dict[str, int]:
    """The dim each parameter splits along when ``module`` is row-parallel (the bias stays whole)."""
    return {"weight": 0 if is_conv1d(module) else 1}


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``nn.Linear`` or ``Conv1D``, with a packed output (``split_factor`` parts).

    The output is sharded along its last dim the way the weight is (``_StridedShard`` when
    packed), so no redistribution happens after the matmul.
    """

    def __init__(self, *, split_factor: int = 1, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True, split_bias: bool = False) -> None:
        self.split_factor, self.split_bias = split_factor, split_bias
        super().__init__(input_layouts=input_layouts, use_local_output=use_local_output,
                         output_layouts=output_layouts or shard_placement(-1, split_factor))

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        dims = colwise_dims(module)
        for local, param in list(module.named_parameters(recurse=False)):
            placement = packed_placement(dims[local], self.split_factor, param.ndim, self.split_bias)
            module.register_parameter(local, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            ))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``Conv1D``: weight split along dim 0 (its input features), bias whole."""

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for local, param in list(module.named_parameters(recurse=False)):
            placement: Placement = Shard(0) if local == "weight" else Replicate()
            module.register_parameter(local, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            ))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        desired: tuple[Placement, ...] = (Shard(-1),)  # as torch's RowwiseParallel for nn.Linear
        self.desired_input_layouts = desired
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, desired),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _strided(x: Any) -> StridedShard | None:
    if isinstance(x, DTensor) and x.device_mesh.ndim == 1 and isinstance(x.placements[0], StridedShard):
        return x.placements[0]
    return None


def split_args(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, int] | None:
    """(size_or_sections, dim) of a ``split``/``chunk`` call, or None if it has other arguments."""
    names = ("chunks", "dim") if func in _CHUNKS else ("split_size_or_sections", "dim")
    alt = {"split_size": "split_size_or_sections", _SIZES_NAME.get(func, "split_size"): "split_size_or_sections"}
    bound = dict(zip(names, args[1:]))
    for key, value in kwargs.items():
        key = alt.get(key, key)
        if key not in names or key in bound:
            return None
        bound[key] = value
    if names[0] not in bound:
        return None
    return bound[names[0]], int(bound.get("dim", 0))


def split_packed(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[DTensor, ...] | None:
    """The ``n`` parts of a ``_StridedShard(n)`` DTensor as ``Shard`` DTensors, or None.

    Answers ``x.split(size, dim)``, ``x.split([s] * n, dim)`` and ``x.chunk(n, dim)`` (or the
    ``aten.split``/``split_with_sizes``/``chunk`` a traced pipeline stage calls) exactly when
    they cut ``x`` into the ``n`` equal parts of its packed dim; any other call is left to
    DTensor (which gathers, correctly). Differentiable: the pieces are views of the local tensor.
    """
    if func not in _SPLITS or not args:
        return None
    x = args[0]
    placement = _strided(x)
    if placement is None:
        return None
    parsed = split_args(func, args, kwargs)
    if parsed is None:
        return None
    arg, dim = parsed
    dim %= x.ndim
    n = placement.split_factor
    if dim != placement.dim % x.ndim or x.shape[dim] % n:
        return None
    part = x.shape[dim] // n
    if func in _CHUNKS:
        exact = arg == n
    elif isinstance(arg, int):
        exact = arg == part
    else:
        exact = list(arg) == [part] * n
    return _parts(x, dim, n) if exact else None


def _parts(x: DTensor, dim: int, n: int) -> tuple[DTensor, ...] | None:
    """The ``n`` parts of packed ``x`` along ``dim`` as ``Shard(dim)`` DTensors: views of this rank's
    shard (``[q_r | k_r | v_r]``), no communication; None if the shard does not cut evenly."""
    local = x.to_local()
    if local.shape[dim] % n:
        return None
    return tuple(DTensor.from_local(p, x.device_mesh, [Shard(dim)], run_check=False) for p in local.chunk(n, dim=dim))


def slice_bounds(func: Callable[..., Any], args: tuple, kwargs: dict, ndim: int) -> tuple[int, Any, Any] | None:
    """(dim, start, stop) of a one-dim, step-1 slice (``x[..., a:b]`` or ``aten.slice``), else None."""
    if func is _ATEN.slice.Tensor:
        names = ("dim", "start", "end", "step")
        bound = {"dim": 0, "start": None, "end": None, "step": 1} | dict(zip(names, args[1:])) | kwargs
        return (int(bound["dim"]), bound["start"], bound["end"]) if bound["step"] == 1 and set(bound) <= set(names) else None
    if func is not Tensor.__getitem__ or len(args) != 2 or kwargs:
        return None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if sum(i is Ellipsis for i in index) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return None
    cut = [k for k, i in enumerate(index) if isinstance(i, slice) and i != slice(None)]
    if len(cut) != 1 or index[cut[0]].step not in (None, 1):
        return None
    k = cut[0]
    after_ellipsis = any(i is Ellipsis for i in index[:k])
    dim = ndim - (len(index) - k) if after_ellipsis else k
    return dim, index[k].start, index[k].stop


def slice_packed(func: Callable[..., Any], args: tuple, kwargs: dict) -> DTensor | None:
    """Part ``i`` of a ``_StridedShard(n)`` DTensor as a ``Shard`` DTensor when a slice takes exactly
    that part (Phi-3 cuts ``[q | k | v]`` as ``qkv[..., :q_end]``...), else None (DTensor gathers).

    The slice counterpart of :func:`split_packed`, for the same reason and with the same exactness:
    the bounds must be those of one of the ``n`` equal parts."""
    x = args[0] if args else None
    placement = _strided(x)
    if placement is None:
        return None
    bounds = slice_bounds(func, args, kwargs, x.ndim)
    if bounds is None:
        return None
    dim, start, stop = bounds
    dim %= x.ndim
    size, n = x.shape[dim], placement.split_factor
    if dim != placement.dim % x.ndim or size % n or not all(b is None or isinstance(b, int) for b in (start, stop)):
        return None
    start = 0 if start is None else start + size if start < 0 else start
    stop = size if stop is None else min(stop + size if stop < 0 else stop, size)
    part = size // n
    if start % part or stop - start != part:
        return None
    parts = _parts(x, dim, n)
    return parts[start // part] if parts is not None else None


__all__ = [
    "Conv1DRowwiseParallel",
    "FusedColwiseParallel",
    "colwise_dims",
    "features",
    "is_conv1d",
    "is_linear_like",
    "packed_placement",
    "rowwise_dims",
    "shard_placement",
    "slice_packed",
    "split_packed",
]
