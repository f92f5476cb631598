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
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel.compat import in_backward, tensor_version

_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def replicated_region_input(x: Tensor, mesh: DeviceMesh) -> DTensor:
    """``x`` (a plain tensor, the same value on every rank of ``mesh``) as a replicated DTensor;
    the same DTensor for every region reading the same ``x`` in one forward (module doc)."""
    shareable = torch.is_grad_enabled() and x.requires_grad and not in_backward()
    key = (id(mesh), tensor_version(x))
    if shareable:
        entry = _SHARED.get(x)
        if entry is not None and entry[0] == key:
            shared = entry[1]()
            if shared is not None:
                return shared
    converted = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if shareable:
        _SHARED[x] = (key, weakref.ref(converted))
    return converted


def local_piece(x: Tensor, mesh: DeviceMesh, placement: Placement) -> Tensor:
    """This rank's piece, under ``placement``, of ``x`` (plain or a replicated DTensor: the same value
    on every rank): a local slice, no communication; differentiable, its gradient gathered back whole."""
    whole = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, [placement]).to_local()


__all__ = ["local_piece", "replicated_region_input"]
