"""Checkpoint layout of tensor-parallel parameters: every rank's piece as one box of the model's tensor.

Split out of :mod:`~lightning_parallel.parallel.tensor.fused` because two layouts meet here:
packed ``_StridedShard`` parameters (several boxes per rank) and parameters stored in rank order
(:mod:`~lightning_parallel.parallel.tensor.rank_order`: the right rows, not in the model's order).
A checkpoint holds neither: it holds the model's tensors, so it loads under any layout.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from lightning_parallel.compat import StridedShard
from lightning_parallel.parallel.tensor.rank_order import carry, full_natural, rank_order, stored_whole


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
        elif rank_order(value) is not None:  # stored in rank order: written in the model's order
            out[key] = distribute_tensor(full_natural(value), value.device_mesh, _contiguous_placements(value), src_data_rank=None)
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
        elif isinstance(value, DTensor) and isinstance(goal, DTensor) and rank_order(goal) is not None:
            stored = stored_whole(goal, value.full_tensor())
            out[key] = carry(goal, distribute_tensor(stored, goal.device_mesh, goal.placements, src_data_rank=None))
        elif isinstance(value, DTensor) and isinstance(goal, DTensor) and tuple(goal.placements) != tuple(value.placements):
            out[key] = value.redistribute(goal.device_mesh, goal.placements)
        else:
            out[key] = value
    return out


__all__ = ["checkpoint_layout", "restore_layout"]
