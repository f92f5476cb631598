"""Which piece of each parameter a rank holds under a tensor-parallel plan, and the bytes that
makes per rank: read from shapes only, so the dry run and the planner use it on meta-device
models, and pipeline stages use it to slice parameters they materialise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_parallel.parallel.tensor.experts import expert_shards
from lightning_parallel.parallel.tensor.fused import colwise_dims, is_conv1d, rowwise_dims
from lightning_parallel.parallel.tensor.styles import (
    _COLUMN_STYLES,
    _ROW_STYLES,
    COLWISE,
    COLWISE_GATHER,
    EMBEDDING_COLWISE,
    EMBEDDING_ROWWISE,
    EXPERTS,
    HEAD_PARAMETERS,
    REPLICATE,
)

if TYPE_CHECKING:
    from lightning_parallel.parallel.tensor.plan import TensorParallelPlan


def sharded_dims(style: str, param_name: str) -> int | None:
    """The tensor dim a style splits for a parameter of an ``nn.Linear``/``nn.Embedding``/experts
    module (None: replicated). For any module type use :func:`param_shard`."""
    if style in (COLWISE, COLWISE_GATHER, EMBEDDING_ROWWISE):
        return 0
    if style == EMBEDDING_COLWISE:
        return 1 if param_name == "weight" else None
    if style == HEAD_PARAMETERS:
        return 0
    if style in _ROW_STYLES:
        return 1 if param_name == "weight" else None
    if style == EXPERTS:
        return {"gate_up_proj": 1, "down_proj": 2}.get(param_name)
    return None


def param_shard(plan_styles: dict[str, str], packed: dict[str, int], module: nn.Module, mod_name: str,
                param_name: str, packed_biases_split: bool = False) -> tuple[int, int] | None:
    """(dim, split factor) a plan splits a parameter along (None: replicated), for any module type.

    Split factor 1 is a plain ``Shard(dim)``; ``n > 1`` is ``_StridedShard(dim, n)`` (a packed
    output, or the experts' ``[gate | up]``). ``Conv1D`` stores its weight transposed. A packed
    bias stays whole unless ``packed_biases_split`` (no FSDP2 beside tp: ``tp_fused.packed_placement``).
    """
    style = plan_styles.get(mod_name, REPLICATE)
    factor = packed.get(mod_name, 1)
    if style in _COLUMN_STYLES and factor > 1 and param_name == "bias" and not packed_biases_split:
        return None  # a packed bias stays whole (see tp_fused.packed_placement)
    if style in _COLUMN_STYLES and is_conv1d(module):
        dim = colwise_dims(module).get(param_name)
        return None if dim is None else (dim, factor)
    if style in _ROW_STYLES and is_conv1d(module):
        dim = rowwise_dims(module).get(param_name)
        return None if dim is None else (dim, 1)
    if style == EXPERTS:
        return expert_shards(module).get(param_name)
    dim = sharded_dims(style, param_name)
    if dim is None:
        return None
    return dim, packed.get(mod_name, 1) if style in _COLUMN_STYLES else 1


def plan_param_shard(plan: TensorParallelPlan, module: nn.Module, mod_name: str, param_name: str) -> tuple[int, int] | None:
    """:func:`param_shard` for a resolved plan; ``module`` is the root the plan was resolved on."""
    return param_shard(plan.styles, plan.packed, module.get_submodule(mod_name), mod_name, param_name, plan.packed_biases_split)


def owned_params(module: nn.Module) -> list[tuple[str, str, nn.Parameter]]:
    """(module FQN, local name, parameter), each shared parameter once, at its first owner."""
    seen: set[int] = set()
    out = []
    for mod_name, mod in module.named_modules():
        for local, param in mod.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                out.append((mod_name, local, param))
    return out


def tp_param_bytes(module: nn.Module, plan: TensorParallelPlan, tp_size: int | None = None) -> dict[str, object]:
    """Per-rank parameter bytes under ``plan``: sharded, replicated, total, and per module.

    Works on a meta-device model (only shapes and dtypes are read), which is what the dry
    run prints. A sharded dim is split like ``torch.chunk``, so rank 0 holds the largest piece.
    """
    tp = plan.tp_size if tp_size is None else tp_size
    sharded = replicated = full = 0
    per_module: dict[str, int] = {}
    for mod_name, local, param in owned_params(module):
        shard = plan_param_shard(plan, module, mod_name, local)
        dim = None if shard is None else shard[0]
        nbytes = param.numel() * param.element_size()
        full += nbytes
        if dim is None or tp == 1:
            replicated += nbytes
            rank_bytes = nbytes
        else:
            size = param.shape[dim]
            rank_bytes = nbytes // size * -(-size // tp)
            sharded += rank_bytes
        per_module[mod_name] = per_module.get(mod_name, 0) + rank_bytes
    return {
        "sharded_bytes_per_rank": sharded,
        "replicated_bytes_per_rank": replicated,
        "total_bytes_per_rank": sharded + replicated,
        "unsharded_total_bytes": full,
        "per_module_bytes_per_rank": per_module,
        "replicated_modules": dict(plan.replicated),
    }
