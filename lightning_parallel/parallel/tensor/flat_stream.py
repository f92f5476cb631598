"""A block stack's sequence-split stream flattened to tokens, ``(B, T, C)`` -> ``(B*T, C)``, and back.

OPT (and models written like it: ``hidden_states.reshape(-1, C)`` around the MLP, ``.view(shape)``
after) flattens the hidden states to one row per token. Under sequence parallelism over the block
stacks (``sequence_stacks``) the stream is a ``Shard(1)`` DTensor: rank ``r`` holds tokens
``[r T/n, (r+1) T/n)`` of every sequence. Flattened, those rows are one block per sequence, the
placement ``_StridedShard(0, split_factor=B)``. DTensor reaches it on the forward reshape without
communication but has no rule back: it all-gathered the ``view`` to ``(B, T, C)`` and, in backward,
the reshape's gradient; a layer norm's backward on it gathered its inputs; and a row-parallel
layer's partial output was all-reduced into it (or, given the ``Shard(1)`` output rows get under
sequence parallelism, split along its features). Measured on OPT, tp2 with sequence parallelism:
1.28x the Megatron minimum.

Here both views are answered locally (the rank's rows are the same elements either way: exact, no
communication in either direction), a norm on the flattened stream runs on its ``(B, T, C)`` view
(where DTensor's norm rule reduces only the weights' gradients), and a row-parallel layer of a stack
layer reduce-scatters its partial output to the placement of the stream its column layers read.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_parallel.compat import StridedShard
from lightning_parallel.parallel.tensor.region_inputs import is_sequence_stream

_RESHAPES: frozenset[Callable[..., Any]] = frozenset({Tensor.reshape, Tensor.view, torch.reshape})
_NORMS: frozenset[Callable[..., Any]] = frozenset({F.layer_norm, F.rms_norm})


def _is_stream(x: object) -> bool:
    """A block stack's stream as ``(B, T, C)`` (``region_inputs.is_sequence_stream``, 3-D)."""
    return is_sequence_stream(x) and x.ndim == 3  # type: ignore[attr-defined]


def is_flat_stream(x: object) -> bool:
    """A stream flattened to tokens: a 2-D ``_StridedShard(0, B)`` DTensor on a 1-D mesh."""
    if not (isinstance(x, DTensor) and x.ndim == 2 and x.device_mesh.ndim == 1):
        return False
    placement = x.placements[0]
    return isinstance(placement, StridedShard) and placement.dim == 0 and x.shape[0] % placement.split_factor == 0


def _target(x: Tensor, size: tuple) -> tuple[int, ...] | None:
    """The shape a ``reshape``/``view`` call asks for, ``-1`` resolved; None if not plain ints."""
    shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    if not all(type(s) is int for s in shape) or list(shape).count(-1) > 1:
        return None
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or x.numel() % known:
            return None
        return tuple(x.numel() // known if s == -1 else s for s in shape)
    return tuple(shape)


def flatten_stream(x: DTensor) -> DTensor:
    """``(B, T, C)`` ``Shard(1)`` -> ``(B*T, C)`` ``_StridedShard(0, B)``: the local rows as they are."""
    (b, t, c), local = x.shape, x.to_local()
    return DTensor.from_local(local.reshape(-1, c), x.device_mesh, [StridedShard(0, split_factor=b)],
                              run_check=False, shape=torch.Size((b * t, c)), stride=(c, 1))


def unflatten_stream(x: DTensor) -> DTensor:
    """``(B*T, C)`` ``_StridedShard(0, B)`` -> ``(B, T, C)`` ``Shard(1)``: the local rows as they are."""
    b = x.placements[0].split_factor
    (rows, c), local = x.shape, x.to_local()
    t = rows // b
    return DTensor.from_local(local.reshape(b, -1, c), x.device_mesh, [Shard(1)], run_check=False,
                              shape=torch.Size((b, t, c)), stride=(t * c, c, 1))


def stream_view(func: Callable[..., Any], args: tuple, kwargs: dict) -> DTensor | None:
    """A ``reshape``/``view`` between a stream and its flattened tokens, answered locally; else None."""
    if func not in _RESHAPES or kwargs or len(args) < 2 or not isinstance(args[0], DTensor):
        return None
    x, mesh = args[0], args[0].device_mesh
    shape = _target(x, args[1:])
    if shape is None:
        return None
    if _is_stream(x) and shape == (x.shape[0] * x.shape[1], x.shape[2]):
        return flatten_stream(x)
    if (is_flat_stream(x) and len(shape) == 3 and shape[0] == x.placements[0].split_factor
            and shape[0] * shape[1] == x.shape[0] and shape[2] == x.shape[1] and shape[1] % mesh.size() == 0):
        return unflatten_stream(x)
    return None


def stream_norm(func: Callable[..., Any], args: tuple, kwargs: dict, call: Callable[..., Any]) -> DTensor | None:
    """A layer/RMS norm of a flattened stream, run on its ``(B, T, C)`` view (``call`` runs ``func``
    as the region's mode would); None for anything else."""
    if func not in _NORMS or not args or not is_flat_stream(args[0]):
        return None
    x = args[0]
    if x.shape[0] // x.placements[0].split_factor % x.device_mesh.size():
        return None
    out = call(func, (unflatten_stream(x), *args[1:]), kwargs)
    return flatten_stream(out) if _is_stream(out) else out.reshape(x.shape)


class _Seen(threading.local):
    flat: tuple[int, int] | None = None  # (rows, split factor) of the flattened stream a column layer last read


_SEEN = _Seen()


def note_column_input(x: Tensor) -> None:
    """Remember the layout of the stream a column-parallel layer of a stack layer reads, for the
    row-parallel layer after it (:func:`reduce_to_stream`)."""
    _SEEN.flat = (x.shape[0], x.placements[0].split_factor) if is_flat_stream(x) else None


def reduce_to_stream(module: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of a row-parallel layer in a stack layer: its ``Partial`` output reduce-scattered
    to the stream's placement, ``Shard(1)``, or for tokens flattened as its column layer read them,
    ``_StridedShard(0, B)`` (via the ``(B, T, C)`` view: a reduce-scatter, not an all-reduce);
    anything else all-reduced. Any placement is exact: the choice is only what it sends."""
    if not (isinstance(out, DTensor) and out.device_mesh.ndim == 1 and isinstance(out.placements[0], Partial)):
        return None
    mesh = out.device_mesh
    if out.ndim == 3:
        return out.redistribute(mesh, [Shard(1)])
    seen = _SEEN.flat
    if out.ndim == 2 and seen is not None and seen[0] == out.shape[0] and out.shape[0] // seen[1] % mesh.size() == 0:
        b = seen[1]
        split = out.view(b, out.shape[0] // b, out.shape[1]).redistribute(mesh, [Shard(1)])
        return flatten_stream(split)
    return out.redistribute(mesh, [Replicate()])


__all__ = ["flatten_stream", "is_flat_stream", "note_column_input", "reduce_to_stream", "stream_norm",
           "stream_view", "unflatten_stream"]
