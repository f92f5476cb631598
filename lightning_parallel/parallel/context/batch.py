"""Split a batch along the sequence for context parallelism.

Every rank of a ``cp`` group receives the same samples (the sampler's view is data-parallel);
the strategy then keeps this rank's head-tail chunks (``chunks.py``) of every tensor whose
sequence dimension it can tell: the sequence length is dim 1 of the first tensor with two or
more dims (``input_ids``, ``x``), and a tensor is split along dim 1 when that dim has this
length. Per-sample tensors (one dim) stay whole. A tensor whose sequence dimension cannot be
told apart (the length appears in another dim: a ``[B, S, S]`` mask, a ``[B, H, S]`` bias) is a
typed error that names it and says how to mark it with ``context_parallel_batch_dims``
(``{"path": dim}`` to split along ``dim``, ``{"path": None}`` to keep whole; a path is the
key or index of the entry, dotted for nested ones, e.g. ``"input_ids"``, ``"0"``, ``"1.mask"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_parallel.parallel.context.chunks import ChunkLayout
from lightning_parallel.parallel.errors import config_error

BatchDims = Mapping[str, "int | None"]


def _leaves(batch: Any, path: str = "") -> list[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, (list, tuple)):
        items = enumerate(batch)
    else:
        return []
    out: list[tuple[str, Tensor]] = []
    for key, value in items:
        out.extend(_leaves(value, f"{path}.{key}" if path else str(key)))
    return out


def _rebuild(batch: Any, new: dict[str, Tensor], path: str = "") -> Any:
    """``batch`` with the tensors at the paths of ``new`` replaced (containers rebuilt as their type)."""
    if isinstance(batch, Tensor):
        return new.get(path, batch)

    def child(key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    if isinstance(batch, Mapping):
        values = {k: _rebuild(v, new, child(k)) for k, v in batch.items()}
        try:
            return type(batch)(values)
        except TypeError:  # a mapping type that cannot be built from a dict
            return values
    if isinstance(batch, (list, tuple)):
        items = [_rebuild(v, new, child(i)) for i, v in enumerate(batch)]
        if isinstance(batch, tuple) and type(batch) is not tuple:  # a named tuple is built from its fields
            return type(batch)(*items)
        return type(batch)(items)
    return batch


def sequence_length(batch: Any, marks: BatchDims) -> tuple[int, str]:
    """The sequence length of ``batch`` and the entry it was read from."""
    leaves = _leaves(batch)
    for path, t in leaves:
        dim = marks[path] if path in marks else 1
        if dim is not None and t.ndim >= 2:
            return t.size(dim), path
    raise config_error(
        ValueError, "batch", [f"{p}: {tuple(t.shape)}" for p, t in leaves],
        "context parallelism splits the batch along the sequence, and no entry has a sequence dimension (two or more dims)",
        "feed token batches ([batch, sequence, ...]), or mark the sequence dim with context_parallel_batch_dims={'<path>': <dim>}",
    )


def split_batch(batch: Any, cp: int, rank: int, marks: BatchDims | None = None) -> tuple[Any, ChunkLayout]:
    """This rank's part of ``batch`` and the chunk layout it was cut with."""
    marks = dict(marks or {})
    seq_len, source = sequence_length(batch, marks)
    if seq_len % (2 * cp):
        raise config_error(
            ValueError, f"sequence length (batch entry {source!r})", seq_len,
            f"context parallelism cuts each sequence into 2 x context_parallel_size = {2 * cp} equal chunks"
            " (head-tail load balancing), so the length must be a multiple of it",
            f"pad or crop sequences to a multiple of {2 * cp} (e.g. {-(-seq_len // (2 * cp)) * 2 * cp})",
        )
    layout = ChunkLayout(seq_len, cp, rank)
    local: dict[str, Tensor] = {}
    for path, t in _leaves(batch):
        if path in marks:
            dim = marks[path]
        elif t.ndim >= 2 and t.size(1) == seq_len and seq_len not in t.shape[2:]:
            dim = 1
        elif seq_len in t.shape[1:]:
            raise config_error(
                ValueError, f"batch entry {path!r}", tuple(t.shape),
                f"its sequence dimension cannot be told apart (the sequence length {seq_len} appears in"
                f" dims {[d for d, n in enumerate(t.shape) if n == seq_len and d > 0]})",
                f"mark it: context_parallel_batch_dims={{{path!r}: <dim to split>}}, or {{{path!r}: None}} to keep it whole",
            )
        else:
            dim = None
        if dim is not None:
            local[path] = layout.split(t, dim)
    return _rebuild(batch, local), layout
