"""One replicated DTensor per input tensor, shared by every tensor-parallel region that reads it.

Why: a region turns each floating input into a replicated DTensor on entry, and that conversion's
backward reduces the partial gradient its column-parallel layers produce (one all-reduce). Two
regions reading the same tensor each converted it, so its gradient was reduced twice, where
summing the partial gradients first and reducing once gives the same value:

* parallel attention + MLP blocks with one norm (GPT-J; Falcon without ``new_decoder_architecture``):
  both read the block's one normalised input;
* encoder-decoders (T5, BART): every decoder layer's cross-attention reads the encoder's output.

Reusing the first conversion makes autograd sum the regions' partial gradients at the one
conversion node, whose backward then reduces them once. The reuse is valid only for the tensor as it
was converted: the entry is keyed by the tensor object (weakly: nothing here keeps it alive), the
mesh and the tensor's version counter (an in-place write in between makes a fresh conversion). It
holds the DTensor weakly too, so an entry lives only while a region's autograd graph saves the
DTensor; a conversion made without grad mode, or in a backward pass (an activation checkpoint's
recomputation, whose graph must not reach the original forward's), is never shared.

Under sequence parallelism over block stacks (``sequence_stacks``) the same holds for the split
stream: :func:`gathered_stream` gathers it once for every region reading it, and :func:`ungathered`
lets an arithmetic op that meets the gathered copy beside a split tensor use the stream itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel.compat import in_backward, tensor_version

_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a conversion -> the plain tensor it was made from


def shared_conversion(table: WeakIdKeyDictionary, x: Tensor, key: object, make: Callable[[], Any],
                      hold: bool = False) -> Any:
    """``make()``, made once per tensor ``x`` (and ``key``: its version, mesh...) for every reader, by
    the rule of the module doc: only in grad mode, for a tensor that needs a gradient, never in a
    backward pass; ``table`` keys ``x`` weakly and keeps the result weakly unless ``hold``."""
    shareable = torch.is_grad_enabled() and x.requires_grad and not in_backward()
    entry = table.get(x) if shareable else None
    if entry is not None and entry[0] == key:
        made = entry[1]()
        if made is not None:
            return made
    made = make()
    if shareable:
        table[x] = (key, (lambda: made) if hold else weakref.ref(made))
    return made


def is_replicated(x: object) -> bool:
    """The same value on every rank: a plain tensor, or a DTensor replicated on every mesh dim."""
    return not isinstance(x, DTensor) or all(isinstance(p, Replicate) for p in x.placements)


def replicated_region_input(x: Tensor, mesh: DeviceMesh) -> DTensor:
    """``x`` (a plain tensor, the same value on every rank of ``mesh``) as a replicated DTensor;
    the same DTensor for every region reading the same ``x`` in one forward (module doc)."""

    def convert() -> DTensor:
        converted = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
        _SOURCES[converted] = x
        return converted

    return shared_conversion(_SHARED, x, (id(mesh), tensor_version(x)), convert)


def replicated_source(x: Tensor) -> Tensor:
    """The plain tensor :func:`replicated_region_input` converted into ``x``, else ``x``: one key for a
    value that regions read both as it was made and as their converted input (``head_bias``)."""
    return _SOURCES.get(x, x) if isinstance(x, DTensor) else x


_GATHERED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a stack stream gathered for regions -> (key, the stream)
_STREAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a stack stream -> (key, weakref to its gathered DTensor)
_ARITHMETIC = frozenset({torch.add, torch.sub, torch.mul, Tensor.add, Tensor.sub, Tensor.mul, Tensor.__add__,
                         Tensor.__radd__, Tensor.__sub__, Tensor.__rsub__, Tensor.__mul__, Tensor.__rmul__})


def is_sequence_stream(x: object) -> bool:
    """A block stack's sequence-split stream: a ``Shard(1)`` DTensor on a 1-D (tensor-parallel) mesh."""
    return isinstance(x, DTensor) and x.device_mesh.ndim == 1 and x.placements[0] == Shard(1)


def gathered_stream(x: DTensor) -> DTensor:
    """A block stack's sequence-split stream (``Shard(1)``, ``sequence_stacks``) gathered for a region:
    once for every region reading it (a parallel block's attention and MLP), for the reason the module
    doc gives, with the same keying; the gathered DTensor remembers ``x`` (see :func:`ungathered`)."""

    def gather() -> DTensor:
        full = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        _GATHERED[full] = x
        return full

    return shared_conversion(_STREAMS, x, tensor_version(x), gather)


def ungathered(func: object, args: tuple) -> tuple:
    """``args`` of an arithmetic op with a gathered stream replaced by the stream itself when another
    argument is split along the sequence (BERT's and BART's residual add inside a region: the region's
    gathered input plus its reduce-scattered output).

    Why: the same values, but DTensor would slice the gathered operand (free) and, in backward, gather
    that slice's gradient to add it to the region input's: one all-gather and one reduce-scatter more
    per region than the Megatron minimum. With the split stream, both gradients are ``Shard(1)``."""
    if func not in _ARITHMETIC or len(args) != 2 or not _GATHERED:
        return args
    a, b = args
    for gathered, other in ((a, b), (b, a)):
        if isinstance(gathered, DTensor) and gathered in _GATHERED and isinstance(other, DTensor):
            stream = _GATHERED[gathered]
            if tuple(other.placements) == tuple(stream.placements) and other.shape == stream.shape:
                return (stream, b) if gathered is a else (a, stream)
    return args


def piece(x: Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    """This rank's piece, under ``placement``, of ``x`` (plain or a replicated DTensor: the same value
    on every rank) as a DTensor: a local slice, no communication; differentiable, its gradient
    gathered back whole."""
    whole = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, [placement])


def local_piece(x: Tensor, mesh: DeviceMesh, placement: Placement) -> Tensor:
    """:func:`piece` as this rank's local tensor."""
    return piece(x, mesh, placement).to_local()


__all__ = ["gathered_stream", "is_replicated", "is_sequence_stream", "local_piece", "piece", "shared_conversion", "replicated_region_input", "replicated_source", "ungathered"]
