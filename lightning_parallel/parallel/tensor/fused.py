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

_SPLITS: frozenset[Callable[..., Any]] = frozenset({Tensor.split, torch.split, Tensor.chunk, torch.chunk})


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


def packed_placement(dim: int, split_factor: int, ndim: int) -> Placement:
    """A column-parallel parameter's placement: a packed *bias* stays whole (``Replicate``).

    Why: FSDP2 shards dim 0, the only dim of a bias, and does not compose with a
    ``_StridedShard`` tensor-parallel placement on the same dim (measured: dp2 x tp2 zero3 on
    GPT-2 trained ``c_attn.bias`` to a relative error of 1.25). A whole bias costs a few
    elements; added to the ``_StridedShard`` matmul output, DTensor takes each rank's slice
    locally, and its gradient comes back whole.
    """
    if split_factor > 1 and ndim == 1:
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
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.split_factor = split_factor
        super().__init__(input_layouts=input_layouts, use_local_output=use_local_output,
                         output_layouts=output_layouts or shard_placement(-1, split_factor))

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        dims = colwise_dims(module)
        for local, param in list(module.named_parameters(recurse=False)):
            placement = packed_placement(dims[local], self.split_factor, param.ndim)
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


def _split_args(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, int] | None:
    """(size_or_sections, dim) of a ``split``/``chunk`` call, or None if it has other arguments."""
    names = ("chunks", "dim") if func in (Tensor.chunk, torch.chunk) else ("split_size_or_sections", "dim")
    alt = {"split_size": "split_size_or_sections"}
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

    Answers ``x.split(size, dim)``, ``x.split([s] * n, dim)`` and ``x.chunk(n, dim)`` exactly when
    they cut ``x`` into the ``n`` equal parts of its packed dim; any other call is left to
    DTensor (which gathers, correctly). Differentiable: the pieces are views of the local tensor.
    """
    if func not in _SPLITS or not args:
        return None
    x = args[0]
    placement = _strided(x)
    if placement is None:
        return None
    parsed = _split_args(func, args, kwargs)
    if parsed is None:
        return None
    arg, dim = parsed
    dim %= x.ndim
    n = placement.split_factor
    if dim != placement.dim % x.ndim or x.shape[dim] % n:
        return None
    part = x.shape[dim] // n
    if func in (Tensor.chunk, torch.chunk):
        exact = arg == n
    elif isinstance(arg, int):
        exact = arg == part
    else:
        exact = list(arg) == [part] * n
    if not exact:
        return None
    local = x.to_local()
    if local.shape[dim] % n:
        return None
    mesh = x.device_mesh
    return tuple(DTensor.from_local(p, mesh, [Shard(dim)], run_check=False) for p in local.chunk(n, dim=dim))


def _contiguous_placements(x: DTensor) -> list[Placement]:
    return [Shard(p.dim) if isinstance(p, StridedShard) else p for p in x.placements]


def checkpoint_layout(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every ``_StridedShard`` DTensor redistributed to plain ``Shard`` on the same dim.

    Why: ``torch.distributed.checkpoint`` writes each rank's piece as one box of the global
    tensor, and a packed parameter's piece (``[q_r | k_r | v_r]``) is several boxes; ``dcp.save``
    refuses it ("overlapping chunks"). Plain ``Shard`` is one box and holds the same values, so
    a checkpoint written this way loads under any layout. Use the result (or, for loading, the
    result as the template ``dcp.load`` fills) and :func:`restore_layout` after loading.
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = checkpoint_layout(value)
        elif isinstance(value, DTensor) and any(isinstance(p, StridedShard) for p in value.placements):
            out[key] = value.redistribute(value.device_mesh, _contiguous_placements(value))
        else:
            out[key] = value
    return out


def restore_layout(loaded: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """``loaded`` (filled from a :func:`checkpoint_layout` template) back in ``target``'s placements."""
    out: dict[str, Any] = {}
    for key, value in loaded.items():
        goal = target.get(key)
        if isinstance(value, dict) and isinstance(goal, dict):
            out[key] = restore_layout(value, goal)
        elif isinstance(value, DTensor) and isinstance(goal, DTensor) and tuple(goal.placements) != tuple(value.placements):
            out[key] = value.redistribute(goal.device_mesh, goal.placements)
        else:
            out[key] = value
    return out


__all__ = [
    "Conv1DRowwiseParallel",
    "checkpoint_layout",
    "restore_layout",
    "FusedColwiseParallel",
    "colwise_dims",
    "features",
    "is_conv1d",
    "is_linear_like",
    "packed_placement",
    "rowwise_dims",
    "shard_placement",
    "split_packed",
]
