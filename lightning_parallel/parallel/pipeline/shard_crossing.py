"""Tensor-parallel shards crossing a pipeline cut as shards, not gathered (tp x pp).

Why: a tensor-parallel stage's outputs leave as whole tensors (``TensorParallelStageForward``), so
a value that is split across the tp ranks when it reaches the cut is all-gathered first, and its
gradient, arriving whole on the next stage, is all-gathered again there on its way back from the
split computation that uses it. T5's relative position bias is such a value: computed per head in a
stack's first attention (its embedding split with the heads), handed to every later layer, across
every cut: measured tp2 x pp2, the first stage 1.07x and the last 1.14x the Megatron minimum
(1.00 and 1.00 now, ``benchmarks/bench_tp_comms.py``).

How, without changing the buffers torch's pipeline stages allocate from the trace: point-to-point
sends pair the same tensor-parallel rank of adjacent stages, so the sender puts its shard at its
own offset of the whole-shaped tensor (zeros elsewhere: the bytes of today's whole tensor, no
collective), and the receiver reads its slice back as the same ``Shard(dim)`` DTensor. The gradient
returns the same way: the receiver's is zero outside its slice, the sender reads its slice. Values
that are not split cross whole as before.

Which values: those a stage's forward returns as a DTensor split on one dim over the tp mesh
(evenly), seen in the first training step, which crosses whole. After it the stages agree once (one
``all_gather_object`` over the pipeline group): every sender and its receiver switch together from
the second step on. Only with gradients on: evaluation crosses whole (its stages may pair other
modules than training's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def split_dim(value: Any, mesh: DeviceMesh) -> int | None:
    """The dim ``value`` is split on over ``mesh`` if it can cross as a shard (one ``Shard`` over
    this 1-D mesh, even, floating), else None."""
    if not isinstance(value, DTensor) or value.device_mesh != mesh or not value.is_floating_point():
        return None
    (placement,) = value.placements
    if type(placement) is not Shard:  # not Replicate, Partial, or _StridedShard
        return None
    dim = placement.dim % value.ndim
    return dim if value.shape[dim] % mesh.size() == 0 else None


def embed_shard(value: DTensor, dim: int) -> Tensor:
    """The whole-shaped tensor holding this rank's shard of ``value`` at its offset, zeros elsewhere
    (differentiable: the gradient of the shard is the slice of the gradient)."""
    local = value.to_local()
    rank, ranks = value.device_mesh.get_local_rank(), value.device_mesh.size()
    width = local.shape[dim]
    pad = [0, 0] * (local.ndim - 1 - dim) + [rank * width, (ranks - 1 - rank) * width]
    return F.pad(local, pad)


def extract_shard(value: Tensor, dim: int, mesh: DeviceMesh) -> DTensor:
    """This rank's slice of a whole-shaped tensor made by :func:`embed_shard`, as the DTensor it was."""
    width = value.shape[dim] // mesh.size()
    local = value.narrow(dim, mesh.get_local_rank() * width, width)
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)


def agree_shard_crossings(
    forwards: dict[int, Any],
    sources: list[list[tuple[int, int] | None]],
    last_stage: int,
    group: dist.ProcessGroup,
) -> int:
    """After the first training step: every rank's split outputs seen (``forwards``: this rank's
    stage index -> its ``TensorParallelStageForward``), exchanged over ``group``; each stage then
    sends those as shards and reads the inputs they feed (``sources``: the pipe's wiring, from
    ``cut_grads.input_sources``) as shards. Returns how many values cross as shards."""
    mine = {(k, out): dim for k, fwd in forwards.items() if k != last_stage for out, dim in fwd.split_outputs_seen.items()}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    split: dict[tuple[int, int], int] = {key: dim for theirs in gathered for key, dim in theirs.items()}
    for k, fwd in forwards.items():
        fwd.shard_outputs = {out: dim for (stage, out), dim in split.items() if stage == k}
        fwd.shard_inputs = {i: split[src] for i, src in enumerate(sources[k]) if src is not None and src in split}
    return len(split)


def crossing_inputs(args: Iterable[Any], shard_inputs: dict[int, int], mesh: DeviceMesh) -> tuple[Any, ...]:
    """A stage's positional inputs with those sent as shards read back as DTensors (training only)."""
    if not shard_inputs or not torch.is_grad_enabled():
        return tuple(args)
    return tuple(extract_shard(a, shard_inputs[i], mesh) if i in shard_inputs else a for i, a in enumerate(args))


__all__ = ["agree_shard_crossings", "crossing_inputs", "embed_shard", "extract_shard", "split_dim"]
