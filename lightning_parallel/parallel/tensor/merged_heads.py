"""``baddbmm`` on heads merged into the batch dim, run on this rank's heads (Bloom's ALiBi scores).

Some attentions fold the heads into the batch before their matmuls: Bloom computes
``alibi.baddbmm(q.reshape(B * H, T, hd), k.reshape(B * H, T, hd).transpose(-1, -2))`` with a
replicated ``(B * H, 1, T)`` ALiBi bias. On head-split DTensors the reshape is exact and free:
DTensor gives ``_StridedShard(0, split_factor=B)`` (each batch element's rows ``b * H + h`` are
split over the ranks by head), and ``bmm``, ``softmax`` and the view back to ``(B, H, T, T)``
keep it (measured, torch 2.13: no collective). ``baddbmm`` has no rule for it, so DTensor
all-gathered q, k and the bias in every layer's forward and reduced their gradients back: three
all-gathers per layer where Megatron's attention needs none (issue 26, Bloom 1.73x the minimum).

Rows of the batch dim are independent in ``baddbmm`` (``out[i] = beta * input[i] + alpha *
batch1[i] @ batch2[i]``), so each rank computes its own rows with the same kernel on its local
pieces: the bias is cut to this rank's rows (a local slice of a replicated tensor, whose
gradient is gathered back; a bias of batch size 1 that needs no gradient broadcasts as is) and the
result is the same placement as the batches. Any other layout is left to DTensor (which gathers,
correctly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import StridedShard
from lightning_parallel.parallel.tensor.region_inputs import is_replicated, local_piece

_BADDBMM = frozenset({torch.baddbmm, Tensor.baddbmm, torch.ops.aten.baddbmm.default})
_ARGS = ("input", "batch1", "batch2")


def _batch_split(t: Any) -> StridedShard | None:
    """The placement of a 3-D DTensor whose batch dim holds merged, head-split rows, else None."""
    if isinstance(t, DTensor) and t.ndim == 3 and t.device_mesh.ndim == 1:
        placement = t.placements[0]
        if isinstance(placement, StridedShard) and placement.dim == 0:
            return placement
    return None


def local_baddbmm(func: Callable[..., Any], args: tuple, kwargs: dict) -> DTensor | None:
    """``baddbmm`` on this rank's rows when both batches are split like merged heads, else None."""
    if func not in _BADDBMM:
        return None
    bound = dict(zip(_ARGS, args), **kwargs)
    if len(args) > len(_ARGS) or set(bound) - {*_ARGS, "beta", "alpha"} or set(_ARGS) - set(bound):
        return None
    bias, b1, b2 = bound["input"], bound["batch1"], bound["batch2"]
    placement = _batch_split(b1)
    if placement is None or _batch_split(b2) != placement or b1.device_mesh != b2.device_mesh:
        return None
    if b1.shape[0] != b2.shape[0] or not isinstance(bias, Tensor) or bias.ndim != 3:
        return None
    mesh, rows = b1.device_mesh, b1.shape[0]
    if isinstance(bias, DTensor) and bias.device_mesh != mesh:
        return None
    if _batch_split(bias) == placement and bias.shape[0] == rows:
        local_bias = bias.to_local()
    elif is_replicated(bias) and bias.shape[0] == rows:
        local_bias = local_piece(bias, mesh, placement)  # this rank's rows, no communication
    elif is_replicated(bias) and bias.shape[0] == 1 and not bias.requires_grad:
        # broadcast over every row: its gradient would sum this rank's rows only, so one that needs
        # a gradient is left to DTensor
        local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    else:
        return None
    extra = {name: bound[name] for name in ("beta", "alpha") if name in bound}
    out = torch.baddbmm(local_bias, b1.to_local(), b2.to_local(), **extra)
    shape = (rows, b1.shape[1], b2.shape[2])
    stride = (shape[1] * shape[2], shape[2], 1)
    return DTensor.from_local(out, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)


__all__ = ["local_baddbmm"]
