"""Tensor parallelism inside Hugging Face mixture-of-experts modules: every expert split over tp.

Hugging Face (transformers 5) stores a layer's experts as two 3-D parameters of one module
(``MixtralExperts``, ``Qwen2MoeExperts``, ``OlmoeExperts``, ...): ``gate_up_proj`` of shape
``(E, 2*I, H)`` (gate rows, then up rows) and ``down_proj`` of shape ``(E, H, I)``, and its
forward loops over the experts with ``F.linear`` and ``chunk(2, -1)``. Their own plan names this
``moe_tp_experts`` (with ``packed_colwise`` on ``gate_up_proj`` and ``rowwise`` on ``down_proj``).

The Megatron split applies per expert: each rank keeps ``I / tp`` intermediate features of every
expert. ``gate_up_proj`` is packed (``[gate | up]``), so it is sharded ``_StridedShard(1, 2)``
(rank ``r`` holds ``[gate_r | up_r]`` and the expert's own ``chunk(2, -1)`` splits it right);
``down_proj`` is ``Shard(2)``. The forward runs on the *local* parameters (the expert loop
indexes, gathers and ``index_add_``s, which DTensor would gather), its partial output is summed
over the tp ranks (all-reduce forward), and the gradients of the replicated inputs (hidden
states, routing weights) are summed in the backward: each rank's input gradient is only its
features' share. Both arrive in one backward call and are summed in one all-reduce (one per
dtype), not one each: the Megatron minimum of one backward reduction per region. Parameters stay
DTensors with full-model semantics, so ``state_dict``, clipping and checkpoints see the true
global tensors.

The router stays replicated (it is small and its top-k must agree on every rank).

GPT-OSS stores its experts transposed (``is_transposed``), gate and up interleaved column by
column (``is_concatenated=False``), with a bias on each projection (:func:`expert_shards` says how
each is split; its down-projection bias is added once, on the first tp rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.fused import shard_placement
from lightning_parallel.parallel.tensor.region_inputs import is_replicated


_PARAMS = frozenset({"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"})


def experts_layout(module: nn.Module) -> tuple[int, int, int] | None:
    """(experts E, hidden H, intermediate I) of a Hugging Face experts module, else None: the layout
    above, or transposed (``is_transposed``: ``gate_up_proj`` ``(E, H, 2*I)``, ``down_proj`` ``(E, I, H)``,
    GPT-OSS), each optionally with biases ``gate_up_proj_bias`` ``(E, 2*I)`` and ``down_proj_bias`` ``(E, H)``."""
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or set(params) - _PARAMS or gate_up.ndim != 3 or down.ndim != 3:
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    e, a, b = gate_up.shape
    h, two_i = (a, b) if transposed else (b, a)
    if two_i % 2 or tuple(down.shape) != ((e, two_i // 2, h) if transposed else (e, h, two_i // 2)):
        return None
    biases = {"gate_up_proj_bias": (e, two_i), "down_proj_bias": (e, h)}
    if any(name in params and tuple(params[name].shape) != shape for name, shape in biases.items()):
        return None
    return e, h, two_i // 2


def experts_reason(module: nn.Module) -> str | None:
    """Why ``module`` (a module owning 3-D expert parameters) cannot be split, or None if it can."""
    if experts_layout(module) is not None:
        return None
    names = [f"{n}{tuple(p.shape)}" for n, p in module.named_parameters(recurse=False)]
    return (
        f"experts parameters {names} are not the (E, 2*I, H) gate_up_proj + (E, H, I) down_proj layout "
        "(or its transpose, with or without biases) this tensor-parallel split knows"
    )


def expert_shards(module: nn.Module) -> dict[str, tuple[int, int] | None]:
    """Parameter name -> (dim, split factor) it is split along, or None (whole), for an experts module.

    ``[gate | up]`` concatenated (``is_concatenated``, HF's default) is split per part (factor 2);
    gate and up interleaved column by column (GPT-OSS: ``gate_up[..., ::2]``) need a plain split, which
    keeps each pair on one rank. ``down_proj_bias`` is added after the split contraction: whole, and
    counted on one rank only (:meth:`ExpertsForward._run_local`)."""
    transposed = bool(getattr(module, "is_transposed", False))
    factor = 2 if getattr(module, "is_concatenated", True) else 1
    return {"gate_up_proj": (2 if transposed else 1, factor), "gate_up_proj_bias": (1, factor),
            "down_proj": (1 if transposed else 2, 1), "down_proj_bias": None}


def expert_placements(module: nn.Module) -> dict[str, Placement]:
    """Parameter name -> placement on the tensor-parallel mesh (see :func:`expert_shards`)."""
    return {name: Replicate() if shard is None else shard_placement(*shard) for name, shard in expert_shards(module).items()}


def _sum_partials(grads: list[Tensor], mesh: DeviceMesh) -> list[Tensor]:
    """Sum each rank's partial gradients over ``mesh``: one all-reduce per dtype, however many tensors."""
    out = list(grads)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([grads[i].reshape(-1) for i in indices])
        summed = DTensor.from_local(flat, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
        for i, piece in zip(indices, summed.split([grads[i].numel() for i in indices]), strict=True):
            out[i] = piece.view_as(grads[i])
    return out


class _SumInputGrads(torch.autograd.Function):
    """Identity on the experts' floating inputs; the backward sums their gradients over tp at once."""

    @staticmethod
    def forward(ctx: Any, mesh: DeviceMesh, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.mesh = mesh
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        present = [i for i, g in enumerate(grads) if g is not None]
        summed = _sum_partials([grads[i] for i in present], ctx.mesh) if present else []  # type: ignore[misc]
        out: list[Tensor | None] = list(grads)
        for i, g in zip(present, summed, strict=True):
            out[i] = g
        return (None, *out)


def _sum_grads(values: list[Any], mesh: DeviceMesh) -> list[Any]:
    """``values`` with every floating tensor that needs a gradient routed through one :class:`_SumInputGrads`."""
    picked = [i for i, v in enumerate(values) if isinstance(v, Tensor) and v.is_floating_point() and v.requires_grad]
    if not picked:
        return values
    out = list(values)
    for i, v in zip(picked, _SumInputGrads.apply(mesh, *(values[i] for i in picked)), strict=True):
        out[i] = v
    return out


class ExpertsForward:
    """Replaces an experts module's ``forward``: local expert shards, outputs summed over tp."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.original = type(module).forward
        self.mesh = mesh
        # Parameters added after the split contraction (kept whole): counted on the first tp rank only.
        self.whole = {name for name, shard in expert_shards(module).items() if shard is None}
        self.first = mesh.get_local_rank() == 0

    def _run_local(self, args: tuple, kwargs: dict) -> Any:
        """The class's own forward with each DTensor parameter swapped for its local shard.

        Not ``torch.func.functional_call``: it calls ``module(...)``, which would re-enter this
        wrapper. The swap is undone even if the forward raises; ``to_local`` is differentiable,
        so the gradients reach the DTensor parameters in their own placements.
        """
        module = self.module
        saved = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
        try:
            for name, param in saved.items():
                local = param.to_local()
                if name in self.whole and not self.first:  # added once to the partial sums: zero here, same gradient
                    local = local - local.detach()
                del module._parameters[name]
                object.__setattr__(module, name, local)  # an attribute, not a parameter
            return self.original(module, *args, **kwargs)
        finally:
            for name, param in saved.items():
                module.__dict__.pop(name, None)
                module._parameters[name] = param

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh = self.mesh
        keys = list(kwargs)
        # Inside a region (an MoE layer run on the gathered sequence under sequence parallelism) the
        # inputs are replicated DTensors: the experts' loop runs on their local (whole) values.
        given = (*args, *(kwargs[k] for k in keys))
        in_region = any(isinstance(v, DTensor) for v in given)
        values = [v.to_local() if isinstance(v, DTensor) and is_replicated(v) else v for v in given]
        values = _sum_grads(values, mesh)
        args, kwargs = tuple(values[: len(args)]), dict(zip(keys, values[len(args):], strict=True))
        out = self._run_local(args, kwargs)
        if not isinstance(out, Tensor):
            raise config_error(
                TypeError, "moe_tp_experts", type(self.module).__name__,
                f"the experts forward returned {type(out).__name__}, expected one tensor of partial outputs",
                "keep this module replicated with tp_plan={'<name>': 'replicate'}",
            )
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        # In a region the sum is left to the region's exit: under sequence parallelism a reduce-scatter
        # to the rank's slice of the sequence (Megatron's), not an all-reduce of the whole; code between
        # (a reshape) keeps it partial, anything non-linear reduces it first (DTensor's own rule).
        return partial if in_region else partial.redistribute(mesh, [Replicate()]).to_local()


def apply_experts_tensor_parallel(module: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``module`` (a Hugging Face experts module, see :func:`experts_layout`) over ``mesh`` in place."""
    placements = expert_placements(module)
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placements[name]]), requires_grad=param.requires_grad,
        ))
    module.forward = ExpertsForward(module, mesh)  # type: ignore[method-assign]


__all__ = ["ExpertsForward", "apply_experts_tensor_parallel", "expert_placements", "expert_shards", "experts_layout", "experts_reason"]
